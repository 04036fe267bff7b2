"""Tests for softmax and linear attention against NumPy loop references."""
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax.models import attention

B, N, D, H = 2, 7, 15, 3          # head_dim = 5
DH = D // H
SEG = np.array([[1, 1, 2, 2, 2, 2, 0]])
SEG2 = np.array([[1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 2, 2]])
MASK = np.array([[1] * N, [1] * 5 + [0] * 2], bool)


def _init(module, x, seed=0, scale=0.4):
  params = nn.meta.unbox(module.init(jax.random.key(seed), x))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  return jax.tree.unflatten(tree, [scale * jax.random.normal(k, l.shape)
                                   for k, l in zip(keys, leaves)])


def _x(n=N, b=B, seed=3):
  return jax.random.normal(jax.random.key(seed), (b, n, D))


def _allowed(b, i, j, mask, seg, causal):
  if mask is not None and not mask[b, j]:
    return False
  if seg is not None and seg[b, i] != seg[b, j]:
    return False
  return not (causal and j > i)


def _heads(x, p):
  """Per-token, per-head projections with explicit loops: [B, N, H, Dh]."""
  out = np.zeros(x.shape[:2] + (H, DH))
  for b in range(x.shape[0]):
    for n in range(x.shape[1]):
      for h in range(H):
        for e in range(DH):
          out[b, n, h, e] = x[b, n] @ p["kernel"][:, h, e] + p["bias"][h, e]
  return out


def _out(o, p):
  y = np.zeros(o.shape[:2] + (D,))
  for b in range(o.shape[0]):
    for n in range(o.shape[1]):
      y[b, n] = p["bias"] + sum(o[b, n, h] @ p["kernel"][h] for h in range(H))
  return y


def np_softmax_attention(x, p, *, causal=False, mask=None, seg=None):
  q, k, v = (_heads(x, p[name]) for name in ("query", "key", "value"))
  o = np.zeros_like(q)
  for b in range(x.shape[0]):
    for h in range(H):
      for i in range(x.shape[1]):
        js = [j for j in range(x.shape[1])
              if _allowed(b, i, j, mask, seg, causal)]
        if not js:
          continue
        s = np.array([q[b, i, h] @ k[b, j, h] / math.sqrt(DH) for j in js])
        a = np.exp(s - s.max())
        a /= a.sum()
        for aj, j in zip(a, js):
          o[b, i, h] += aj * v[b, j, h]
  return _out(o, p["out"])


def np_linear_attention(x, p, *, causal=False, mask=None, seg=None, eps=1e-6):
  phi = lambda t: np.where(t > 0, t + 1.0, np.exp(t))
  q, k, v = (_heads(x, p[name]) for name in ("query", "key", "value"))
  q, k = phi(q), phi(k)
  o = np.zeros_like(q)
  for b in range(x.shape[0]):
    for h in range(H):
      for i in range(x.shape[1]):
        s_mat, s_vec = np.zeros((DH, DH)), np.zeros(DH)
        for j in range(x.shape[1]):
          if _allowed(b, i, j, mask, seg, causal):
            s_mat += np.outer(k[b, j, h], v[b, j, h])
            s_vec += k[b, j, h]
        o[b, i, h] = q[b, i, h] @ s_mat / (q[b, i, h] @ s_vec + eps)
  return _out(o, p["out"])


CASES = [("plain", False, None, None), ("mask", False, MASK, None),
         ("causal", True, None, None), ("causal_mask", True, MASK, None),
         ("segments", False, None, SEG2),
         ("causal_segments", True, None, SEG2)]


@pytest.mark.parametrize("linear", [False, True], ids=["softmax", "linear"])
@pytest.mark.parametrize("name,causal,mask,seg", CASES,
                         ids=[c[0] for c in CASES])
def test_matches_numpy(linear, name, causal, mask, seg):
  del name
  cls = attention.LinearAttention if linear else attention.SelfAttention
  module = cls(H, causal=causal)
  x = _x()
  v = _init(module, x)
  y = jax.jit(module.apply)(v, x, mask=mask, segment_ids=seg)
  ref_fn = np_linear_attention if linear else np_softmax_attention
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), v)["params"]
  real = np.ones(x.shape[:2], bool)
  for m in (mask, None if seg is None else seg > 0):
    real = real if m is None else real & m
  ref = ref_fn(np.asarray(x, np.float64), p, causal=causal, mask=real, seg=seg)
  np.testing.assert_allclose(y[real], ref[real], rtol=1e-4, atol=1e-4)


MODULES = {
    "softmax": attention.SelfAttention(H),
    "softmax_causal": attention.SelfAttention(H, causal=True),
    "linear": attention.LinearAttention(H),
    "linear_causal": attention.LinearAttention(H, causal=True),
}


@pytest.mark.parametrize("name", MODULES)
def test_padding_does_not_change_real_tokens(name):
  module, x = MODULES[name], _x(b=1)
  v = _init(module, x)
  padded = jax.jit(module.apply)(v, x, mask=jnp.arange(N)[None] < 5)
  alone = jax.jit(module.apply)(v, x[:, :5])
  chex.assert_trees_all_close(padded[:, :5], alone, rtol=1e-5, atol=1e-5)


def _jacobian(module, v, x, **kw):
  f = lambda x1: module.apply(v, x1[None], **kw)[0]
  jac = jax.jit(jax.jacrev(f))(x[0])                          # [N, d, N, d]
  return np.abs(np.asarray(jac)).max(axis=(1, 3))


@pytest.mark.parametrize("name", ["softmax_causal", "linear_causal"])
def test_causal_jacobian(name):
  module, x = MODULES[name], _x(b=1)
  j = _jacobian(module, _init(module, x), x)
  np.testing.assert_array_equal(j[np.triu_indices(N, 1)], 0.0)
  assert j[np.tril_indices(N, -1)].min() > 1e-4


@pytest.mark.parametrize("name", MODULES)
def test_packed_equals_separate(name):
  module, x = MODULES[name], _x(b=1)
  v = _init(module, x)
  packed = jax.jit(module.apply)(v, x, segment_ids=SEG)
  for lo, hi in [(0, 2), (2, 6)]:
    chex.assert_trees_all_close(packed[:, lo:hi], module.apply(v, x[:, lo:hi]),
                                rtol=1e-5, atol=1e-5)
  j = _jacobian(module, v, x, segment_ids=SEG)
  cross = SEG[0][:, None] != SEG[0][None, :]
  np.testing.assert_array_equal(j[cross], 0.0)


def test_fully_masked_row_is_finite():
  """A row whose tokens may read no key attends to nothing: its outputs
  are the output projection's bias, its inputs get no gradient, and the
  other row is what it is alone; no NaN anywhere."""
  module, x = attention.SelfAttention(H), _x()
  v = _init(module, x)
  mask = jnp.array([[True] * N, [False] * N])
  out = module.apply(v, x, mask=mask)
  np.testing.assert_allclose(
      out[1], np.broadcast_to(nn.unbox(v)["params"]["out"]["bias"], (N, D)),
      rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(out[0], module.apply(v, x[:1])[0], rtol=1e-5,
                             atol=1e-6)
  loss = lambda p, x: jnp.sum(module.apply(p, x, mask=mask) ** 2)  # noqa
  val, (grads, dx) = jax.jit(jax.value_and_grad(loss, (0, 1)))(v, x)
  assert jnp.isfinite(val)
  assert all(jnp.isfinite(g).all() for g in jax.tree.leaves(grads))
  np.testing.assert_array_equal(dx[1], 0.0)
  assert float(jnp.abs(dx[0]).max()) > 0


def test_dropout_only_when_not_deterministic():
  module, x = attention.SelfAttention(H, dropout_rate=0.5), _x()
  v = _init(module, x)
  apply = jax.jit(module.apply, static_argnames="deterministic")
  det = apply(v, x)
  chex.assert_trees_all_close(det, attention.SelfAttention(H).apply(v, x),
                              rtol=1e-5, atol=1e-6)
  drop = apply(v, x, deterministic=False,
               rngs={"dropout": jax.random.key(7)})
  assert jnp.isfinite(drop).all() and not np.allclose(drop, det)


@pytest.mark.parametrize("cls", [attention.SelfAttention,
                                 attention.LinearAttention])
def test_bad_inputs(cls):
  with pytest.raises(ValueError, match=r"num_heads=4 does not divide.*d=15"):
    cls(4).init(jax.random.key(0), _x())
  with pytest.raises(ValueError, match=r"mask has shape \(2, 5\)"):
    cls(H).init(jax.random.key(0), _x(), mask=jnp.ones((2, 5), bool))
  # An explicit head_dim need not divide d.
  assert cls(4, head_dim=2).init(jax.random.key(0), _x())


@pytest.mark.parametrize("cls", [attention.SelfAttention,
                                 attention.LinearAttention])
def test_bfloat16_forward_backward(cls):
  x = _x()
  f32, bf16 = cls(H, causal=True), cls(H, causal=True, dtype=jnp.bfloat16)
  v = _init(f32, x, scale=0.2)

  def loss_and_grad(module):
    loss = lambda p: jnp.sum(module.apply(p, x, mask=MASK).astype(
        jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(loss))(v)

  (l32, g32), (l16, g16) = loss_and_grad(f32), loss_and_grad(bf16)
  assert all(jnp.isfinite(g).all() for g in jax.tree.leaves(g16))
  np.testing.assert_allclose(l16, l32, rtol=5e-2)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g32))
  chex.assert_trees_all_close(g16, g32, rtol=0.1, atol=0.05 * scale)


def einsum_attention(q, k, v, allowed):
  """The materialised reference: [B, H, N, N] float32 probabilities."""
  logits = jnp.einsum("bnhd,bmhd->bhnm", q, k,
                      preferred_element_type=jnp.float32) / math.sqrt(
                          q.shape[-1])
  logits = jnp.where(allowed[:, None], logits, -jnp.inf)
  probs = jnp.exp(logits - logits.max(-1, keepdims=True))
  probs = jnp.where(allowed[:, None], probs, 0.0)
  probs = probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30)
  return jnp.einsum("bhnm,bmhd->bnhd", probs, v.astype(jnp.float32))


def _allowed_np(mask, seg, causal, b=B, n=N):
  return np.array([[[_allowed(r, i, j, mask, seg, causal) for j in range(n)]
                    for i in range(n)] for r in range(b)])


# Packed rows with padding at the end and in the middle of a row.
PACKED = np.array([[1, 1, 2, 2, 2, 3, 0], [1, 1, 1, 0, 2, 2, 2]])
CORE_CASES = CASES + [("packed_padded", False, None, PACKED),
                      ("causal_packed_padded", True, None, PACKED)]


# The library path's values are also checked by test_matches_numpy.
CORE_RUNS = [("blockwise", 3) + c for c in CORE_CASES] + [
    ("xla", 256) + c for c in CORE_CASES if c[0] in
    ("mask", "causal_segments", "packed_padded")]


@pytest.mark.parametrize("impl,block,name,causal,mask,seg", CORE_RUNS,
                         ids=[f"{r[0]}-{r[2]}" for r in CORE_RUNS])
def test_dot_product_attention_matches_einsum(impl, block, name, causal,
                                              mask, seg):
  """Values and gradients of each implementation against the reference;
  block 3 pads N=7 to 9 (three query and key blocks)."""
  del name
  q, k, v = (jax.random.normal(key, (B, N, H, DH)) for key in
             jax.random.split(jax.random.key(5), 3))
  real = None if mask is None else jnp.asarray(mask)
  if seg is not None:
    real = jnp.asarray(seg > 0) if real is None else real & (seg > 0)
  allowed = jnp.asarray(_allowed_np(None if real is None else np.asarray(real),
                                    seg, causal))
  seg = None if seg is None else jnp.asarray(seg)

  def ours(q, k, v):
    return attention.dot_product_attention(
        q, k, v, mask=real, segment_ids=seg, causal=causal,
        implementation=impl, block_size=block)

  chex.assert_trees_all_close(jax.jit(ours)(q, k, v),
                              einsum_attention(q, k, v, allowed),
                              rtol=1e-5, atol=1e-5)
  cot = jax.random.normal(jax.random.key(9), q.shape)
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)  # noqa: E731
  grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(loss(lambda *a: einsum_attention(*a, allowed)),
                  argnums=(0, 1, 2))(q, k, v)
  chex.assert_trees_all_close(grads, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_dot_product_attention_bfloat16(impl):
  q, k, v = (jax.random.normal(key, (B, N, H, DH)) for key in
             jax.random.split(jax.random.key(6), 3))
  seg = jnp.asarray(PACKED)
  y = attention.dot_product_attention(
      *(t.astype(jnp.bfloat16) for t in (q, k, v)), segment_ids=seg,
      mask=seg > 0, causal=True, implementation=impl, block_size=3)
  assert y.dtype == jnp.bfloat16
  want = einsum_attention(q, k, v, jnp.asarray(
      _allowed_np(PACKED > 0, PACKED, True)))
  chex.assert_trees_all_close(y.astype(jnp.float32), want, atol=0.05)


@pytest.mark.parametrize("name,causal,mask,seg", [CASES[1], CASES[-1]],
                         ids=[CASES[1][0], CASES[-1][0]])
def test_blockwise_module_matches_numpy(name, causal, mask, seg):
  del name
  module = attention.SelfAttention(H, causal=causal,
                                   implementation="blockwise", block_size=3)
  x = _x()
  v = _init(module, x)
  y = jax.jit(module.apply)(v, x, mask=mask, segment_ids=seg)
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), v)["params"]
  real = np.ones(x.shape[:2], bool)
  for m in (mask, None if seg is None else seg > 0):
    real = real if m is None else real & m
  ref = np_softmax_attention(np.asarray(x, np.float64), p, causal=causal,
                             mask=real, seg=seg)
  np.testing.assert_allclose(y[real], ref[real], rtol=1e-4, atol=1e-4)


def test_automatic_implementation_is_blockwise_for_long_rows():
  module = attention.SelfAttention(H, causal=True, block_size=3)
  x = _x()
  v = _init(module, x)
  text = jax.jit(module.apply).lower(v, x).as_text()
  # The blocks' scan is a while loop; the library's path has none.
  assert "while" in text
  short = attention.SelfAttention(H, causal=True, block_size=N)
  assert "while" not in jax.jit(short.apply).lower(v, x).as_text()
  chex.assert_trees_all_close(module.apply(v, x), short.apply(v, x),
                              rtol=1e-5, atol=1e-5)


def test_bad_implementation():
  with pytest.raises(ValueError, match=r"attention implementation='flash'; "
                     r"expected None \(automatic\) or one of"):
    attention.SelfAttention(H, implementation="flash").init(
        jax.random.key(0), _x())
