"""sMoE: token-mixing experts that route hidden dimensions (Yu et al. 2022, Sec. 3).

gMLP's gate half V = LN(Z2) [B, T, H] is cut along the HIDDEN axis; every
expert owns one spatial matrix W_e ('expert', 'seq_out', 'seq_in') and bias
b_e and mixes the tokens of the hidden columns it receives:

  f(V)[:, j] = W_e V[:, j] + b_e        for the expert e of column j.

Routing of the columns:
  * deterministic: H cut into E slices of H/E, slice e to expert e (each
    expert acts like one attention head). W_e is [T, T] (T = ``max_len``)
    and acts on the whole column.
  * partial prediction, as in the paper (Sec. 3.2): each row is split into
    its first s = max(1, floor(0.2 n)) tokens X1 and the other n - s tokens
    X2, where n is the row's ACTUAL length (its unpadded tokens, from
    ``mask`` / ``segment_ids``; the full row when neither is given). A router
    W_r [floor(0.2 T), E] reads X1 only: p(v_j) = softmax(V1[:, j]^T
    W_r[:s]), and column j goes to its top expert (Switch routing with
    capacity over the H columns of a row), weighted by p. The expert then
    mixes only X2's part of the column, as a sequence of its own:

      f[s + t, j] = p_e(v_j) (sum_{u <= t} W_e[t, u] V[s + u, j] + b_e[t]),
      0 <= t < n - s,    W_e [T2, T2], T2 = T - floor(0.2 T),

    so X1 tokens enter X2's outputs through the router only. Positions
    t < s (X1) receive f = 1 (no token mixing); the language-model loss
    counts X2 only (``partial_loss_weights``). Columns dropped by the
    capacity get f = 0 on X2 (the block adds nothing there). Padding after
    the n real tokens gets values nobody should read.

Causality of partial prediction: no output depends on the VALUES of later
tokens (X2 reads X1 through the router, and X2 itself through the lower
triangular W_e). The split point s does depend on the row's length n, i.e.
on how many tokens there are, as in the paper, where every training row has
the full length T. Generation must therefore fix the length it routes with
(a row of the intended final length, later positions filled with any token:
their values do not reach earlier outputs), not re-split at every step.

W is causal (lower triangular) when ``causal``. Padded tokens are zeroed
before mixing, so a right-padded row gives the same outputs on its real
tokens as the unpadded row. Deterministic routing supports packed rows
(W[pos_t, pos_u], zero across segments). Partial routing does not: it splits
and routes the ROW (its first 20% of real tokens, segments ignored), so a
packed row would mix examples; the training loop refuses partial routing with
``data.packing``.

Static shapes: W_e and W_r are sized for ``max_len`` T; a row of actual
length n <= T uses their leading n - s x n - s and s x E blocks. The per-row
split is a gather by s, so one compilation serves every length mix.

Expert parallelism: as in ``tmoe``; the [B, E, columns, T] slots are sent to
the device of their expert by all-to-all over the mesh's 'expert' axis, so
the hidden dimension is sharded over it inside the experts.
"""
from __future__ import annotations

import fractions

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hypermixer_jax.models import common
from hypermixer_jax.models import gmlp
from hypermixer_jax.models.moe import routers
from hypermixer_jax.models.moe.tmoe import (apply_experts, check_dispatch,
                                            from_slots, route_groups,
                                            sow_router_aux, to_slots)

Array = common.Array
ROUTINGS = ("deterministic", "partial")


def _fraction(fraction: float) -> tuple[int, int]:
  if not 0.0 < fraction < 1.0:
    raise ValueError(f"partial_fraction={fraction}: expected a share of the "
                     "tokens strictly between 0 and 1 (the paper's 0.2).")
  frac = fractions.Fraction(fraction).limit_denominator(10_000)
  return frac.numerator, frac.denominator


def partial_prefix_len(length, fraction: float = 0.2):
  """s = max(1, floor(fraction * length)): the tokens that decide routing.

  ``length`` is an int (static) or an integer array of per-row lengths; the
  floor is taken in integer arithmetic (``fraction`` as a ratio p/q), so
  both give the same s (0.7 * 90 is 63, not 62 by float rounding).
  """
  p, q = _fraction(fraction)
  if isinstance(length, (int, np.integer)):
    return max(1, int(length) * p // q)
  return jnp.maximum(1, jnp.asarray(length, jnp.int32) * p // q)


def row_lengths(mask: Array | None, batch: int, n: int) -> Array:
  """Actual (unpadded) length of each row: its real tokens, or n."""
  if mask is None:
    return jnp.full((batch,), n, jnp.int32)
  return jnp.sum(mask.astype(jnp.int32), axis=1)


def partial_loss_weights(weights: Array, segment_ids: Array | None,
                         fraction: float = 0.2) -> Array:
  """Zeroes ``weights [B, N]`` on each row's routing prefix X1.

  The prefix is the first ``partial_prefix_len(n_b)`` positions, n_b the
  row's real tokens (``segment_ids > 0``; all N when None), as in the layer.
  """
  b, n = weights.shape
  mask = None if segment_ids is None else segment_ids > 0
  start = partial_prefix_len(row_lengths(mask, b, n), fraction)     # [B]
  keep = jnp.arange(n)[None, :] >= start[:, None]
  return weights * keep.astype(weights.dtype)


def _spatial_experts(params, xe, extras, *, causal: bool):
  """``out[g,e,c,t] = sum_u W_e[t,u] x[g,e,c,u] + b_e[t]``; xe [G, E, C, T]."""
  w, bias = params                                   # [E, L, L], [E, L]
  n = xe.shape[-1]
  if causal:
    w = jnp.tril(w)
  if extras is None:
    w = w[:, :n, :n]
    y = jnp.einsum("etu,gecu->gect", w, xe)
    return y + bias[None, :, None, :n]
  pos, allowed = extras                              # [G, T], [G, T, T]
  mat = w[:, pos[:, :, None], pos[:, None, :]]       # [E, G, T, T]
  mat = jnp.where(allowed[None], mat, 0)
  y = jnp.einsum("egtu,gecu->gect", mat, xe)
  return y + jnp.transpose(bias[:, pos], (1, 0, 2))[:, :, None, :]


class SparseSpatialMixing(nn.Module):
  """sMoE spatial projection f(V) ``[B, T, H] -> [B, T, H]``.

  Attributes:
    num_experts: E (H must divide by E for deterministic routing).
    max_len: largest T; W_e is [T, T] (deterministic) or [T - s]^2 with
      s = ``partial_prefix_len(T)`` = max(1, floor(partial_fraction T))
      (partial: it mixes X2 only), W_r [s, E].
    routing: 'deterministic' or 'partial'.
    causal: W_e lower triangular.
    partial_fraction: share of the tokens read by the partial router.
    capacity_factor, eval_capacity_factor: partial routing's column slots
      per expert, ceil(H cf / E), in training / at inference.
    load_balancing_weight, z_loss_weight: partial router's sown losses.
    init_scale: W_e ~ U(-init_scale / max_len, init_scale / max_len), b_e = 1
      (each expert starts as the identity gate, like gMLP's SGU).
    dispatch: partial routing's column dispatch, 'index' or 'einsum' (as
      ``MoeFeedForward.dispatch``).
  """
  num_experts: int
  max_len: int
  routing: str = "deterministic"
  causal: bool = True
  partial_fraction: float = 0.2
  capacity_factor: float = 1.25
  eval_capacity_factor: float = 2.0
  load_balancing_weight: float = 1e-2
  z_loss_weight: float = 1e-3
  init_scale: float = 1e-3
  dispatch: str = "index"
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @property
  def prefix_len(self) -> int:
    """Largest routing prefix, floor(partial_fraction * max_len)."""
    return partial_prefix_len(self.max_len, self.partial_fraction)

  @property
  def expert_len(self) -> int:
    """Side of W_e: max_len, or max_len - prefix_len (partial routing)."""
    if self.routing == "partial":
      return self.max_len - self.prefix_len
    return self.max_len

  @nn.compact
  def __call__(self, v: Array, *, mask: Array | None = None,
               segment_ids: Array | None = None,
               positions: Array | None = None,
               deterministic: bool = True) -> Array:
    if self.routing not in ROUTINGS:
      raise ValueError(f"SparseSpatialMixing: routing={self.routing!r}, "
                       f"expected one of {ROUTINGS}.")
    check_dispatch(self.dispatch, "SparseSpatialMixing")
    b, n, h = v.shape
    e, L = self.num_experts, self.max_len
    if n > L:
      raise ValueError(f"SparseSpatialMixing: sequence length {n} exceeds "
                       f"max_len={L}.")
    mask = common.resolve_mask(v, mask, segment_ids)
    ls = self.expert_len
    eps = self.init_scale / L
    w = self.param("kernel", common.partitioned(
        lambda k, s, d: jax.random.uniform(k, s, d, -eps, eps),
        (common.EXPERT, common.SEQ_OUT, common.SEQ_IN)), (e, ls, ls),
                   self.param_dtype)
    bias = self.param("bias", common.partitioned(
        nn.initializers.ones_init(), (common.EXPERT, common.SEQ_OUT)), (e, ls),
                      self.param_dtype)
    dt = self.dtype
    params = (w.astype(dt), bias.astype(dt))
    v = v.astype(dt)
    if mask is not None:
      v = jnp.where(mask[:, :, None], v, 0)
    expert_fn = lambda p, x, ex: _spatial_experts(p, x, ex, causal=self.causal)

    if self.routing == "deterministic":
      if h % e:
        raise ValueError(f"SparseSpatialMixing: hidden width {h} must divide "
                         f"by num_experts={e} for deterministic routing.")
      extras = None
      if positions is not None or segment_ids is not None:
        pos = (jnp.broadcast_to(jnp.arange(n), (b, n)) if positions is None
               else positions)
        allowed = common.pair_mask(None, segment_ids, False, n, n)
        allowed = (jnp.ones((b, n, n), bool) if allowed is None
                   else jnp.broadcast_to(allowed, (b, n, n)))
        extras = (pos, allowed)
      xe = jnp.transpose(v.reshape(b, n, e, h // e), (0, 2, 3, 1))  # [B,E,H/E,T]
      ye = apply_experts(expert_fn, params, xe, extras)
      sow_router_aux(self, {
          "expert_usage": jnp.full((1, e), 1.0 / e),
          "dropped_fraction": jnp.zeros((1,))}, {})
      return jnp.transpose(ye, (0, 3, 1, 2)).reshape(b, n, h)

    # Partial prediction. Per row: s = prefix of its actual length, X1 =
    # [0, s), X2 = [s, length). ``n2`` bounds X2's length statically:
    # length - prefix(length) grows with length, and length <= n.
    if n < 2:
      raise ValueError(
          f"SparseSpatialMixing: partial-prediction routing splits each row "
          f"into a routing prefix and the predicted rest and needs at least "
          f"2 tokens; got a sequence of {n}.")
    s_max = self.prefix_len
    lengths = row_lengths(mask, b, n)                              # [B]
    s = partial_prefix_len(lengths, self.partial_fraction)         # [B]
    n1 = min(n, s_max)                     # W_r rows a length-n row can use
    n2 = n - partial_prefix_len(n, self.partial_fraction)
    w_r = self.param("router", common.partitioned(
        nn.initializers.normal(s_max ** -0.5), (common.SEQ_IN, None)),
                     (s_max, e), self.param_dtype)
    # Router in float32 (it takes discrete decisions), on X1 only.
    in_x1 = jnp.arange(n1)[None, :] < s[:, None]                   # [B, n1]
    v1 = jnp.where(in_x1[:, :, None], v[:, :n1], 0).astype(jnp.float32)
    logits = jnp.einsum("btj,te->bje", v1,
                        w_r[:n1].astype(jnp.float32))              # [B, H, E]
    cf = self.eval_capacity_factor if deterministic else self.capacity_factor
    cap = routers.expert_capacity(h, e, cf)
    routes, aux = route_groups(
        lambda l: routers.switch_route(l, capacity=cap), logits)   # [B, H, 1]
    sow_router_aux(self, aux, {"load_balancing_loss": self.load_balancing_weight,
                               "z_loss": self.z_loss_weight})
    # X2 shifted to the front of each row: v2[b, t] = v[b, s_b + t].
    src = s[:, None] + jnp.arange(n2)[None, :]                     # [B, n2]
    v2 = jnp.take_along_axis(v, jnp.minimum(src, n - 1)[:, :, None], axis=1)
    v2 = jnp.where((src < lengths[:, None])[:, :, None], v2, 0)
    xe = to_slots(jnp.swapaxes(v2, 1, 2), routes, e, cap,
                  self.dispatch)                                   # [B,E,C,n2]
    ye = apply_experts(expert_fn, params, xe, None)
    f2 = jnp.swapaxes(from_slots(ye, routes, self.dispatch), 1, 2)  # [B,n2,H]
    # Back to the row's positions: f[b, t] = f2[b, t - s_b] on X2, 1 on X1.
    rel = jnp.arange(n)[None, :] - s[:, None]                      # [B, n]
    f = jnp.take_along_axis(f2, jnp.clip(rel, 0, n2 - 1)[:, :, None], axis=1)
    return jnp.where((rel < 0)[:, :, None], jnp.ones((), dt), f)


class SparseGatingUnit(gmlp.SpatialGatingUnit):
  """gMLP's SGU with sMoE spatial experts, ``[B, N, d] -> [B, N, d]``.

  ``(GELU(x U) -> Z1 * f(LN(Z2))) V`` with f = ``SparseSpatialMixing``
  instead of one spatial matrix; everything else is ``SpatialGatingUnit``.
  Follows the token-mixer contract (``causal`` is an attribute).
  """
  causal: bool = True
  num_experts: int = 0
  routing: str = "deterministic"
  partial_fraction: float = 0.2
  capacity_factor: float = 1.25
  eval_capacity_factor: float = 2.0
  load_balancing_weight: float = 1e-2
  z_loss_weight: float = 1e-3
  dispatch: str = "index"

  def spatial_mixing(self, z2, *, mask, segment_ids, positions, deterministic):
    if self.num_experts < 1:
      raise ValueError(f"SparseGatingUnit: num_experts={self.num_experts}; "
                       "set it to the number of spatial experts (>= 1).")
    return SparseSpatialMixing(
        self.num_experts, self.max_len, routing=self.routing,
        causal=self.causal, partial_fraction=self.partial_fraction,
        capacity_factor=self.capacity_factor,
        eval_capacity_factor=self.eval_capacity_factor,
        load_balancing_weight=self.load_balancing_weight,
        z_loss_weight=self.z_loss_weight, dispatch=self.dispatch,
        dtype=self.dtype,
        param_dtype=self.param_dtype, name="spatial")(
            z2, mask=mask, segment_ids=segment_ids, positions=positions,
            deterministic=deterministic)
