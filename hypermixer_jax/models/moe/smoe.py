"""sMoE: token-mixing experts that route hidden dimensions (Yu et al. 2022, Sec. 3).

gMLP's gate half V = LN(Z2) [B, T, H] is cut along the HIDDEN axis; every
expert owns one spatial matrix W_e [T, T] ('expert', 'seq_out', 'seq_in')
and bias b_e [T] and mixes the tokens of the hidden columns it receives:

  f(V)[:, j] = W_e V[:, j] + b_e        for the expert e of column j.

Routing of the columns:
  * deterministic: H cut into E slices of H/E, slice e to expert e (each
    expert acts like one attention head);
  * partial prediction: a router W_r [0.2T, E] reads only the first
    s = floor(0.2 T) tokens, p(v_j) = softmax(V[:s, j]^T W_r), column j goes
    to its top expert (Switch routing with capacity over the H columns of a
    row), weighted by p. Positions t < s receive f = 1 (no token mixing), so
    that no position depends on a later token; the language-model loss counts
    positions >= s only (``partial_prefix_len``). Columns dropped by the
    capacity get f = 0 (the block adds nothing there).

W is causal (lower triangular) when ``causal``. Padded tokens are zeroed
before mixing; packed rows use W[pos_t, pos_u], zero across segments (the
partial router still reads the first s tokens of the row, so partial routing
is meant for unpacked rows).

Expert parallelism: as in ``tmoe``; the [B, E, columns, T] slots are sent to
the device of their expert by all-to-all over the mesh's 'expert' axis, so
the hidden dimension is sharded over it inside the experts.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hypermixer_jax.models import common
from hypermixer_jax.models import gmlp
from hypermixer_jax.models.moe import routers
from hypermixer_jax.models.moe.tmoe import (apply_experts, route_groups,
                                            sow_router_aux)

Array = common.Array
ROUTINGS = ("deterministic", "partial")


def partial_prefix_len(max_len: int, fraction: float = 0.2) -> int:
  """s = floor(fraction * max_len): tokens that decide the routing."""
  return max(1, int(fraction * max_len))


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
    max_len: largest T; W_e is [max_len, max_len].
    routing: 'deterministic' or 'partial'.
    causal: W_e lower triangular.
    partial_fraction: share of the tokens read by the partial router.
    capacity_factor, eval_capacity_factor: partial routing's column slots
      per expert, ceil(H cf / E), in training / at inference.
    load_balancing_weight, z_loss_weight: partial router's sown losses.
    init_scale: W_e ~ U(-init_scale / max_len, init_scale / max_len), b_e = 1
      (each expert starts as the identity gate, like gMLP's SGU).
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
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @property
  def prefix_len(self) -> int:
    return partial_prefix_len(self.max_len, self.partial_fraction)

  @nn.compact
  def __call__(self, v: Array, *, mask: Array | None = None,
               segment_ids: Array | None = None,
               positions: Array | None = None,
               deterministic: bool = True) -> Array:
    if self.routing not in ROUTINGS:
      raise ValueError(f"SparseSpatialMixing: routing={self.routing!r}, "
                       f"expected one of {ROUTINGS}.")
    b, n, h = v.shape
    e, L = self.num_experts, self.max_len
    if n > L:
      raise ValueError(f"SparseSpatialMixing: sequence length {n} exceeds "
                       f"max_len={L}.")
    mask = common.resolve_mask(v, mask, segment_ids)
    eps = self.init_scale / L
    w = self.param("kernel", common.partitioned(
        lambda k, s, d: jax.random.uniform(k, s, d, -eps, eps),
        (common.EXPERT, common.SEQ_OUT, common.SEQ_IN)), (e, L, L),
                   self.param_dtype)
    bias = self.param("bias", common.partitioned(
        nn.initializers.ones_init(), (common.EXPERT, common.SEQ_OUT)), (e, L),
                      self.param_dtype)
    dt = self.dtype
    params = (w.astype(dt), bias.astype(dt))
    v = v.astype(dt)
    if mask is not None:
      v = jnp.where(mask[:, :, None], v, 0)
    extras = None
    if positions is not None or segment_ids is not None:
      pos = (jnp.broadcast_to(jnp.arange(n), (b, n)) if positions is None
             else positions)
      allowed = common.pair_mask(None, segment_ids, False, n, n)
      allowed = (jnp.ones((b, n, n), bool) if allowed is None
                 else jnp.broadcast_to(allowed, (b, n, n)))
      extras = (pos, allowed)
    expert_fn = lambda p, x, ex: _spatial_experts(p, x, ex, causal=self.causal)

    if self.routing == "deterministic":
      if h % e:
        raise ValueError(f"SparseSpatialMixing: hidden width {h} must divide "
                         f"by num_experts={e} for deterministic routing.")
      xe = jnp.transpose(v.reshape(b, n, e, h // e), (0, 2, 3, 1))  # [B,E,H/E,T]
      ye = apply_experts(expert_fn, params, xe, extras)
      sow_router_aux(self, {
          "expert_usage": jnp.full((1, e), 1.0 / e),
          "dropped_fraction": jnp.zeros((1,))}, {})
      return jnp.transpose(ye, (0, 3, 1, 2)).reshape(b, n, h)

    s = self.prefix_len
    if n <= s:
      raise ValueError(
          f"SparseSpatialMixing: partial-prediction routing reads the first "
          f"{s} tokens (partial_fraction * max_len) and needs a longer "
          f"sequence than the {n} given.")
    w_r = self.param("router", common.partitioned(
        nn.initializers.normal(s ** -0.5), (common.SEQ_IN, None)), (s, e),
                     self.param_dtype)
    # Router in float32: it takes discrete decisions.
    logits = jnp.einsum("btj,te->bje", v[:, :s].astype(jnp.float32),
                        w_r.astype(jnp.float32))                   # [B, H, E]
    cf = self.eval_capacity_factor if deterministic else self.capacity_factor
    cap = routers.expert_capacity(h, e, cf)
    dispatch, combine, aux = route_groups(
        lambda l: routers.switch_route(l, capacity=cap), logits)   # [B,H,E,C]
    sow_router_aux(self, aux, {"load_balancing_loss": self.load_balancing_weight,
                               "z_loss": self.z_loss_weight})
    xe = jnp.einsum("bjec,btj->bect", dispatch.astype(dt), v)      # [B,E,C,T]
    ye = apply_experts(expert_fn, params, xe, extras)
    f = jnp.einsum("bjec,bect->btj", combine.astype(dt), ye)       # [B, T, H]
    return jnp.where((jnp.arange(n) < s)[None, :, None], jnp.ones((), dt), f)


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
        z_loss_weight=self.z_loss_weight, dtype=self.dtype,
        param_dtype=self.param_dtype, name="spatial")(
            z2, mask=mask, segment_ids=segment_ids, positions=positions,
            deterministic=deterministic)
