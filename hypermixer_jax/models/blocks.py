"""The Transformer-like layer shared by every model (HyperMixer paper, Fig. 1).

A layer is a token-mixing module followed by a feature-mixing MLP, each with
a LayerNorm and a skip connection. Two layouts (HyperMixer paper, App. F):

    pre_ln:   y = x + Drop(Mix(LN_1(x)));   z = y + Drop(FFN(LN_2(y)))
    post_ln:  y = LN_1(x + Drop(Mix(x)));   z = LN_2(y + Drop(FFN(y)))

    FFN(h) = W_o Drop(GELU(W_i h + b_i)) + b_o,  W_i: [d, d_ffn], W_o: [d_ffn, d]

The feature-mixing module is the same for every mixer, so models differ only
in their token mixing (the paper's controlled comparison). gMLP's own block
(``block='gmlp'``, no separate FFN) is ``gmlp.GmlpBlock``.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax.numpy as jnp

from hypermixer_jax.models import common

Array = common.Array
LAYOUTS = ("pre_ln", "post_ln")
_ACT_AXES = (common.BATCH, common.LENGTH, common.EMBED)


class FeedForward(nn.Module):
  """Feature-mixing MLP ``d -> d_ffn -> d`` with GELU, applied per token."""
  d_ffn: int
  dropout_rate: float = 0.0
  approximate_gelu: bool = False
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
    d = x.shape[-1]
    h = common.Dense(self.d_ffn, (common.EMBED, common.MLP), dtype=self.dtype,
                     param_dtype=self.param_dtype, name="wi")(x)  # [B, N, F]
    h = common.gelu(h, self.approximate_gelu)
    h = common.constrain(h, (common.BATCH, common.LENGTH, common.MLP))
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    return common.Dense(d, (common.MLP, common.EMBED), dtype=self.dtype,
                        param_dtype=self.param_dtype, name="wo")(h)  # [B, N, d]


class MixerBlock(nn.Module):
  """Token mixing + feature mixing, each with LayerNorm and a skip connection.

  Attributes:
    mixer: factory of the token mixer, called as ``mixer(name=...)`` (a mixer
      class or a ``functools.partial`` of one); the result must follow the
      mixer contract ``mixer(x, *, mask, segment_ids, positions,
      deterministic) -> [B, N, d]``.
    d_ffn: hidden width of the feature-mixing MLP.
    layout: ``'pre_ln'`` or ``'post_ln'`` (see the module docstring).
    dropout_rate: dropout inside the FFN and on both residual branches.

  Submodules: ``token_mixing``, ``mixing_norm``, ``feature_mixing``
  (``wi``, ``wo``), ``ffn_norm``.
  """
  mixer: Callable[..., nn.Module]
  d_ffn: int
  layout: str = "pre_ln"
  dropout_rate: float = 0.0
  approximate_gelu: bool = False   # of the feature-mixing MLP
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None,
               segment_ids: Array | None = None,
               positions: Array | None = None,
               deterministic: bool = True) -> Array:
    if self.layout not in LAYOUTS:
      raise ValueError(f"MixerBlock: unknown layout {self.layout!r}; valid "
                       f"layouts: {', '.join(LAYOUTS)}.")
    pre = self.layout == "pre_ln"
    x = common.constrain(x, _ACT_AXES)
    norm = lambda name: common.LayerNorm(
        dtype=self.dtype, param_dtype=self.param_dtype, name=name)
    drop = lambda h: nn.Dropout(self.dropout_rate)(
        h, deterministic=deterministic)

    h = norm("mixing_norm")(x) if pre else x
    h = self.mixer(name="token_mixing")(
        h, mask=mask, segment_ids=segment_ids, positions=positions,
        deterministic=deterministic)                           # [B, N, d]
    y = x + drop(h).astype(x.dtype)
    if not pre:
      y = norm("mixing_norm")(y)
    y = common.constrain(y, _ACT_AXES)

    h = norm("ffn_norm")(y) if pre else y
    h = FeedForward(self.d_ffn, self.dropout_rate, self.approximate_gelu,
                    dtype=self.dtype,
                    param_dtype=self.param_dtype, name="feature_mixing")(
                        h, deterministic=deterministic)
    z = y + drop(h).astype(y.dtype)
    if not pre:
      z = norm("ffn_norm")(z)
    return common.constrain(z, _ACT_AXES)
