"""FNet Fourier token mixing (Lee-Thorp et al., 2021) and the identity mixer.

FNet replaces attention with a fixed, parameter-free 2-d discrete Fourier
transform and keeps the real part:

    y = Re(F_seq(F_hidden(x)))                                   # [B, N, d]

where F_hidden is the DFT over the feature axis (per token, no mixing) and
F_seq the DFT over the token axis, (F_seq z)_i = sum_j exp(-2 pi i ij / N) z_j.

Padding and packing. The DFT over the token axis depends on the sequence
length N, so a padded sequence would not equal the unpadded one. With a mask
or segment ids we therefore apply an explicit DFT per segment, over that
segment's real tokens only:

    M_ij = exp(-2 pi i p_i p_j / L_s)  if i, j are real tokens of segment s
         = 0                           otherwise,

with p_i the index of token i among its segment's real tokens and L_s the
number of those tokens. A padded batch then gives exactly the unpadded
result on its real tokens (0 on padding) and segments never mix. This path is
O(N^2 d) instead of O(N d log N) (the price of exact variable-length FNet).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hypermixer_jax.models import common

Array = common.Array


def segment_dft_matrices(mask: Array, segment_ids: Array | None
                         ) -> tuple[Array, Array]:
  """Real and imaginary parts (up to sign) of the per-segment DFT matrix.

  Args:
    mask: ``[B, N]`` bool, True for real tokens.
    segment_ids: ``[B, N]`` int or None (one segment per row).

  Returns:
    ``(cos, sin)``, each ``[B, N, N]`` float32, with ``cos[b, i, j] =
    cos(2 pi p_i p_j / L)`` and ``sin[b, i, j] = sin(2 pi p_i p_j / L)`` for
    real tokens i, j of the same segment and 0 elsewhere, so that
    ``Re(M z) = cos @ Re(z) + sin @ Im(z)``.
  """
  n = mask.shape[1]
  same = mask[:, :, None] & mask[:, None, :]                 # [B, N, N]
  if segment_ids is not None:
    same &= segment_ids[:, :, None] == segment_ids[:, None, :]
  # p_i: real tokens of i's segment before i; L: real tokens of the segment.
  before = jnp.tril(jnp.ones((n, n), dtype=bool), k=-1)[None]
  pos = jnp.sum(same & before, axis=-1, dtype=jnp.int32)     # [B, N]
  length = jnp.maximum(jnp.sum(same, axis=-1, dtype=jnp.int32), 1)
  # Reduce p_i p_j mod L in integers so the angle stays exact for long N.
  prod = (pos[:, :, None] * pos[:, None, :]) % length[:, :, None]
  angle = 2.0 * jnp.pi * prod.astype(jnp.float32) / length[:, :, None]
  zero = jnp.zeros((), jnp.float32)
  return (jnp.where(same, jnp.cos(angle), zero),
          jnp.where(same, jnp.sin(angle), zero))


class FourierMixing(nn.Module):
  """FNet token mixing ``y = Re(FFT_seq(FFT_hidden(x)))``; no parameters.

  Computed in float32 whatever ``dtype`` is (bf16 FFTs lose too much), the
  result cast to ``dtype``. Not causal: every output reads every input.
  """
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32  # unused: kept for the interface

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None,
               segment_ids: Array | None = None,
               positions: Array | None = None,
               deterministic: bool = True) -> Array:
    # ``positions`` is not needed: the per-segment index p_i is recomputed
    # from the mask and segment ids, which also covers left padding.
    del positions, deterministic
    common.check_width(x, None, "FourierMixing")
    mask = common.resolve_mask(x, mask, segment_ids)
    x32 = x.astype(jnp.float32)
    if mask is None:
      y = jnp.real(jnp.fft.fft2(x32, axes=(-2, -1)))          # [B, N, d]
    else:
      h = jnp.fft.fft(x32, axis=-1)                           # [B, N, d]
      cos, sin = segment_dft_matrices(mask, segment_ids)      # [B, N, N]
      hp = jax.lax.Precision.HIGHEST
      y = (jnp.einsum("bij,bjd->bid", cos, jnp.real(h), precision=hp)
           + jnp.einsum("bij,bjd->bid", sin, jnp.imag(h), precision=hp))
    return y.astype(self.dtype)


class IdentityMixing(nn.Module):
  """No token mixing (``y = x``): the "None" control of the synthetic task.

  Trivially causal, so it is also accepted under a causal LM head.
  """
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32  # unused: kept for the interface
  causal_by_construction = True

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None,
               segment_ids: Array | None = None,
               positions: Array | None = None,
               deterministic: bool = True) -> Array:
    del mask, segment_ids, positions, deterministic
    return x.astype(self.dtype)
