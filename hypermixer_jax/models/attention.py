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

import flax.linen as nn
import jax
import jax.numpy as jnp

from hypermixer_jax.models import common

Array = common.Array


def attention_weights(q: Array, k: Array, allowed: Array | None) -> Array:
  """Softmax attention probabilities in float32.

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
  """Multi-head softmax self-attention token mixer (``positions`` unused)."""
  num_heads: int
  head_dim: int | None = None
  causal: bool = False
  dropout_rate: float = 0.0
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
    q = q * jnp.asarray(dh ** -0.5, q.dtype)
    allowed = common.pair_mask(mask, segment_ids, self.causal, n, n)
    probs = attention_weights(q, k, allowed)                  # [B, H, N, N]
    probs = nn.Dropout(self.dropout_rate)(probs, deterministic=deterministic)
    y = jnp.einsum("bhnm,bmhd->bnhd", probs.astype(v.dtype), v)  # [B, N, H, Dh]
    return _out_proj(y, d, self.dtype, self.param_dtype)


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
