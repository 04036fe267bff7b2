"""Tests for gMLP / aMLP: NumPy loop references, FFT, causality, packing."""
import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax.models import gmlp

B, N, D, D_FFN, L, D_ATTN = 2, 7, 11, 10, 13, 3
SEG = np.array([[1, 1, 2, 2, 2, 2, 0]])   # two packed examples and a pad
POS = np.array([[0, 1, 0, 1, 2, 3, 0]])
SEG2 = np.concatenate([SEG, [[1, 1, 1, 1, 1, 2, 2]]])
POS2 = np.concatenate([POS, [[0, 1, 2, 3, 4, 0, 1]]])


def _init(module, x, seed=0, scale=0.5):
  """Unboxed variables with every leaf randomised (so W mixes visibly)."""
  params = nn.meta.unbox(module.init(jax.random.key(seed), x))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(tree, [scale * jax.random.normal(k, l.shape)
                                   for k, l in zip(keys, leaves)])


def _np(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def _x(n=N, b=B, seed=3):
  return jax.random.normal(jax.random.key(seed), (b, n, D))


# --------------------------- NumPy references ------------------------------
def np_dense(x, p):
  out = np.zeros(x.shape[:2] + (p["kernel"].shape[1],))
  for b in range(x.shape[0]):
    for n in range(x.shape[1]):
      out[b, n] = x[b, n] @ p["kernel"] + p["bias"]
  return out


def np_gelu(x):
  return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def np_layernorm(x, p, eps=1e-6):
  out = np.zeros_like(x)
  for b in range(x.shape[0]):
    for n in range(x.shape[1]):
      v = x[b, n]
      mu, var = v.mean(), ((v - v.mean()) ** 2).mean()
      out[b, n] = (v - mu) / math.sqrt(var + eps) * p["scale"] + p["bias"]
  return out


def _allowed(b, i, j, mask, seg, causal):
  if mask is not None and not mask[b, j]:
    return False
  if seg is not None and seg[b, i] != seg[b, j]:
    return False
  return not (causal and j > i)


def np_spatial(z, p, *, toeplitz, causal, mask=None, seg=None, pos=None):
  bsz, n, _ = z.shape
  pos = np.tile(np.arange(n), (bsz, 1)) if pos is None else pos
  out = np.zeros_like(z)
  for b in range(bsz):
    for i in range(n):
      out[b, i] = p["bias"][pos[b, i]]
      for j in range(n):
        if not _allowed(b, i, j, mask, seg, causal):
          continue
        if toeplitz:
          w = p["kernel"][pos[b, i] - pos[b, j] + L - 1]
        else:
          w = p["kernel"][pos[b, i], pos[b, j]]
        out[b, i] += w * z[b, j]
  return out


def np_tiny_attention(x, p, *, causal, mask=None, seg=None):
  qkv = np_dense(x, p["qkv"]["dense"])
  q, k, v = qkv[..., :D_ATTN], qkv[..., D_ATTN:2 * D_ATTN], qkv[..., 2 * D_ATTN:]
  out = np.zeros_like(q)
  for b in range(x.shape[0]):
    for i in range(x.shape[1]):
      js = [j for j in range(x.shape[1]) if _allowed(b, i, j, mask, seg, causal)]
      if not js:
        continue
      s = np.array([q[b, i] @ k[b, j] / math.sqrt(D_ATTN) for j in js])
      a = np.exp(s - s.max())
      a /= a.sum()
      for aj, j in zip(a, js):
        out[b, i] += aj * v[b, j]
  return np_dense(out, p["out"]["dense"])


def np_sgu(x, p, *, toeplitz=False, causal=False, tiny=False, mask=None,
           seg=None, pos=None):
  z = np_gelu(np_dense(x, p["proj_in"]["dense"]))
  z1, z2 = z[..., :D_FFN // 2], z[..., D_FFN // 2:]
  z2 = np_spatial(np_layernorm(z2, p["norm"]["ln"]), p["spatial"],
                  toeplitz=toeplitz, causal=causal, mask=mask, seg=seg, pos=pos)
  if tiny:
    z2 = z2 + np_tiny_attention(x, p["tiny_attention"], causal=causal,
                                mask=mask, seg=seg)
  return np_dense(z1 * z2, p["proj_out"]["dense"])


def _sgu(**kw):
  return gmlp.SpatialGatingUnit(
      D_FFN, L, tiny_attention_dim=D_ATTN if kw.pop("tiny", False) else None,
      **kw)


VARIANTS = [
    ("dense", dict()),
    ("toeplitz", dict(toeplitz=True)),
    ("toeplitz_fft", dict(toeplitz=True, use_fft=True)),
    ("causal", dict(causal=True)),
    ("causal_toeplitz_fft", dict(causal=True, toeplitz=True, use_fft=True)),
    ("amlp", dict(tiny=True)),
    ("amlp_causal", dict(tiny=True, causal=True)),
]


# ------------------------------- tests -------------------------------------
@pytest.mark.parametrize("name,kw", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_sgu_matches_numpy(name, kw):
  del name
  module, x = _sgu(**kw), _x()
  mask = np.array([[1] * N, [1] * 5 + [0] * 2], bool)
  v = _init(module, x)
  y = jax.jit(module.apply)(v, x, mask=mask)
  ref = np_sgu(np.asarray(x, np.float64), _np(v)["params"],
               toeplitz=kw.get("toeplitz", False),
               causal=kw.get("causal", False), tiny=kw.get("tiny", False),
               mask=mask)
  np.testing.assert_allclose(y[mask], ref[mask], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_tiny_attention_blockwise_packed_matches_numpy(causal):
  """aMLP's attention on the block-wise path (block 3: N=7 pads to 9)."""
  module = gmlp.TinyAttention(5, D_ATTN, causal=causal,
                              implementation="blockwise", block_size=3)
  x = _x(b=1)
  v = _init(module, x)
  y = jax.jit(module.apply)(v, x, segment_ids=SEG)
  real = SEG > 0
  ref = np_tiny_attention(np.asarray(x, np.float64), _np(v)["params"],
                          causal=causal, mask=real, seg=SEG)
  np.testing.assert_allclose(y[real], ref[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("toeplitz,causal", [(False, False), (True, False),
                                             (False, True), (True, True)])
def test_spatial_projection_packed_matches_numpy(toeplitz, causal):
  module = gmlp.SpatialProjection(L, toeplitz=toeplitz, causal=causal)
  z = _x()
  v = _init(module, z)
  y = jax.jit(module.apply)(v, z, segment_ids=SEG2, positions=POS2)
  ref = np_spatial(np.asarray(z, np.float64), _np(v)["params"],
                   toeplitz=toeplitz, causal=causal, mask=SEG2 > 0, seg=SEG2,
                   pos=POS2)
  np.testing.assert_allclose(y[SEG2 > 0], ref[SEG2 > 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 5, 8, L])
def test_fft_matches_dense_toeplitz(n, causal):
  dense = gmlp.SpatialProjection(L, toeplitz=True, causal=causal)
  fft = gmlp.SpatialProjection(L, toeplitz=True, causal=causal, use_fft=True)
  z = _x(n)
  v = _init(dense, z)
  mask = jnp.arange(n)[None, :] < jnp.array([[n], [max(n - 2, 1)]])
  chex.assert_trees_all_close(jax.jit(fft.apply)(v, z, mask=mask),
                              jax.jit(dense.apply)(v, z, mask=mask),
                              rtol=1e-5, atol=1e-5)


def test_init_starts_as_ffn():
  module, x = _sgu(), _x()
  p = nn.meta.unbox(module.init(jax.random.key(0), x))["params"]
  w, b = p["spatial"]["kernel"], p["spatial"]["bias"]
  assert w.shape == (L, L) and 0 < float(jnp.abs(w).max()) <= 1e-3 / L
  np.testing.assert_array_equal(b, np.ones(L))
  # f(LN(Z2)) ~= 1, so SGU(x) ~= GELU(x U)[:, :, :d_ffn/2] V.
  z = nn.gelu(x @ p["proj_in"]["dense"]["kernel"]
              + p["proj_in"]["dense"]["bias"], approximate=False)
  ffn = (z[..., :D_FFN // 2] @ p["proj_out"]["dense"]["kernel"]
         + p["proj_out"]["dense"]["bias"])
  y = jax.jit(module.apply)({"params": p}, x)
  np.testing.assert_allclose(y, ffn, atol=5e-3)
  f = gmlp.SpatialProjection(L).apply({"params": p["spatial"]},
                                      jax.random.normal(jax.random.key(1),
                                                        (B, N, 5)))
  np.testing.assert_allclose(f, 1.0, atol=5e-3)


@pytest.mark.parametrize("name,kw", VARIANTS[::2], ids=[v[0] for v in VARIANTS[::2]])
def test_padding_does_not_change_real_tokens(name, kw):
  del name
  module, x = _sgu(**kw), _x(b=1)
  v = _init(module, x)
  mask = jnp.arange(N)[None] < 5
  padded = jax.jit(module.apply)(v, x, mask=mask)
  alone = jax.jit(module.apply)(v, x[:, :5])
  chex.assert_trees_all_close(padded[:, :5], alone, rtol=1e-5, atol=1e-5)


def _block(dtype=jnp.float32, **sgu_kw):
  """A gMLP block around an SGU of the test sizes (the block takes the SGU
  as a factory, like ``MixerBlock`` its mixer)."""
  return gmlp.GmlpBlock(
      functools.partial(gmlp.SpatialGatingUnit, D_FFN, L, dtype=dtype,
                        **sgu_kw), dtype=dtype)


def _jacobian(module, v, x, **kw):
  """``J[i, j] = max |d y_i / d x_j|`` for a single row."""
  f = lambda x1: module.apply(v, x1[None], **kw)[0]
  jac = jax.jit(jax.jacrev(f))(x[0])                          # [N, d, N, d]
  return np.abs(np.asarray(jac)).max(axis=(1, 3))


@pytest.mark.parametrize("module", [
    _sgu(causal=True), _sgu(causal=True, toeplitz=True, use_fft=True),
    _sgu(causal=True, tiny=True),
    gmlp.TinyAttention(5, D_ATTN, causal=True),
    _block(causal=True, tiny_attention_dim=D_ATTN),
], ids=["sgu", "sgu_fft", "amlp", "tiny_attention", "block"])
def test_causal_jacobian(module):
  x = _x(b=1)
  j = _jacobian(module, _init(module, x), x)
  upper, lower = np.triu_indices(N, 1), np.tril_indices(N, -1)
  np.testing.assert_allclose(j[upper], 0.0, atol=1e-6)
  assert j[lower].min() > 1e-4


@pytest.mark.parametrize("name,kw", VARIANTS[1::2], ids=[v[0] for v in VARIANTS[1::2]])
def test_packed_equals_separate(name, kw):
  del name
  module, x = _sgu(**kw), _x(b=1)
  v = _init(module, x)
  packed = jax.jit(module.apply)(v, x, segment_ids=SEG, positions=POS)
  for lo, hi in [(0, 2), (2, 6)]:
    alone = module.apply(v, x[:, lo:hi])
    chex.assert_trees_all_close(packed[:, lo:hi], alone, rtol=1e-5, atol=1e-5)
  j = _jacobian(module, v, x, segment_ids=SEG, positions=POS)
  cross = SEG[0][:, None] != SEG[0][None, :]
  real = (SEG[0] > 0)[:, None] & (SEG[0] > 0)[None, :]
  np.testing.assert_array_equal(j[cross & real], 0.0)


def test_block_matches_numpy():
  module, x = _block(tiny_attention_dim=D_ATTN), _x()
  v = _init(module, x)
  y = jax.jit(module.apply)(v, x)
  p = _np(v)["params"]
  xn = np.asarray(x, np.float64)
  ref = xn + np_sgu(np_layernorm(xn, p["norm"]["ln"]), p["sgu"], tiny=True)
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


def test_bad_inputs():
  x = _x()
  with pytest.raises(ValueError, match=r"N=17 exceeds max_len=13.*max_len >= 17"):
    _sgu().init(jax.random.key(0), _x(17))
  with pytest.raises(ValueError, match=r"mask has shape \(2, 5\)"):
    _sgu().init(jax.random.key(0), x, mask=jnp.ones((2, 5), bool))
  with pytest.raises(ValueError, match="d_ffn=9 is odd"):
    gmlp.SpatialGatingUnit(9, L).init(jax.random.key(0), x)


def test_bfloat16_forward_backward():
  kw = dict(causal=True, tiny_attention_dim=D_ATTN)
  f32 = _block(**kw)
  bf16 = _block(dtype=jnp.bfloat16, **kw)
  x = _x()
  v = _init(f32, x, scale=0.2)

  def loss_and_grad(module):
    loss = lambda p: jnp.sum(module.apply(p, x).astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(loss))(v)

  (l32, g32), (l16, g16) = loss_and_grad(f32), loss_and_grad(bf16)
  assert all(jnp.isfinite(g).all() for g in jax.tree.leaves(g16))
  assert jax.tree.leaves(g16)[0].dtype == jnp.float32
  np.testing.assert_allclose(l16, l32, rtol=5e-2)
  chex.assert_trees_all_close(g16, g32, rtol=0.1, atol=0.1 * max(
      float(jnp.abs(g).max()) for g in jax.tree.leaves(g32)))
