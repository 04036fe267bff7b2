"""gMLP and aMLP (Liu et al., "Pay Attention to MLPs", NeurIPS 2021).

Block (pre-norm), X [B, N, d]:
  Z = GELU(LN(X) U)                  # [B, N, d_ffn],   U [d, d_ffn]
  (Z1, Z2) = split(Z, channels)      # [B, N, d_ffn/2] each
  s(Z) = Z1 * f(LN(Z2))              # spatial gating unit (SGU)
  f(Z2) = W Z2 + b                   # W [N, N] over tokens, b [N]
  Y = X + s(Z) V                     # [B, N, d],       V [d_ffn/2, d]
W starts near zero and b at one, so each block starts as a plain FFN.
Options: Toeplitz W[i, j] = w[i - j] (2N - 1 weights; applicable by FFT in
O(N log N)); causal W (i reads j <= i only).
aMLP adds a tiny single-head attention of the (normalised) block input to
the gate: f(Z2) + TinyAttn(X), TinyAttn(X) = softmax(q k^T / sqrt(d_attn)) v Wo.

Variable length: a length-N input uses the leading N x N block of W
(N <= max_len); padded tokens are zeroed before the spatial projection, and
packed examples use W[pos_i, pos_j], zero across segments.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from hypermixer_jax.models import common
from hypermixer_jax.models.attention import dot_product_attention
from hypermixer_jax.models.attention import probability_dropout

Array = common.Array


def _toeplitz_fft(w: Array, z: Array, max_len: int, causal: bool) -> Array:
  """``y_i = sum_{j<N} w[i - j + max_len - 1] z_j`` by FFT; z ``[B, N, c]``."""
  n = z.shape[1]
  # Kernel over offsets -(N-1)..N-1; the circular size 2N-1 (rounded up)
  # leaves the outputs n-1..2n-2 of the linear convolution un-aliased.
  a = w[max_len - n:max_len + n - 1]                           # [2N - 1]
  if causal:
    a = jnp.where(jnp.arange(2 * n - 1) >= n - 1, a, 0.0)
  size = 1 << (2 * n - 2).bit_length()
  fa = jnp.fft.rfft(a.astype(jnp.float32), size)
  fz = jnp.fft.rfft(z.astype(jnp.float32), size, axis=1)
  y = jnp.fft.irfft(fa[None, :, None] * fz, size, axis=1)
  return y[:, n - 1:2 * n - 1].astype(z.dtype)


class SpatialProjection(nn.Module):
  """``f(Z) = W Z + b`` over the token axis, Z ``[B, N, c]``.

  Attributes:
    max_len: largest N; W is ``[max_len, max_len]`` (or its Toeplitz form).
    toeplitz: W[i, j] = w[i - j] with ``2 * max_len - 1`` weights.
    causal: position i reads only j <= i.
    use_fft: apply the Toeplitz product by FFT (used when neither
      ``segment_ids`` nor ``positions`` is given; else the gathered path).
      Causal by FFT is causal up to float32 round-off: a later token moves
      an earlier output by ~1e-7 of its scale (tests/gmlp_test.py bounds
      the Jacobian's upper triangle); the gathered path is exactly causal.
    init_scale: W ~ U(-init_scale / max_len, init_scale / max_len).
  """
  max_len: int
  toeplitz: bool = False
  causal: bool = False
  use_fft: bool = False
  init_scale: float = 1e-3
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, z, *, mask=None, segment_ids=None, positions=None):
    b, n, _ = z.shape
    L = self.max_len
    if n > L:
      raise ValueError(
          f"SpatialProjection: sequence length N={n} exceeds max_len={L}; "
          f"build the model with max_len >= {n} or truncate the inputs.")
    if self.use_fft and not self.toeplitz:
      raise ValueError("SpatialProjection: use_fft=True needs toeplitz=True.")
    mask = common.resolve_mask(z, mask, segment_ids)
    eps = self.init_scale / L

    def w_init(key, shape, dtype):
      return jax.random.uniform(key, shape, dtype, -eps, eps)

    if self.toeplitz:
      w = self.param("kernel", common.partitioned(w_init, (None,)),
                     (2 * L - 1,), self.param_dtype)
    else:
      w = self.param("kernel",
                     common.partitioned(w_init, (common.SEQ_OUT, common.SEQ_IN)),
                     (L, L), self.param_dtype)
    bias = self.param("bias", common.partitioned(nn.initializers.ones_init(),
                                                 (common.SEQ_OUT,)),
                      (L,), self.param_dtype)
    w, bias = w.astype(self.dtype), bias.astype(self.dtype)
    z = z.astype(self.dtype)
    if mask is not None:
      z = jnp.where(mask[:, :, None], z, 0)       # padded keys add nothing

    if positions is None and segment_ids is None and self.use_fft:
      y = _toeplitz_fft(w, z, L, self.causal)
      return y + bias[None, :n, None]

    if positions is None:
      pos = jnp.arange(n)[None]                    # [1, N]
      bias_n = bias[None, :n]                      # [1, N]
    else:
      pos, bias_n = positions, bias[positions]     # [B, N]
    if self.toeplitz:
      rel = pos[:, :, None] - pos[:, None, :]      # [B|1, N, N]
      mat = w[jnp.clip(rel + L - 1, 0, 2 * L - 2)]
      if self.causal:
        mat = jnp.where(rel >= 0, mat, 0)
    else:
      if self.causal:
        w = jnp.tril(w)
      mat = w[pos[:, :, None], pos[:, None, :]]    # [B|1, N, N]
    allowed = common.pair_mask(None, segment_ids, self.causal, n, n)
    if allowed is not None:
      mat = jnp.where(allowed, mat, 0)
    y = jnp.einsum("bnm,bmc->bnc", jnp.broadcast_to(mat, (b, n, n)), z)
    return y + bias_n[:, :, None]


class TinyAttention(nn.Module):
  """aMLP's single-head attention, ``[B, N, d] -> [B, N, d_out]``."""
  d_out: int
  d_attn: int = 64
  causal: bool = False
  dropout_rate: float = 0.0
  implementation: str | None = None  # attention.dot_product_attention's
  block_size: int = 256
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, *, mask=None, segment_ids=None, positions=None,
               deterministic=True):
    mask = common.resolve_mask(x, mask, segment_ids)
    qkv = common.Dense(3 * self.d_attn, (common.EMBED, common.KV),
                       dtype=self.dtype, param_dtype=self.param_dtype,
                       name="qkv")(x)                          # [B, N, 3 d_attn]
    q, k, v = jnp.split(qkv[:, :, None], 3, axis=-1)           # [B, N, 1, d_attn]
    y = dot_product_attention(
        q, k, v, mask=mask, segment_ids=segment_ids, causal=self.causal,
        implementation=self.implementation, block_size=self.block_size,
        dropout=probability_dropout(self.dropout_rate, deterministic))
    y = y[:, :, 0]                                             # [B, N, d_attn]
    return common.Dense(self.d_out, (common.KV, common.MLP), dtype=self.dtype,
                        param_dtype=self.param_dtype, name="out")(y)


class SpatialGatingUnit(nn.Module):
  """Token mixer ``(GELU(x U) -> Z1 * f(LN(Z2)) [+ TinyAttn(x)]) V``.

  Output width equals the input width d; ``tiny_attention_dim`` turns gMLP
  into aMLP. ``dropout_rate`` drops the gated hidden units before V.
  """
  # Its N x N weights tell positions apart: a model on it needs none added.
  position_aware = True

  d_ffn: int
  max_len: int
  toeplitz: bool = False
  causal: bool = False
  use_fft: bool = False
  tiny_attention_dim: int | None = None
  dropout_rate: float = 0.0
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, *, mask=None, segment_ids=None, positions=None,
               deterministic=True):
    common.check_width(x, None, "SpatialGatingUnit")
    if self.d_ffn % 2:
      raise ValueError(
          f"SpatialGatingUnit: d_ffn={self.d_ffn} is odd but the gate splits "
          "it into two equal halves; use an even d_ffn.")
    d, half = x.shape[-1], self.d_ffn // 2
    mask = common.resolve_mask(x, mask, segment_ids)
    x = common.constrain(x, (common.BATCH, common.LENGTH, common.EMBED))
    z = common.Dense(self.d_ffn, (common.EMBED, common.MLP), dtype=self.dtype,
                     param_dtype=self.param_dtype, name="proj_in")(x)
    z = common.constrain(common.gelu(z),
                         (common.BATCH, common.LENGTH, common.MLP))  # [B, N, d_ffn]
    z1, z2 = z[..., :half], z[..., half:]                     # [B, N, d_ffn/2]
    z2 = common.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype,
                          name="norm")(z2)
    z2 = self.spatial_mixing(z2, mask=mask, segment_ids=segment_ids,
                             positions=positions, deterministic=deterministic)
    if self.tiny_attention_dim:
      z2 = z2 + TinyAttention(
          half, self.tiny_attention_dim, causal=self.causal, dtype=self.dtype,
          param_dtype=self.param_dtype, name="tiny_attention")(
              x, mask=mask, segment_ids=segment_ids,
              deterministic=deterministic)
    gated = common.constrain(z1 * z2, (common.BATCH, common.LENGTH, common.MLP))
    gated = nn.Dropout(self.dropout_rate)(gated, deterministic=deterministic)
    y = common.Dense(d, (common.MLP, common.EMBED), dtype=self.dtype,
                     param_dtype=self.param_dtype, name="proj_out")(gated)
    return common.constrain(y, (common.BATCH, common.LENGTH, common.EMBED))

  def spatial_mixing(self, z2, *, mask, segment_ids, positions, deterministic):
    """f(LN(Z2)) over the sequence; sMoE overrides it with spatial experts."""
    del deterministic  # one deterministic linear map
    return SpatialProjection(
        self.max_len, toeplitz=self.toeplitz, causal=self.causal,
        use_fft=self.use_fft, dtype=self.dtype, param_dtype=self.param_dtype,
        name="spatial")(z2, mask=mask, segment_ids=segment_ids,
                        positions=positions)


class GmlpBlock(nn.Module):
  """Pre-LN gMLP/aMLP block ``y = x + Dropout(SGU(LN(x)))`` (no extra FFN).

  Attributes:
    sgu: factory of the spatial gating unit, called as ``sgu(name="sgu")``
      (e.g. ``functools.partial(SpatialGatingUnit, d_ffn, max_len)``, or
      sMLP's ``SparseGatingUnit``), as ``MixerBlock`` takes its mixer.
  """
  sgu: Callable[..., nn.Module]
  dropout_rate: float = 0.0
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, *, mask=None, segment_ids=None, positions=None,
               deterministic=True):
    h = common.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype,
                         name="norm")(x)
    h = self.sgu(name="sgu")(
        h, mask=mask, segment_ids=segment_ids, positions=positions,
        deterministic=deterministic)
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    return x + h.astype(x.dtype)
