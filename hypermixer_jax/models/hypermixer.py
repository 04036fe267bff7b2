"""HyperMixing (Mai et al., ACL 2023, Algorithm 1).

An MLP-Mixer token-mixing MLP whose weights are generated per token by
hypernetworks, so it takes any length, is position invariant up to the added
position embeddings p, and costs O(N d d'):

    W1 = MLP_in(keys + p)            # [B, N, d']  MLP([d, hidden, d']), GELU
    W2 = MLP_out(queries + p)        # [B, M, d']
    out_i = W2 · GELU(W1^T · v_i)    # per feature i: v_i [N] -> [d'] -> [M]
    y = LayerNorm(out)               # [B, M, d]  (optional)

p only enters the hypernetworks, never the values. Tied: W2 = W1 (one
hypernetwork). Multi-head: d is split into H heads of width d/H, each with its
own TM-MLP; the hypernetworks read the whole token and emit H * d' per token.

Padding: rows of W1 (keys) and W2 (queries) of padded tokens are zero, so a
padded batch gives exactly the unpadded outputs; padded output rows are zero.
Packed rows (``segment_ids``): each segment has its own TM-MLP hidden layer
(``max_segments`` slots) and its own ``positions``.
Causal (beyond the paper, which lists it as open): the hidden layer of query m
is the prefix sum over keys n <= m of the same segment run,
    out_m = W2_m · GELU(sum_{n<=m} W1_n v_n^T),
computed with a segmented associative scan; exact, but it stores a
[B, N, d, d'] hidden state per token (memory O(N d d') instead of O(d d')).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hypermixer_jax.models import common
from hypermixer_jax.models.mlp_mixer import segment_one_hot, token_mixing_mlp

Array = jax.Array
POSITIONS = ("sinusoidal", "learned", "none")


class HyperNetwork(nn.Module):
  """Per-token MLP([d, hidden, features]), GELU: one weight row per token."""
  hidden_dim: int
  features: int
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    h = common.Dense(self.hidden_dim, axes=(common.EMBED, common.MLP),
                     name="hidden", **kw)(x)
    w = common.Dense(self.features, axes=(common.EMBED, common.HYPER),
                     name="out", **kw)(common.gelu(h))
    return common.constrain(w, (common.BATCH, common.LENGTH, common.HYPER))


def causal_token_mixing(w_in: Array, w_out: Array, values: Array,
                        segment_ids: Array | None) -> Array:
  """Causal TM-MLP: prefix sums instead of one hidden layer per segment.

  out[b,m,h,f] = w_out[b,m,h] · GELU(sum_{n<=m, same run}
                                     w_in[b,n,h] v[b,n,h,f])

  A run is a maximal stretch of equal segment ids, so tokens of different
  segments never mix (a non-contiguous segment is split into runs).
  """
  b, n = values.shape[:2]
  z = jnp.einsum("bnhk,bnhf->bnhfk", w_in, values)  # [B, N, H, f, d']
  starts = jnp.zeros((b, n), bool).at[:, 0].set(True)
  if segment_ids is not None:
    starts = starts.at[:, 1:].set(segment_ids[:, 1:] != segment_ids[:, :-1])

  def combine(left, right):
    (z_l, s_l), (z_r, s_r) = left, right
    return jnp.where(s_r[..., None, None, None], z_r, z_l + z_r), s_l | s_r

  hidden, _ = jax.lax.associative_scan(combine, (z, starts), axis=1)
  return jnp.einsum("bmhk,bmhfk->bmhf", w_out, common.gelu(hidden))


class HyperMixing(nn.Module):
  """HyperMixing token mixer (self- or cross-mixing).

  Attributes:
    hyper_dim: TM-MLP hidden width d' per head.
    num_heads: heads H; must divide d.
    tied: one hypernetwork for W1 and W2.
    position: 'sinusoidal' | 'learned' | 'none' position embeddings added to
      the hypernetwork inputs.
    max_len: rows of the learned position table (and sinusoidal table size).
    layer_norm: LayerNorm on the output.
    hidden_dim: hypernetwork hidden width (default d).
    causal: query m only reads keys n <= m (self-mixing only).
    max_segments: most packed examples per row when ``segment_ids`` is given
      (non-causal); each costs one TM-MLP hidden layer. Tokens of a segment
      id above it get NaN outputs, so an overflow cannot pass silently.
  """
  hyper_dim: int
  num_heads: int = 1
  tied: bool = False
  position: str = "sinusoidal"
  max_len: int = 512
  layer_norm: bool = True
  hidden_dim: int | None = None
  causal: bool = False
  max_segments: int = 1
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None,
               segment_ids: Array | None = None,
               positions: Array | None = None, deterministic: bool = True,
               context: Array | None = None,
               context_mask: Array | None = None,
               context_segment_ids: Array | None = None,
               context_positions: Array | None = None) -> Array:
    """Mixes ``x`` (queries [B, M, d]) with ``context`` (keys/values, or x)."""
    del deterministic  # no dropout inside the token mixer
    common.check_width(x, None, "HyperMixing")
    b, m, d = x.shape
    if context is None:
      context, context_mask = x, mask
      context_segment_ids, context_positions = segment_ids, positions
    else:
      if context.ndim != 3 or context.shape[::2] != (b, d):
        raise ValueError(
            f"HyperMixing: context has shape {tuple(context.shape)} but x is "
            f"[B, M, d] = {tuple(x.shape)}; keys/values must be [B, N, d] "
            "with the queries' batch and feature width.")
      if self.causal:
        raise ValueError("HyperMixing: causal=True needs self-mixing; do not "
                         "pass context.")
      if (segment_ids is None) != (context_segment_ids is None):
        raise ValueError("HyperMixing: pass both segment_ids and "
                         "context_segment_ids for packed cross-mixing, or "
                         "neither.")
    n = context.shape[1]
    if d % self.num_heads:
      raise ValueError(f"HyperMixing: num_heads={self.num_heads} must divide "
                       f"the feature width d={d}.")
    if self.position not in POSITIONS:
      raise ValueError(f"HyperMixing: position={self.position!r}, expected "
                       f"one of {POSITIONS}.")
    if self.position == "learned" and max(n, m) > self.max_len:
      raise ValueError(f"HyperMixing: sequence length {max(n, m)} exceeds "
                       f"max_len={self.max_len} of the learned positions; "
                       "raise max_len or truncate the inputs.")
    q_mask = common.resolve_mask(x, mask, segment_ids)
    k_mask = common.resolve_mask(context, context_mask, context_segment_ids)
    x, context = x.astype(self.dtype), context.astype(self.dtype)

    table = None  # [max_len, d]
    if self.position == "learned":
      table = self.param(
          "position_embedding",
          common.partitioned(nn.initializers.normal(0.02),
                             (common.SEQ_IN, common.EMBED)),
          (self.max_len, d), self.param_dtype)
    elif self.position == "sinusoidal":
      table = common.sinusoidal_positions(max(self.max_len, n, m), d)

    def add_positions(t, pos):
      if table is None:
        return t
      if pos is None:
        pos = jnp.arange(t.shape[1])[None]
      return t + jnp.take(table, pos, axis=0).astype(self.dtype)

    hyp_in = add_positions(context, context_positions)   # [B, N, d]
    hyp_out = add_positions(x, positions)                # [B, M, d]
    make = lambda name: HyperNetwork(  # noqa: E731
        self.hidden_dim or d, self.num_heads * self.hyper_dim,
        dtype=self.dtype, param_dtype=self.param_dtype, name=name)
    if self.tied:
      net = make("hypernetwork")
      w1, w2 = net(hyp_in), net(hyp_out)
    else:
      w1 = make("hypernetwork_in")(hyp_in)    # [B, N, H * d']
      w2 = make("hypernetwork_out")(hyp_out)  # [B, M, H * d']
    split = lambda t: t.reshape(  # noqa: E731
        t.shape[:2] + (self.num_heads, -1))
    w1, w2, v = split(w1), split(w2), split(context)  # v: [B, N, H, d/H]

    overflow = None
    if self.causal:
      if k_mask is not None:
        w1 = w1 * k_mask[..., None, None].astype(self.dtype)
      y = causal_token_mixing(w1, w2, v, segment_ids)
    else:
      k_seg, _ = segment_one_hot(context, k_mask, context_segment_ids,
                                 self.max_segments, self.dtype)  # [B, N, S]
      q_seg, overflow = segment_one_hot(x, q_mask, segment_ids,
                                        self.max_segments, self.dtype)
      y = token_mixing_mlp(w1, w2, v, k_seg, q_seg)  # [B, M, H, d/H]
    y = y.reshape(b, m, d)
    if self.layer_norm:
      y = common.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype,
                           name="layer_norm")(y)
    if q_mask is not None:
      y = jnp.where(q_mask[..., None], y, 0)  # LayerNorm's bias would leak
    if overflow is not None:
      y = jnp.where(overflow[..., None], jnp.nan, y)
    return common.constrain(y, (common.BATCH, common.LENGTH, common.EMBED))
