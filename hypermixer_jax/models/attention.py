"""Attention baselines: softmax self-attention and linear attention.

Softmax attention (Vaswani et al., 2017), per head h:
  q = x Wq_h, k = x Wk_h, v = x Wv_h              # [B, N, Dh] each
  A = softmax(q k^T / sqrt(Dh) + M)                # [B, N, N], M = -inf where masked
  y = concat_h(A v) Wo                             # [B, N, d]

Linear attention (Katharopoulos et al., 2020) with phi(x) = elu(x) + 1:
  y_i = phi(q_i)^T S / (phi(q_i)^T s + eps)        # [Dv] per head
  S = sum_j phi(k_j) v_j^T,  s = sum_j phi(k_j)    # [Dh, Dv], [Dh]
The sums run over the real keys of i's own segment (and j <= i when causal,
as prefix sums that restart at each segment start). Padded keys contribute
nothing: the public JAX reference ignores the padding mask, this one does not.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from hypermixer_jax.models import common

Array = common.Array


IMPLEMENTATIONS = ("xla", "cudnn", "blockwise")


def attention_weights(q: Array, k: Array, allowed: Array | None) -> Array:
  """Softmax attention probabilities in float32 (the explicit path).

  Args:
    q: ``[B, N, H, D]`` queries, already scaled.
    k: ``[B, M, H, D]`` keys.
    allowed: ``[B or 1, N, M]`` bool (may query i read key j) or None.

  Returns:
    ``[B, H, N, M]`` float32; rows with no allowed key are all zero (no NaN).
  """
  logits = jnp.einsum("bnhd,bmhd->bhnm", q, k).astype(jnp.float32)
  if allowed is None:
    return jax.nn.softmax(logits, axis=-1)
  allowed = allowed[:, None]                                  # [B, 1, N, M]
  # A finite fill keeps fully masked rows (and their gradients) NaN-free.
  logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.where(allowed, probs, 0.0)


def dot_product_attention(q: Array, k: Array, v: Array, *,
                          mask: Array | None = None,
                          segment_ids: Array | None = None,
                          causal: bool = False,
                          implementation: str | None = None,
                          block_size: int = 256,
                          dropout=None) -> Array:
  """softmax(q k^T / sqrt(D) + M) v per head, M masking disallowed pairs.

  Query i may read key j when j is a real token (``mask``), of i's segment
  (``segment_ids``, packed rows: a block-diagonal mask) and, if ``causal``,
  j <= i. A query with no allowed key gets a zero output.

  Args:
    q, k, v: ``[B, N, H, D]`` (unscaled queries).
    mask: ``[B, N]`` bool, True for real tokens (keys), or None.
    segment_ids: ``[B, N]`` int, or None.
    causal: only keys j <= i.
    implementation: None picks ``blockwise`` for CPU when N > block_size and
      the library's ``jax.nn.dot_product_attention`` otherwise; ``xla`` /
      ``cudnn`` are that function's implementations (cuDNN flash attention
      on GPU); ``blockwise`` is ``blockwise_attention``.
    block_size: query and key block of ``blockwise``.
    dropout: a function applied to the ``[B, H, N, N]`` probabilities
      (training-time attention dropout); it needs them materialised, so it
      takes the explicit path whatever ``implementation`` says.

  Returns:
    ``[B, N, H, D]`` in the dtype of ``v``.
  """
  if implementation not in (None,) + IMPLEMENTATIONS:
    raise ValueError(f"attention implementation={implementation!r}; expected "
                     f"None (automatic) or one of {IMPLEMENTATIONS}.")
  n, dh = q.shape[1], q.shape[-1]
  if dropout is not None:
    q = q * jnp.asarray(dh ** -0.5, q.dtype)
    allowed = common.pair_mask(mask, segment_ids, causal, n, n)
    probs = dropout(attention_weights(q, k, allowed))         # [B, H, N, N]
    return jnp.einsum("bhnm,bmhd->bnhd", probs.astype(v.dtype), v)
  if implementation is None:
    long = n > block_size and common.target_platform() == "cpu"
    implementation = "blockwise" if long else "xla"
  if implementation == "blockwise":
    return blockwise_attention(q, k, v, mask=mask, segment_ids=segment_ids,
                               causal=causal, block_size=block_size)
  if mask is None and segment_ids is None:
    # Causality alone is the library's is_causal (cuDNN skips the blocks).
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                        implementation=implementation)
  allowed = common.pair_mask(mask, segment_ids, causal, n, n)  # [B, N, N]
  y = jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None],
                                   implementation=implementation)
  # The library spreads a row with no allowed key evenly over all keys.
  return jnp.where(allowed.any(-1)[:, :, None, None], y, 0).astype(v.dtype)


def blockwise_attention(q: Array, k: Array, v: Array, *,
                        mask: Array | None = None,
                        segment_ids: Array | None = None,
                        causal: bool = False, block_size: int = 256
                        ) -> Array:
  """Softmax attention over [C, C] blocks with an online softmax.

  The [N, N] probabilities never exist: for each block of C queries a scan
  over key blocks carries the running maximum m, normaliser l and output
  (Milakov & Gimelshein 2018; Dao et al. 2022):
      m' = max(m, max_j s_j),  l' = l e^{m-m'} + sum_j e^{s_j-m'},
      o' = o e^{m-m'} + sum_j e^{s_j-m'} v_j,  y = o / l.
  On a CPU a block's logits stay in cache, where the library's XLA path
  writes and rereads [B, H, N, N] float32 several times
  (experiments/bench_attention.py measures both). Each scan step is
  rematerialised, so the backward pass stores only the carries. Causal key
  blocks past the query block are skipped. Logits, m, l and o are float32
  whatever the compute dtype. Same arguments as ``dot_product_attention``.
  """
  b, n, h, dh = q.shape
  c = max(1, min(block_size, n))
  pad = -n % c
  ok = jnp.ones((b, n), bool) if mask is None else mask
  if pad:  # padded keys are masked, padded queries dropped
    zeros = lambda t: jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0)))  # noqa: E731
    q, k, v = zeros(q), zeros(k), zeros(v)
    ok = jnp.pad(ok, ((0, 0), (0, pad)))
    if segment_ids is not None:
      segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
  nb = (n + pad) // c
  # [nb, B, H, C, D]: each block's matmuls read contiguous tiles.
  blocks = lambda t: t.reshape(b, nb, c, h, dh).transpose(1, 0, 3, 2, 4)  # noqa: E731
  q = q * jnp.asarray(dh ** -0.5, q.dtype)
  qb, kb, vb = blocks(q), blocks(k), blocks(v)
  okb = ok.reshape(b, nb, c).swapaxes(0, 1)                   # [nb, B, C]
  segb = None if segment_ids is None else \
      segment_ids.reshape(b, nb, c).swapaxes(0, 1)
  pos = jnp.arange(c)
  masked = mask is not None or segment_ids is not None or causal or pad > 0
  low = jnp.finfo(jnp.float32).min

  def query_block(xs):
    qi, i, seg_i = xs                                         # [B, H, C, D]

    def step(carry, ys):
      kj, vj, ok_j, seg_j, j = ys
      m, l, o = carry
      s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj,
                     preferred_element_type=jnp.float32)     # [B, H, C, C]
      if masked:
        allowed = ok_j[:, None, None, :]
        if seg_i is not None:
          allowed = allowed & (seg_i[:, None, :, None] ==
                               seg_j[:, None, None, :])
        if causal:
          allowed = allowed & (i * c + pos[:, None] >= j * c + pos[None, :])
        s = jnp.where(allowed, s, low)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      if masked:  # exact zeros, also where a row has seen no key yet
        p = jnp.where(allowed, p, 0.0)
      corr = jnp.exp(m - m_new)
      o = o * corr[..., None] + jnp.einsum(
          "bhqk,bhkd->bhqd", p.astype(vj.dtype), vj,
          preferred_element_type=jnp.float32)
      return (m_new, l * corr + p.sum(-1), o), None

    def maybe(carry, ys):
      if not causal:
        return step(carry, ys)
      # Key blocks after the query block hold no allowed key.
      return jax.lax.cond(ys[-1] > i, lambda: (carry, None),
                          lambda: step(carry, ys))

    init = (jnp.full((b, h, c), low), jnp.zeros((b, h, c)),
            jnp.zeros((b, h, c, dh)))
    (_, l, o), _ = jax.lax.scan(
        jax.checkpoint(maybe), init,
        (kb, vb, okb, segb, jnp.arange(nb)))
    return o / jnp.where(l > 0, l, 1.0)[..., None]           # [B, H, C, D]

  y = jax.lax.map(query_block, (qb, jnp.arange(nb), segb))   # [nb, B, H, C, D]
  y = y.transpose(1, 0, 3, 2, 4).reshape(b, nb * c, h, dh)
  return y[:, :n].astype(v.dtype)


def _head_dim(module: str, d: int, num_heads: int, head_dim: int | None) -> int:
  if head_dim is not None:
    return head_dim
  if d % num_heads:
    raise ValueError(
        f"{module}: num_heads={num_heads} does not divide the model width "
        f"d={d}; choose num_heads dividing d or set head_dim explicitly.")
  return d // num_heads


def _qkv(x: Array, num_heads: int, head_dim: int, dtype, param_dtype
         ) -> list[Array]:
  """Three ``[B, N, H, Dh]`` projections named query, key, value."""
  outs = []
  for name in ("query", "key", "value"):
    y = common.DenseGeneral(
        features=(num_heads, head_dim), in_axes=1,
        axes=(common.EMBED, common.HEADS, common.KV), dtype=dtype,
        param_dtype=param_dtype, name=name)(x)
    outs.append(common.constrain(
        y, (common.BATCH, common.LENGTH, common.HEADS, common.KV)))
  return outs


def _out_proj(y: Array, d: int, dtype, param_dtype) -> Array:
  y = common.DenseGeneral(
      features=(d,), in_axes=2, axes=(common.HEADS, common.KV, common.EMBED),
      dtype=dtype, param_dtype=param_dtype, name="out")(y)
  return common.constrain(y, (common.BATCH, common.LENGTH, common.EMBED))


class SelfAttention(nn.Module):
  """Multi-head softmax self-attention token mixer (``positions`` unused).

  ``implementation`` and ``block_size`` choose the attention computation
  (``dot_product_attention``: by default block-wise on CPU for rows longer
  than ``block_size``, ``jax.nn.dot_product_attention`` elsewhere; on CPU
  XLA's cost analysis then counts the block scan's body once, so a logged
  MFU under-counts long rows). ``dropout_rate`` drops attention
  probabilities in training, which materialises them (explicit path).
  """
  num_heads: int
  head_dim: int | None = None
  causal: bool = False
  dropout_rate: float = 0.0
  implementation: str | None = None
  block_size: int = 256
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, *, mask=None, segment_ids=None, positions=None,
               deterministic=True):
    common.check_width(x, None, "SelfAttention")
    b, n, d = x.shape
    dh = _head_dim("SelfAttention", d, self.num_heads, self.head_dim)
    mask = common.resolve_mask(x, mask, segment_ids)
    x = common.constrain(x, (common.BATCH, common.LENGTH, common.EMBED))
    q, k, v = _qkv(x, self.num_heads, dh, self.dtype, self.param_dtype)
    y = dot_product_attention(
        q, k, v, mask=mask, segment_ids=segment_ids, causal=self.causal,
        implementation=self.implementation, block_size=self.block_size,
        dropout=probability_dropout(self.dropout_rate, deterministic))
    return _out_proj(y, d, self.dtype, self.param_dtype)        # y: [B, N, H, Dh]


def probability_dropout(rate: float, deterministic: bool):
  """Dropout on attention probabilities, or None when it does nothing.

  Call it inside a module's compact method: the Dropout binds to that module.
  """
  if deterministic or not rate:
    return None
  return functools.partial(nn.Dropout(rate), deterministic=False)


def _segmented_cumsum(x: Array, starts: Array) -> Array:
  """Inclusive prefix sum over axis 1 that restarts where ``starts`` is True.

  ``x``: ``[B, N, ...]``; ``starts``: ``[B, N]`` bool.
  """
  flags = starts.reshape(starts.shape + (1,) * (x.ndim - 2))

  def combine(a, b):
    fa, va = a
    fb, vb = b
    return jnp.logical_or(fa, fb), jnp.where(fb, vb, va + vb)

  _, out = jax.lax.associative_scan(
      combine, (jnp.broadcast_to(flags, x.shape), x), axis=1)
  return out


class LinearAttention(nn.Module):
  """Linear (kernelised) attention token mixer, phi(x) = elu(x) + 1.

  ``segment_ids`` must be at most N (true for K <= N packed examples).
  The sums are accumulated in float32 whatever ``dtype`` is.
  """
  num_heads: int
  head_dim: int | None = None
  causal: bool = False
  eps: float = 1e-6
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, *, mask=None, segment_ids=None, positions=None,
               deterministic=True):
    common.check_width(x, None, "LinearAttention")
    b, n, d = x.shape
    dh = _head_dim("LinearAttention", d, self.num_heads, self.head_dim)
    mask = common.resolve_mask(x, mask, segment_ids)
    x = common.constrain(x, (common.BATCH, common.LENGTH, common.EMBED))
    q, k, v = _qkv(x, self.num_heads, dh, self.dtype, self.param_dtype)
    q = jax.nn.elu(q.astype(jnp.float32)) + 1.0               # [B, N, H, Dh]
    k = jax.nn.elu(k.astype(jnp.float32)) + 1.0
    v = v.astype(jnp.float32)
    if mask is not None:
      k = jnp.where(mask[:, :, None, None], k, 0.0)
    kv = jnp.einsum("bnhd,bnhe->bnhde", k, v)                 # [B, N, H, Dh, Dv]
    if self.causal:
      if segment_ids is None:
        kv, ks = jnp.cumsum(kv, axis=1), jnp.cumsum(k, axis=1)
      else:
        starts = jnp.concatenate(
            [jnp.ones((b, 1), bool),
             segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
        kv = _segmented_cumsum(kv, starts)
        ks = _segmented_cumsum(k, starts)
    elif segment_ids is None:
      kv, ks = kv.sum(1, keepdims=True), k.sum(1, keepdims=True)
    else:
      # One bucket per (row, segment id): ids are unique across rows.
      ids = (segment_ids + (n + 1) * jnp.arange(b)[:, None]).reshape(-1)
      sums = [jax.ops.segment_sum(t.reshape((b * n,) + t.shape[2:]), ids,
                                  num_segments=b * (n + 1))[ids]
              for t in (kv, k)]
      kv, ks = [t.reshape((b, n) + t.shape[1:]) for t in sums]
    num = jnp.einsum("bnhd,bnhde->bnhe", q, kv)               # [B, N, H, Dv]
    den = jnp.einsum("bnhd,bnhd->bnh", q, jnp.broadcast_to(ks, q.shape))
    y = (num / (den[..., None] + self.eps)).astype(self.dtype)
    return _out_proj(y, d, self.dtype, self.param_dtype)
