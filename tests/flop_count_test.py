"""``train/flop_count.py``: matmul FLOPs on the jaxpr, loops by trip count."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hypermixer_jax.train import flop_count


def _s(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_dot_and_conv_closed_forms():
  assert flop_count.count_fn(lambda a, b: a @ b, _s(8, 16), _s(16, 4)).flops \
      == 2 * 8 * 16 * 4
  batched = flop_count.count_fn(
      lambda a, b: jnp.einsum("bnk,bkm->bnm", a, b), _s(3, 5, 7), _s(3, 7, 2))
  assert batched.flops == 2 * 3 * 5 * 2 * 7
  conv = flop_count.count_fn(
      lambda x, w: jax.lax.conv_general_dilated(
          x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")),
      _s(2, 10, 4), _s(3, 4, 6))
  assert conv.flops == 2 * (2 * 10 * 6) * 4 * 3


def test_scan_counts_its_body_length_times_and_grad_three_times():
  def f(x, w):
    def body(c, _):
      return jnp.tanh(c @ w), None
    return jax.lax.scan(body, x, None, length=5)[0].sum()
  one = 2 * 8 * 16 * 16
  assert flop_count.count_fn(f, _s(8, 16), _s(16, 16)).flops == 5 * one
  grads = flop_count.count_fn(jax.grad(f, argnums=(0, 1)), _s(8, 16),
                              _s(16, 16))
  assert grads.flops == 3 * 5 * one and grads.uncounted_loops == 0
  # XLA's own count reads the loop body once.
  xla = jax.jit(f).lower(jnp.zeros((8, 16)), jnp.zeros((16, 16))).compile(
      ).cost_analysis()["flops"]
  assert xla < 2 * one


def test_while_loops_are_counted_once_and_reported():
  def f(x, w):
    return jax.lax.while_loop(lambda c: c[1] < 3,
                              lambda c: (c[0] @ w, c[1] + 1), (x, 0))[0]
  c = flop_count.count_fn(f, _s(4, 4), _s(4, 4))
  assert c.flops == 2 * 4 * 4 * 4 and c.uncounted_loops == 1


def test_cond_takes_the_costliest_branch():
  def f(p, x, w):
    return jax.lax.cond(p, lambda: (x @ w) @ w, lambda: x @ w)
  c = flop_count.count_fn(f, jax.ShapeDtypeStruct((), jnp.bool_), _s(4, 4),
                          _s(4, 4))
  assert c.flops == 2 * 2 * 4 * 4 * 4


def test_shard_map_bodies_count_for_every_device():
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,))
  f = jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P("x"), P()),
                    out_specs=P("x"))
  whole = flop_count.count_fn(lambda a, b: a @ b, _s(16, 8), _s(8, 4)).flops
  assert flop_count.count_fn(f, _s(16, 8), _s(8, 4)).flops == whole
  np.testing.assert_allclose(
      f(jnp.ones((16, 8)), jnp.ones((8, 4))), 8.0)


def test_the_scanned_stack_counts_like_the_unrolled_one():
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.models import zoo  # pylint: disable=g-import-not-at-top
  counts = []
  for scan in (False, True):
    c = zoo.default_model_config()
    c.update(num_layers=3, d_model=32, d_ffn=48, vocab_size=50, max_len=12,
             scan_layers=scan)
    model = models.build_model(c)
    ids = jax.ShapeDtypeStruct((2, 12), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), ids)
    counts.append(flop_count.count_fn(
        jax.grad(lambda p, x: model.apply(p, x).sum()), params, ids).flops)
  assert counts[0] == pytest.approx(counts[1]) and counts[0] > 0
