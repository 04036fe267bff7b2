"""HyperMixing vs a NumPy loop reference; padding, segments, invariances."""
import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax.models.hypermixer import HyperMixing
from hypermixer_jax.models.hypermixer import causal_token_mixing

B, N, M, D_PRIME, MAX_LEN = 2, 7, 5, 3, 13


def np_gelu(x):
  return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def np_dense(p, x):
  bias = p["dense"].get("bias", 0.0)
  return x @ np.asarray(p["dense"]["kernel"]) + np.asarray(bias)


def np_sinusoidal(length, dim):
  half, table = dim // 2, np.zeros((length, dim))
  for pos in range(length):
    for i in range(half):
      angle = pos * math.exp(-math.log(10000.0) * i / max(half, 1))
      table[pos, i], table[pos, half + i] = math.sin(angle), math.cos(angle)
  return table


def np_head_hyper(net, t, num_heads):
  """Head h's own MLP on its slice t[h*w:(h+1)*w]; concatenated outputs."""
  width, out = t.shape[0] // num_heads, []
  for h in range(num_heads):
    piece = t[h * width:(h + 1) * width]
    hid = piece @ net["hidden_kernel"][h] + net.get(
        "hidden_bias", np.zeros((num_heads, 1)))[h]
    out.append(np_gelu(hid) @ net["out_kernel"][h] + net.get(
        "out_bias", np.zeros((num_heads, 1)))[h])
  return np.concatenate(out)


def reference(params, x, ctx, *, num_heads=1, tied=False,
              position="sinusoidal", layer_norm=True, causal=False,
              input_scale=False, position_offset=0, head_slices=False, **_):
  """One example: x [M, d] queries, ctx [N, d] keys/values; explicit loops."""
  m, d = x.shape
  n = ctx.shape[0]
  rows = max(m, n) + position_offset
  table = np.zeros((rows, d))
  if position == "learned":
    table = np.asarray(params["position_embedding"])
  elif position == "sinusoidal":
    table = np_sinusoidal(rows, d)
  scale = math.sqrt(d) if input_scale else 1.0
  net_in = params["hypernetwork" if tied else "hypernetwork_in"]
  net_out = params["hypernetwork" if tied else "hypernetwork_out"]
  if head_slices:
    hyper = lambda net, t: np_head_hyper(net, t, num_heads)  # noqa: E731
  else:
    hyper = lambda net, t: np_dense(  # noqa: E731
        net["out"], np_gelu(np_dense(net["hidden"], t)))
  w1 = np.stack([hyper(net_in, scale * ctx[j] + table[j + position_offset])
                 for j in range(n)])
  w2 = np.stack([hyper(net_out, scale * x[i] + table[i + position_offset])
                 for i in range(m)])
  head_width = d // num_heads
  out = np.zeros((m, d))
  for f in range(d):
    cols = slice(f // head_width * D_PRIME, (f // head_width + 1) * D_PRIME)
    for i in range(m):
      keys = range(i + 1) if causal else range(n)
      hidden = np_gelu(sum(w1[j, cols] * ctx[j, f] for j in keys))
      out[i, f] = w2[i, cols] @ hidden
  if layer_norm:
    ln = params["layer_norm"]["ln"]
    mu, var = out.mean(-1, keepdims=True), out.var(-1, keepdims=True)
    out = (out - mu) / np.sqrt(var + 1e-6) * ln["scale"] + ln["bias"]
  return out


@functools.lru_cache(maxsize=None)
def _make(d, seed, kw):
  return _build(d, seed, **dict(kw))


def make(d=11, seed=0, **kw):
  """Module, perturbed (unboxed) params and a jitted apply; made once per
  configuration, so that tests of the same module share its compiled
  programs (a new ``jax.jit`` traces and lowers again)."""
  return _make(d, seed, tuple(sorted(kw.items())))


def _build(d, seed, **kw):
  module = HyperMixing(D_PRIME, max_len=MAX_LEN, **kw)
  x = jnp.zeros((B, N, d))
  variables = nn.unbox(jax.jit(module.init)(jax.random.key(seed), x))
  leaves, tree = jax.tree.flatten(variables)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  variables = tree.unflatten(  # non-trivial LayerNorm, biases, positions
      [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)])
  apply = jax.jit(lambda v, x, kw: module.apply(v, x, **kw))
  return variables, lambda x, **kw: apply(variables, x, kw)


def rand(*shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


CASES = {
    "untied_sinusoidal_ln": dict(d=11),
    "tied_none_no_ln": dict(d=11, tied=True, position="none", layer_norm=False),
    "heads_learned_hidden": dict(d=10, num_heads=2, position="learned",
                                 hidden_dim=13),
    "cross_untied": dict(d=11, m=M),
    "cross_tied_heads_learned": dict(d=10, num_heads=2, tied=True, m=M,
                                     position="learned", layer_norm=False),
    "causal_heads": dict(d=10, num_heads=2, causal=True),
    # The official implementation's choices (no biases, sqrt(d) input scale,
    # positions from 1, per-head hypernetworks on their slice).
    "official_single_head": dict(d=11, hyper_bias=False, input_scale=True,
                                 position_offset=1),
    "official_heads_tied": dict(d=10, num_heads=2, tied=True, head_slices=True,
                                hyper_bias=False, input_scale=True,
                                position_offset=1),
    "head_slices_learned_cross": dict(d=10, num_heads=2, head_slices=True,
                                      position="learned", m=M,
                                      position_offset=2),
    "head_slices_causal": dict(d=10, num_heads=2, head_slices=True,
                               causal=True),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_matches_numpy_reference(case):
  cfg = dict(CASES[case])
  d, m = cfg.pop("d"), cfg.pop("m", None)
  variables, apply = make(d, **cfg)
  ctx = rand(B, N, d, seed=3)
  if m is None:
    y = apply(ctx)
    x = ctx
  else:
    x = rand(B, m, d, seed=4)
    y = apply(x, context=ctx)
  params = jax.tree.map(np.asarray, variables["params"])
  expected = np.stack([reference(params, np.asarray(x[b], np.float64),
                                 np.asarray(ctx[b], np.float64), **cfg)
                       for b in range(B)])
  np.testing.assert_allclose(y, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("cfg", [dict(num_heads=2, position="learned"),
                                 dict(causal=True, tied=True)],
                         ids=["learned_heads", "causal_tied"])
@pytest.mark.parametrize("left", [False, True], ids=["right_pad", "left_pad"])
@pytest.mark.parametrize("use_segment_ids", [False, True])
def test_padded_equals_unpadded(cfg, left, use_segment_ids):
  _, apply = make(d=10, **cfg)
  x, lengths = rand(B, N, 10, seed=5), np.array([N, 4])
  index = np.arange(N)[None] - (N - lengths[:, None] if left else 0)
  mask = jnp.asarray(index >= 0) & jnp.asarray(index < lengths[:, None])
  kw = dict(segment_ids=mask.astype(jnp.int32)) if use_segment_ids else dict(
      mask=mask)
  y = apply(x, positions=jnp.asarray(np.maximum(index, 0)), **kw)
  for b, length in enumerate(lengths):
    real = slice(N - length, N) if left else slice(0, length)
    chex.assert_trees_all_close(y[b, real], apply(x[b:b + 1, real])[0],
                                rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.delete(y[b], np.arange(N)[real], 0), 0.0)


def test_permutation_equivariance_only_without_positions():
  x, perm = rand(B, N, 11, seed=6), np.array([3, 0, 6, 1, 5, 2, 4])
  _, apply = make(position="none")
  chex.assert_trees_all_close(apply(x[:, perm]), apply(x)[:, perm],
                              rtol=1e-5, atol=1e-5)
  _, apply = make(position="sinusoidal")
  assert np.abs(apply(x[:, perm]) - apply(x)[:, perm]).max() > 1e-2


SEGMENTS = jnp.array([[1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 2, 2, 0, 0]])
POSITIONS = jnp.array([[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 0, 1, 0, 0]])


@pytest.mark.parametrize("cfg", [dict(max_segments=2, num_heads=2),
                                 dict(causal=True, position="learned")],
                         ids=["one_hot", "causal_scan"])
def test_packed_segments_do_not_mix(cfg):
  _, apply = make(d=10, **cfg)
  x = rand(B, N, 10, seed=7)
  y = apply(x, segment_ids=SEGMENTS, positions=POSITIONS)
  for b, bounds in enumerate([[(0, 4), (4, 7)], [(0, 3), (3, 5)]]):
    for lo, hi in bounds:
      chex.assert_trees_all_close(y[b, lo:hi], apply(x[b:b + 1, lo:hi])[0],
                                  rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(y[1, 5:], 0.0)
  jac = jax.jacrev(lambda r: apply(r, segment_ids=SEGMENTS[:1],
                                   positions=POSITIONS[:1]))(x[:1])[0, :, :, 0]
  np.testing.assert_array_equal(jac[:4, :, 4:], 0.0)  # [N, d, N, d]
  np.testing.assert_array_equal(jac[4:, :, :4], 0.0)
  assert np.abs(jac[:4, :, :4]).min(axis=(1, 3)).max() > 0


def test_causal_jacobian_is_lower_triangular():
  _, apply = make(d=10, num_heads=2, causal=True)
  jac = jax.jacrev(apply)(rand(1, N, 10, seed=8))[0, :, :, 0]  # [N, d, N, d]
  dependence = np.abs(jac).max(axis=(1, 3))  # [N_out, N_in]
  np.testing.assert_array_equal(np.triu(dependence, 1), 0.0)
  assert (np.diag(dependence) > 0).all() and dependence[N - 1, 0] > 0


def test_segment_overflow_is_nan():
  _, apply = make(d=10, max_segments=1)
  y = apply(rand(B, N, 10), segment_ids=SEGMENTS, positions=POSITIONS)
  assert np.isfinite(y[0, :4]).all() and np.isnan(y[0, 4:]).all()


def test_logical_axes():
  variables = HyperMixing(D_PRIME, num_heads=2, position="learned",
                          max_len=MAX_LEN).init(jax.random.key(0),
                                                jnp.zeros((1, N, 10)))
  spec = nn.get_partition_spec(variables)["params"]
  assert spec["hypernetwork_in"]["hidden"]["dense"]["kernel"] == (
      jax.P("embed", "mlp"))
  # The output layer reads the hidden layer: ('mlp', 'hyper'), not 'embed'.
  assert spec["hypernetwork_out"]["out"]["dense"]["kernel"] == jax.P(
      "mlp", "hyper")
  assert spec["position_embedding"] == jax.P("seq_in", "embed")


@pytest.mark.parametrize("kwargs, call, message", [
    (dict(), dict(context=jnp.zeros((B, N, 10))),
     r"context has shape \(2, 7, 10\) but x is \[B, M, d\] = \(2, 7, 11\)"),
    (dict(), dict(mask=jnp.ones((B, N + 1), bool)), "mask has shape"),
    (dict(num_heads=3), dict(), "num_heads=3 must divide"),
    (dict(position="learned", max_len=5), dict(), "exceeds max_len=5"),
    (dict(causal=True), dict(context=jnp.zeros((B, M, 11))), "causal"),
    (dict(position="rope"), dict(), "position='rope'"),
], ids=["context_width", "mask_shape", "heads", "max_len", "causal_cross",
        "position"])
def test_bad_inputs_raise(kwargs, call, message):
  module = HyperMixing(D_PRIME, **kwargs)
  with pytest.raises(ValueError, match=message):
    module.init(jax.random.key(0), jnp.zeros((B, N, 11)), **call)


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_forward_backward(causal):
  x = rand(B, N, 10, seed=9)
  mask = jnp.arange(N)[None] < jnp.array([[N], [5]])
  variables, _ = make(d=10, num_heads=2, causal=causal)

  @jax.jit(static_argnums=2)
  def loss_and_grad(variables, x, dtype):
    module = HyperMixing(D_PRIME, num_heads=2, causal=causal, max_len=MAX_LEN,
                         dtype=dtype)
    def loss(v, x):
      y = module.apply(v, x, mask=mask)
      return jnp.sum(y.astype(jnp.float32) ** 2), y
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(variables, x)

  (_, y16), g16 = loss_and_grad(variables, x, jnp.bfloat16)
  (_, y32), g32 = loss_and_grad(variables, x, jnp.float32)
  assert y16.dtype == jnp.bfloat16
  assert all(np.isfinite(np.asarray(g, np.float32)).all()
             for g in jax.tree.leaves(g16))
  np.testing.assert_allclose(np.asarray(y16, np.float32), y32, atol=0.1,
                             rtol=0.05)
  np.testing.assert_allclose(np.asarray(g16[1], np.float32), g32[1], atol=0.3,
                             rtol=0.1)


def test_official_options_change_the_function_and_parameters():
  x = rand(B, N, 10, seed=8)
  variables, apply = make(d=10, num_heads=2, head_slices=True,
                          hyper_bias=False)
  net = variables["params"]["hypernetwork_in"]
  assert set(net) == {"hidden_kernel", "out_kernel"}  # no biases
  assert net["hidden_kernel"].shape == (2, 5, 5)      # head reads d/H = 5
  _, plain = make(d=10, num_heads=2)
  _, scaled = make(d=10, num_heads=2, input_scale=True)
  assert np.abs(plain(x) - scaled(x)).max() > 1e-2


def test_tied_self_mixing_runs_the_hypernetwork_once():
  module = HyperMixing(D_PRIME, tied=True, max_len=MAX_LEN)
  x = rand(B, N, 11)
  variables = module.init(jax.random.key(0), x)
  count = lambda **kw: jax.jit(  # noqa: E731
      lambda v, x: module.apply(v, x, **kw)).lower(
          variables, x).as_text().count("dot_general")
  # Cross-mixing a sequence with itself gives the same function but must run
  # the hypernetwork (two matmuls) on both sides.
  assert count() + 2 == count(context=x)
  np.testing.assert_allclose(module.apply(variables, x),
                             module.apply(variables, x, context=x), rtol=1e-6)


def prefix_scan_reference(w_in, w_out, values, segment_ids):
  """The former exact causal path: a segmented associative scan that keeps
  every token's [H, f, d'] state (memory O(N d d'))."""
  b, n = values.shape[:2]
  z = jnp.einsum("bnhk,bnhf->bnhfk", w_in, values)
  starts = jnp.zeros((b, n), bool).at[:, 0].set(True)
  if segment_ids is not None:
    starts = starts.at[:, 1:].set(segment_ids[:, 1:] != segment_ids[:, :-1])

  def combine(left, right):
    (z_l, s_l), (z_r, s_r) = left, right
    return jnp.where(s_r[..., None, None, None], z_r, z_l + z_r), s_l | s_r

  hidden, _ = jax.lax.associative_scan(combine, (z, starts), axis=1)
  return jnp.einsum("bmhk,bmhfk->bmhf", w_out, nn.gelu(hidden, False))


def _sin_loss(f, seg):
  return lambda *a: jnp.sum(jnp.sin(f(*a, seg)))


def _scan_inputs():
  n, h, f, k = 17, 2, 5, 3
  keys = jax.random.split(jax.random.key(11), 3)
  w_in = jax.random.normal(keys[0], (2, n, h, k))
  w_out = jax.random.normal(keys[1], (2, n, h, k))
  v = jax.random.normal(keys[2], (2, n, h, f))
  seg = jnp.array([[1] * 5 + [2] * 7 + [1] * 3 + [0] * 2, [1] * n])
  return w_in, w_out, v, seg


@functools.lru_cache(maxsize=None)
def _prefix_scan_want():
  """The reference's outputs (with and without segment ids) and gradients,
  computed once for the chunk sizes."""
  w_in, w_out, v, seg = _scan_inputs()
  want = [prefix_scan_reference(w_in, w_out, v, s) for s in (seg, None)]
  g_want = jax.jit(jax.grad(_sin_loss(prefix_scan_reference, seg),
                            argnums=(0, 1, 2)))(w_in, w_out, v)
  return want, g_want


@pytest.mark.parametrize("chunk", [1, 3, 4, 17, 64])
def test_chunked_causal_scan_equals_prefix_scan(chunk):
  # N = 17 (prime): chunk 3 and 4 leave a ragged last chunk; segment runs
  # (including a non-contiguous id and padding) cross chunk boundaries.
  w_in, w_out, v, seg = _scan_inputs()
  fn = jax.jit(lambda a, b, c, s: causal_token_mixing(a, b, c, s, chunk),
               static_argnums=())
  want, g_want = _prefix_scan_want()
  for s, w in zip((seg, None), want):
    chex.assert_trees_all_close(fn(w_in, w_out, v, s), w, rtol=1e-5,
                                atol=1e-5)
  # Gradients too (the chunk body is rematerialised in the backward pass).
  g_got = jax.jit(jax.grad(_sin_loss(lambda a, b, c, s: causal_token_mixing(
      a, b, c, s, chunk), seg), argnums=(0, 1, 2)))(w_in, w_out, v)
  chex.assert_trees_all_close(g_got, g_want, rtol=1e-4, atol=1e-4)


def test_causal_module_chunking_invariant_and_jacobian_across_chunks():
  # The module with 2-token chunks (4 chunks over N = 7) equals one chunk,
  # and its Jacobian stays lower triangular across chunk boundaries.
  x = rand(1, N, 10, seed=12)
  variables, whole = make(d=10, num_heads=2, causal=True,
                          causal_chunk_size=64)
  module = HyperMixing(D_PRIME, max_len=MAX_LEN, num_heads=2, causal=True,
                       causal_chunk_size=2)
  small = jax.jit(lambda x: module.apply(variables, x))
  chex.assert_trees_all_close(small(x), whole(x), rtol=1e-5, atol=1e-5)
  dependence = np.abs(jax.jacrev(small)(x)[0, :, :, 0]).max(axis=(1, 3))
  np.testing.assert_array_equal(np.triu(dependence, 1), 0.0)
  assert (dependence[np.tril_indices(N)] > 0).all()


TWO_PASS = ["untied_sinusoidal_ln", "tied_none_no_ln", "heads_learned_hidden",
            "cross_untied", "cross_tied_heads_learned", "official_heads_tied",
            "head_slices_learned_cross"]


@pytest.mark.parametrize("case", TWO_PASS)
def test_two_pass_chunks_equal_one_pass(case):
  """Token chunks (uneven sizes, masks, segment ids) give the one-pass
  function: outputs and gradients w.r.t. parameters and inputs. Chunks of
  2 and of 5 tokens, against one one-pass program."""
  cfg = dict(CASES[case])
  d, m = cfg.pop("d"), cfg.pop("m", None)
  ctx = rand(B, N, d, seed=3)
  x = ctx if m is None else rand(B, m, d, seed=4)
  variables = make(d, **cfg)[0]
  seg = jnp.asarray(np.arange(x.shape[1])[None] < np.array([[x.shape[1]],
                                                             [3]]),
                    jnp.int32)
  ctx_seg = jnp.asarray(np.arange(N)[None] < np.array([[N - 1], [4]]),
                        jnp.int32)
  kw = dict(segment_ids=seg)
  if m is not None:
    kw.update(context=ctx, context_segment_ids=ctx_seg)

  def loss(module, v, x, ctx):
    call = dict(kw, context=ctx) if m is not None else kw
    y = module.apply(v, x, **call)
    return jnp.sum(jnp.sin(y)), y

  def grad(chunk_tokens):
    mod = HyperMixing(D_PRIME, max_len=MAX_LEN, chunk_tokens=chunk_tokens,
                      **cfg)
    if chunk_tokens:
      assert mod._chunks(B, N, x.shape[1]) > 2  # pylint: disable=protected-access
    return jax.jit(jax.grad(lambda v, x, c: loss(mod, v, x, c),
                            argnums=(0, 1, 2), has_aux=True))(
                                variables, x, ctx)

  g1, y1 = grad(0)
  assert np.abs(np.asarray(y1)).max() > 0.1
  for chunk_tokens in (2, 5):
    g2, y2 = grad(chunk_tokens)
    np.testing.assert_allclose(y2, y1, rtol=1e-5, atol=1e-5,
                               err_msg=f"chunk_tokens={chunk_tokens}")
    # float32 summation order only (in float64 the two agree to 1e-12 of
    # the gradients' size): tolerance relative to each array's largest
    # entry.
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
      scale = float(np.abs(np.asarray(b)).max())
      np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * scale + 1e-7,
                                 err_msg=f"chunk_tokens={chunk_tokens}")


def test_two_pass_is_the_cpu_default_and_can_be_turned_off():
  x = rand(4, 600, 8)
  auto = HyperMixing(16, max_len=600)
  assert jax.default_backend() == "cpu"
  assert auto._chunks(4, 600, 600) == 3   # pylint: disable=protected-access
  assert auto._chunks(1, 300, 300) == 1   # pylint: disable=protected-access
  # Training (deterministic=False) keeps one pass: the chunked backward is
  # slower; rows shorter than 2 x 128 tokens are not cut either.
  assert auto._chunks(4, 600, 600, False) == 1   # pylint: disable=protected-access
  assert auto._chunks(32, 128, 128) == 1   # pylint: disable=protected-access
  assert auto._chunks(8, 2048, 2048) == 16   # pylint: disable=protected-access
  assert HyperMixing(16, chunk_tokens=0)._chunks(4, 600, 600) == 1  # pylint: disable=protected-access
  variables = auto.init(jax.random.key(0), x)
  one = HyperMixing(16, max_len=600, chunk_tokens=0)
  np.testing.assert_allclose(auto.apply(variables, x),
                             one.apply(variables, x), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="chunk_tokens=-1 must be >= 0"):
    HyperMixing(16, chunk_tokens=-1).init(jax.random.key(0), x)
