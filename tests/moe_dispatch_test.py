"""MoE dispatch by index == GShard's one-hot einsums: outputs and gradients."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax.models.moe import (MoeFeedForward, SparseSpatialMixing,
                                       routers)

B, N, D, F, E = 3, 12, 5, 7, 4          # N % E == 0 for Base Layers
COLLECTIONS = ["aux_loss", "moe_metrics"]


def _inputs():
  x = jax.random.normal(jax.random.key(0), (B, N, D))
  ids = jax.random.randint(jax.random.key(1), (B, N), 0, 37)
  seg = np.ones((B, N), np.int32)
  seg[1, 9:] = 0                                          # some padding
  return x, ids, jnp.asarray(seg)


def _value_and_grads(make, params, x, **kw):
  """Output and d sum(y * r) / d (params, x) of ``make(dispatch)`` for both
  dispatches (r a fixed random cotangent, so every output element counts),
  computed side by side in one program."""

  def value_and_grad(dispatch, p, x):
    layer = make(dispatch)

    def f(p, x):
      y, _ = layer.apply({"params": p}, x, mutable=COLLECTIONS,
                         rngs={"dropout": jax.random.key(5)}, **kw)
      r = jax.random.normal(jax.random.key(6), y.shape)
      return jnp.sum(y * r), y

    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(p, x)
    return y, grads

  return jax.jit(lambda p, x: tuple(
      value_and_grad(d, p, x) for d in ("index", "einsum")))(params, x)


def _assert_same(index, einsum, tol=1e-5):
  (y_i, g_i), (y_e, g_e) = index, einsum
  np.testing.assert_allclose(y_i, y_e, rtol=tol, atol=tol)
  assert np.abs(np.asarray(y_e)).max() > 0.1      # not trivially zero
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=tol,
                                                       atol=tol), g_i, g_e)


@pytest.mark.parametrize("router,token_priority,deterministic", [
    ("switch", False, False), ("gshard", False, False), ("gshard", True, True),
    ("base", False, False), ("base", False, True), ("hash", False, False)])
def test_tmoe_index_dispatch_equals_einsum(router, token_priority,
                                           deterministic):
  x, ids, seg = _inputs()
  # Capacity factor 0.5 drops tokens in training; 2.0 at inference.
  make = lambda dispatch: MoeFeedForward(
      E, F, router=router, capacity_factor=0.5, token_priority=token_priority,
      vocab_size=37, jitter_noise=0.1, dispatch=dispatch)
  params = nn.unbox(jax.jit(lambda k: make("index").init(
      k, x, token_ids=ids))(jax.random.key(2))["params"])
  index, einsum = _value_and_grads(
      make, params, x, segment_ids=seg, token_ids=ids,
      deterministic=deterministic)
  _assert_same(index, einsum)
  if router != "hash":     # the router learns through the gates
    assert np.abs(index[1][0]["router"]["dense"]["kernel"]).max() > 0


@pytest.mark.parametrize("routing", ["deterministic", "partial"])
def test_smoe_index_dispatch_equals_einsum(routing):
  v = jax.random.normal(jax.random.key(0), (B, N, 8))
  seg = np.ones((B, N), np.int32)
  seg[2, 7:] = 0
  make = lambda dispatch: SparseSpatialMixing(
      E, N, routing=routing, capacity_factor=0.5, init_scale=1.0,
      dispatch=dispatch)
  params = nn.unbox(jax.jit(make("index").init)(jax.random.key(2),
                                                 v)["params"])
  index, einsum = _value_and_grads(make, params, v, segment_ids=seg,
                                   deterministic=False)
  _assert_same(index, einsum)
  if routing == "partial":   # some columns were dropped, some kept
    _, aux = jax.jit(lambda p: make("index").apply(
        {"params": p}, v, segment_ids=seg, deterministic=False,
        mutable=COLLECTIONS))(params)
    dropped = float(aux["moe_metrics"]["dropped_fraction"][0])
    assert 0 < dropped < 1


def test_index_dispatch_has_no_slot_tensor():
  """The index path never builds an [S, E, C] array: its jaxpr's largest
  intermediate is linear in the tokens."""
  s, e, d = 256, 8, 4
  cap = routers.expert_capacity(s, e, 2.0)
  logits = jax.random.normal(jax.random.key(0), (s, e))
  x = jax.random.normal(jax.random.key(1), (s, d))

  def moe(dispatch):
    def f(logits, x):
      routes, _ = routers.switch_route(logits, capacity=cap)
      if dispatch == "index":
        return routers.combine_slots(
            routers.gather_slots(x, routes, e, cap), routes)
      dis, comb = routers.dense(routes, e, cap)
      return jnp.einsum("sec,ecd->sd", comb,
                        jnp.einsum("sec,sd->ecd", dis, x))
    return f

  def largest(f):
    jaxpr = jax.make_jaxpr(f)(logits, x).jaxpr
    return max(np.prod(v.aval.shape) for eqn in jaxpr.eqns
               for v in eqn.outvars)

  np.testing.assert_allclose(jax.jit(moe("index"))(logits, x),
                             jax.jit(moe("einsum"))(logits, x),
                             rtol=1e-6, atol=1e-6)
  assert largest(moe("einsum")) >= s * e * cap
  assert largest(moe("index")) <= max(s * e, e * cap * d)


def test_unknown_dispatch_is_refused():
  x, _, _ = _inputs()
  with pytest.raises(ValueError, match="dispatch='onehot'.*'index'"):
    MoeFeedForward(E, F, dispatch="onehot").init(jax.random.key(0), x)
