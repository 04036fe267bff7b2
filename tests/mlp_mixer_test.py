"""MlpMixerTokenMixing vs a NumPy loop reference; padding, segments."""
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax.models.mlp_mixer import MlpMixerTokenMixing
from hypermixer_jax.models.mlp_mixer import token_mixing_mlp

B, N, D, D_S, MAX_LEN = 2, 7, 11, 5, 13


def np_gelu(x):
  return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def reference(params, x, positions):
  """One example, x [N, d]; explicit loops over features and tokens."""
  w_in, b_in = params["kernel_in"], params["bias_in"]
  w_out, b_out = params["kernel_out"], params["bias_out"]
  n, d = x.shape
  out = np.zeros((n, d))
  for f in range(d):
    hidden = np_gelu(sum(w_in[positions[j]] * x[j, f] for j in range(n)) + b_in)
    for i in range(n):
      out[i, f] = w_out[:, positions[i]] @ hidden + b_out[positions[i]]
  return out


def make(max_len=MAX_LEN, seed=0, **kw):
  """Perturbed (unboxed) params and a jitted apply."""
  module = MlpMixerTokenMixing(max_len, D_S, **kw)
  variables = nn.unbox(jax.jit(module.init)(jax.random.key(seed),
                                            jnp.zeros((B, N, D))))
  leaves, tree = jax.tree.flatten(variables)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  variables = tree.unflatten(  # non-zero biases
      [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])
  apply = jax.jit(lambda v, x, kw: module.apply(v, x, **kw))
  return variables, lambda x, **kw: apply(variables, x, kw)


def rand(*shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.parametrize("max_len", [N, MAX_LEN], ids=["full", "shorter"])
def test_matches_numpy_reference(max_len):
  variables, apply = make(max_len)
  x = rand(B, N, D, seed=3)
  positions = np.array([[0, 1, 2, 3, 4, 5, 6], [6, 2, 0, 1, 5, 4, 3]])
  params = jax.tree.map(lambda a: np.asarray(a, np.float64),
                        variables["params"])
  for kw in (dict(), dict(positions=jnp.asarray(positions))):
    pos = positions if kw else positions[:1].repeat(B, 0)
    expected = np.stack([reference(params, np.asarray(x[b], np.float64),
                                   pos[b]) for b in range(B)])
    np.testing.assert_allclose(apply(x, **kw), expected, rtol=2e-4, atol=2e-4)


def test_short_sequence_equals_zero_padding_to_max_len():
  _, apply = make()
  x = rand(B, N, D, seed=4)
  padded = jnp.pad(x, ((0, 0), (0, MAX_LEN - N), (0, 0)))
  chex.assert_trees_all_close(apply(x), apply(padded)[:, :N],
                              rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_segment_ids", [False, True])
def test_padded_equals_unpadded(use_segment_ids):
  _, apply = make()
  x, lengths = rand(B, N, D, seed=5), [N, 4]
  mask = jnp.arange(N)[None] < jnp.array(lengths)[:, None]
  kw = dict(segment_ids=mask.astype(jnp.int32)) if use_segment_ids else dict(
      mask=mask)
  y = apply(x, **kw)
  for b, length in enumerate(lengths):
    chex.assert_trees_all_close(y[b, :length], apply(x[b:b + 1, :length])[0],
                                rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y[b, length:], 0.0)


SEGMENTS = jnp.array([[1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 2, 2, 0, 0]])
POSITIONS = jnp.array([[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 0, 1, 0, 0]])


def test_packed_segments_do_not_mix():
  _, apply = make(max_segments=2)
  x = rand(B, N, D, seed=7)
  y = apply(x, segment_ids=SEGMENTS, positions=POSITIONS)
  for b, bounds in enumerate([[(0, 4), (4, 7)], [(0, 3), (3, 5)]]):
    for lo, hi in bounds:
      chex.assert_trees_all_close(y[b, lo:hi], apply(x[b:b + 1, lo:hi])[0],
                                  rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(y[1, 5:], 0.0)
  jac = jax.jacfwd(lambda r: apply(r, segment_ids=SEGMENTS[:1],
                                   positions=POSITIONS[:1]))(x[:1])[0, :, :, 0]
  np.testing.assert_array_equal(jac[:4, :, 4:], 0.0)  # [N, d, N, d]
  np.testing.assert_array_equal(jac[4:, :, :4], 0.0)
  assert np.abs(jac[:4, :, :4]).max() > 0


def test_segment_overflow_is_nan():
  _, apply = make()  # max_segments=1
  y = apply(rand(B, N, D), segment_ids=SEGMENTS, positions=POSITIONS)
  assert np.isfinite(y[0, :4]).all() and np.isnan(y[0, 4:]).all()


def test_logical_axes():
  variables = MlpMixerTokenMixing(MAX_LEN, D_S).init(jax.random.key(0),
                                                     jnp.zeros((1, N, D)))
  spec = nn.get_partition_spec(variables)["params"]
  assert spec["kernel_in"] == jax.P("seq_in", "token_mlp")
  assert spec["kernel_out"] == jax.P("token_mlp", "seq_out")
  assert spec["bias_out"] == jax.P("seq_out")


@pytest.mark.parametrize("length, call, message", [
    (MAX_LEN + 1, dict(), r"N=14 exceeds max_len=13; build the mixer with "
                          r"max_len >= 14"),
    (N, dict(mask=jnp.ones((B, N - 1), bool)), "mask has shape"),
    (N, dict(segment_ids=jnp.ones((1, N), jnp.int32)), "segment_ids has shape"),
], ids=["too_long", "mask_shape", "segment_ids_shape"])
def test_bad_inputs_raise(length, call, message):
  with pytest.raises(ValueError, match=message):
    MlpMixerTokenMixing(MAX_LEN, D_S).init(
        jax.random.key(0), jnp.zeros((B, length, D)), **call)


def test_bfloat16_forward_backward():
  variables, _ = make()
  x = rand(B, N, D, seed=9)
  mask = jnp.arange(N)[None] < jnp.array([[N], [5]])

  @jax.jit(static_argnums=2)
  def loss_and_grad(variables, x, dtype):
    module = MlpMixerTokenMixing(MAX_LEN, D_S, dtype=dtype)
    def loss(v, x):
      y = module.apply(v, x, mask=mask)
      return jnp.sum(y.astype(jnp.float32) ** 2), y
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(variables, x)

  (_, y16), g16 = loss_and_grad(variables, x, jnp.bfloat16)
  (_, y32), g32 = loss_and_grad(variables, x, jnp.float32)
  assert y16.dtype == jnp.bfloat16
  assert all(np.isfinite(np.asarray(g, np.float32)).all()
             for g in jax.tree.leaves(g16))
  scale = np.abs(y32).max()
  np.testing.assert_allclose(np.asarray(y16, np.float32), y32,
                             atol=0.05 * scale, rtol=0.05)
  np.testing.assert_allclose(np.asarray(g16[1], np.float32), g32[1],
                             atol=0.05 * np.abs(g32[1]).max(), rtol=0.1)


@pytest.mark.parametrize("approximate", [False, True])
def test_one_slot_fast_path_equals_the_slot_einsum(approximate):
  # S = 1 takes two plain matmuls; the same numbers through the general
  # S-slot einsum (a second, empty slot) must agree, for both GELUs.
  keys = jax.random.split(jax.random.key(3), 4)
  w_in = jax.random.normal(keys[0], (2, 7, 3, 5))
  w_out = jax.random.normal(keys[1], (2, 7, 3, 5))
  v = jax.random.normal(keys[2], (2, 7, 3, 11))
  mask = (jax.random.uniform(keys[3], (2, 7, 1)) > 0.3).astype(jnp.float32)
  two = jnp.concatenate([mask, jnp.zeros_like(mask)], axis=-1)
  bias = jnp.linspace(-1.0, 1.0, 5)
  fast = token_mixing_mlp(w_in, w_out, v, mask, mask, bias, approximate)
  slow = token_mixing_mlp(w_in, w_out, v, two, two, bias, approximate)
  np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-5)
  other = token_mixing_mlp(w_in, w_out, v, mask, mask, bias, not approximate)
  assert np.abs(np.asarray(fast - other)).max() > 1e-4
