"""HyperMixing's CPU training path against autodiff of the plain formulas.

``hyper_mlp`` (hand-written backward) against ``jax.grad`` of the formula,
``single_head_token_mixing`` against ``token_mixing_mlp``, and the module
with ``cpu_path`` on and off: same parameters, outputs and gradients.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax.models import common
from hypermixer_jax.models.hypermixer import HyperMixing
from hypermixer_jax.models.hypermixer import hyper_mlp
from hypermixer_jax.models.hypermixer import single_head_token_mixing
from hypermixer_jax.models.mlp_mixer import token_mixing_mlp

B, N, M, D, HIDDEN, D_PRIME = 2, 7, 5, 6, 11, 3


def _normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape)


def _plain_mlp(x, k1, b1, k2, b2):
  h = jnp.einsum("bnd,dk->bnk", x, k1) + (0.0 if b1 is None else b1)
  w = jnp.einsum("bnk,kf->bnf", common.gelu(h), k2)
  return w + (0.0 if b2 is None else b2)


@pytest.mark.parametrize("bias", [True, False])
def test_hyper_mlp_matches_autodiff_of_the_formula(bias):
  x = _normal(0, (B, N, D))
  k1, k2 = _normal(1, (D, HIDDEN)), _normal(2, (HIDDEN, D_PRIME))
  b1 = _normal(3, (HIDDEN,)) if bias else None
  b2 = _normal(4, (D_PRIME,)) if bias else None
  probe = _normal(5, (B, N, D_PRIME))
  args = (x, k1, b1, k2, b2)

  def loss(fn):
    return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a)) * probe),
                            argnums=(0, 1, 2, 3, 4) if bias else (0, 1, 3)))

  chex.assert_trees_all_close(hyper_mlp(*args), _plain_mlp(*args),
                              rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(loss(hyper_mlp)(*args), loss(_plain_mlp)(*args),
                              rtol=1e-5, atol=1e-5)


def test_single_head_mixing_equals_token_mixing_mlp():
  w_in, w_out = _normal(0, (B, N, D_PRIME)), _normal(1, (B, M, D_PRIME))
  v = _normal(2, (B, N, D))
  keys = (jnp.arange(N) < N - 2)[None, :, None] * jnp.ones((B, 1, 1))
  queries = (jnp.arange(M) != 1)[None, :, None] * jnp.ones((B, 1, 1))
  probe = _normal(3, (B, M, D))

  def grads(fn):
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * probe),
                            argnums=(0, 1, 2)))

  generic = lambda a, b, c: token_mixing_mlp(  # noqa: E731
      a[:, :, None], b[:, :, None], c[:, :, None], keys, queries)[:, :, 0]
  single = lambda a, b, c: single_head_token_mixing(  # noqa: E731
      a, b, c, keys, queries)
  chex.assert_trees_all_close(single(w_in, w_out, v),
                              generic(w_in, w_out, v), rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(grads(single)(w_in, w_out, v),
                              grads(generic)(w_in, w_out, v),
                              rtol=1e-5, atol=1e-5)


CASES = {
    "default": dict(),
    "official": dict(hyper_bias=False, input_scale=True, position_offset=1),
    "tied": dict(tied=True),
    "heads": dict(num_heads=2),
    "head_slices": dict(num_heads=2, head_slices=True),
    "causal": dict(causal=True),
    "packed": dict(max_segments=2),
    "padded": dict(),
    "cross": dict(),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_path_equals_generic_path(case):
  x = _normal(0, (B, N, D))
  kw = dict(mask=None, deterministic=False)
  if case == "packed":
    kw["segment_ids"] = jnp.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 2, 0,
                                                            0]])
  if case == "padded":
    kw["mask"] = jnp.arange(N)[None] < jnp.array([[N], [N - 3]])
  if case == "cross":
    kw["context"] = _normal(1, (B, M, D))
  fast, generic = (HyperMixing(D_PRIME, max_len=13, cpu_path=flag,
                               **CASES[case]) for flag in (True, False))
  params = generic.init(jax.random.key(2), x, **kw)
  chex.assert_trees_all_equal(fast.init(jax.random.key(2), x, **kw), params)
  probe = _normal(3, x.shape)

  def grads(module):
    loss = lambda p, x: jnp.sum(module.apply(p, x, **kw) * probe)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

  (value, grad), (ref_value, ref_grad) = grads(fast), grads(generic)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  chex.assert_trees_all_close(grad, ref_grad, rtol=1e-4, atol=1e-5)


def test_cpu_path_is_the_cpu_default():
  x = _normal(0, (B, N, D))
  params = HyperMixing(D_PRIME).init(jax.random.key(0), x)

  def traced(**kw):
    module = HyperMixing(D_PRIME, **kw)
    return str(jax.make_jaxpr(lambda p: module.apply(p, x))(params))

  assert common.target_platform() == "cpu"
  assert "custom_vjp_call" in traced()
  assert "custom_vjp_call" not in traced(cpu_path=False)
