"""tMoE: a token-routed mixture of feed-forward experts (Yu et al. 2022, Sec. 2.2).

  y(x) = sum_{e in routed(x)} g_e(x) E_e(x),   E_e(x) = W2_e GELU(W1_e x + b1_e) + b2_e
  x [B, N, d];  W1 [E, d, d_ffn] ('expert', 'embed', 'mlp');  W2 [E, d_ffn, d]

Routing groups are the rows of the batch (one row = one group of N tokens,
capacity per row), so the routing of a row never depends on the other rows
nor on the mesh, and a top-1 router is causal (slots are filled in token
order). A packed row (several examples, ``segment_ids``; ``smlp_lm`` packs)
is one group: its examples share the row's capacity, and Base Layers'
balanced assignment in training spans them. Router statistics and losses
are means over rows of per-row means. Dropped and padding tokens get y = 0, i.e. they pass
through the block's residual.

Tokens reach the expert slots [G, E, C, d] by index (``dispatch='index'``:
each row's slots gathered by token id, the outputs gathered back by slot and
weighted by the gates; O(N k d) per row) or, for comparison, by GShard's
one-hot einsums (``'einsum'``: O(N E C d), quadratic in N at a fixed
capacity factor); both give the same numbers.

Expert parallelism: with a mesh whose 'expert' axis has n > 1 devices, each
device holds E/n experts; the per-row slots [G, E, C, d] (G rows sharded
over the batch axes plus 'expert') is exchanged by ``jax.lax.all_to_all``
inside ``jax.shard_map`` so that each device receives the slots of its own
experts from every row of its expert group, applies them, and sends the
results back by a second all-to-all. The experts' hidden width stays split
over the mesh axes the rules give it (the tensor axis): each device applies
its slice and the partial outputs are summed by ``jax.lax.psum``; the other
weight dimensions (fsdp) are gathered inside the map. Without such a mesh
the experts run on all slots at once; all give the same numbers.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from hypermixer_jax.models import common
from hypermixer_jax.models.moe import routers

Array = common.Array
EXPERT_AXIS = "expert"          # mesh axis of the experts
ROUTERS = ("switch", "gshard", "base", "hash")
SECOND_EXPERT_POLICIES = ("all", "random")
DISPATCHES = ("index", "einsum")


def check_dispatch(dispatch: str, owner: str) -> None:
  if dispatch not in DISPATCHES:
    raise ValueError(f"{owner}: dispatch={dispatch!r}, expected 'index' "
                     "(gather/scatter by slot) or 'einsum' (one-hot tensors).")


def to_slots(x: Array, routes: routers.Routes, num_experts: int,
             capacity: int, dispatch: str) -> Array:
  """``x [G, S, ...]`` -> the expert slots ``[G, E, C, ...]`` of each group."""
  if dispatch == "index":
    return jax.vmap(lambda a, r: routers.gather_slots(a, r, num_experts,
                                                      capacity))(x, routes)
  d, _ = jax.vmap(lambda r: routers.dense(r, num_experts, capacity))(routes)
  return jnp.einsum("gsec,gs...->gec...", d.astype(x.dtype), x)


def from_slots(ye: Array, routes: routers.Routes, dispatch: str) -> Array:
  """``ye [G, E, C, ...]`` -> ``[G, S, ...]``, gate-weighted sum over the
  slots each token filled."""
  if dispatch == "index":
    return jax.vmap(routers.combine_slots)(ye, routes)
  e, c = ye.shape[1:3]
  _, comb = jax.vmap(lambda r: routers.dense(r, e, c))(routes)
  return jnp.einsum("gsec,gec...->gs...", comb.astype(ye.dtype), ye)


def expert_mesh_size(axis: str = EXPERT_AXIS) -> int:
  """Devices on the current mesh's expert axis (1 without a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or axis not in mesh.axis_names:
    return 1
  return mesh.shape[axis]


def _group_axes(axis: str) -> tuple[str, ...]:
  """Mesh axes of the group (batch) dimension: the batch rule plus ``axis``."""
  mesh = jax.sharding.get_abstract_mesh()
  spec = nn.logical_to_mesh_axes((common.BATCH,))
  got = spec[0] if spec is not None and len(spec) else None
  got = () if got is None else ((got,) if isinstance(got, str) else tuple(got))
  names = tuple(a for a in got if a in mesh.axis_names)
  return names if axis in names else names + (axis,)


class ExpertMeshError(ValueError):
  """The experts or the routing groups do not divide over the mesh: a
  configuration error (``main.py`` stops with its one line)."""


def split_axes(logical: str, size: int, axis: str = EXPERT_AXIS
               ) -> tuple[str, ...]:
  """Mesh axes besides the group axes that the rules put ``logical`` on.

  Inside ``apply_experts``'s ``shard_map`` a weight dimension may stay split
  over these (Megatron-style tensor parallelism within each expert) instead
  of being gathered whole on every device. Empty without expert parallelism,
  when the rules keep ``logical`` on the group axes only, or when their
  devices do not divide ``size`` (the weight is then replicated there).
  """
  if expert_mesh_size(axis) == 1:
    return ()
  mesh = jax.sharding.get_abstract_mesh()
  spec = nn.logical_to_mesh_axes((logical,))
  got = spec[0] if spec is not None and len(spec) else None
  got = () if got is None else ((got,) if isinstance(got, str) else tuple(got))
  group = _group_axes(axis)
  names = tuple(a for a in got if a in mesh.axis_names and a not in group
                and mesh.shape[a] > 1)
  if not names or size % math.prod(mesh.shape[a] for a in names):
    return ()
  return names


def apply_experts(expert_fn: Callable[..., Array], params: Any, xe: Array,
                  extras: Any = None, *, axis: str = EXPERT_AXIS,
                  param_specs: Any = None) -> Array:
  """Runs ``expert_fn`` on dispatched slots, expert-parallel when possible.

  Args:
    expert_fn: ``(params, xe, extras) -> ye`` with ``xe [G', E', C, ...]``,
      params with a leading expert axis of size E', ``extras`` a pytree of
      per-group arrays ``[G', ...]`` (e.g. positions of each row).
    params: pytree of expert parameters, leading axis E.
    xe: [G, E, C, ...] the slots of every group.
    extras: pytree of [G, ...] arrays, or None.
    axis: the mesh axis the experts are sharded over.
    param_specs: pytree of ``jax.P`` of ``params`` inside the map (their
      first entry ``axis``); default ``jax.P(axis)``, i.e. every other
      dimension whole on each device. A dimension left split (``split_axes``)
      makes ``expert_fn`` responsible for its reduction (``jax.lax.psum``).
  Returns:
    ye [G, E, C, ...]. With a mesh axis ``axis`` of size n > 1, the experts
    are sharded n ways and the slots move by two ``all_to_all``s; otherwise
    ``expert_fn`` runs on everything at once.
  """
  n = expert_mesh_size(axis)
  if n == 1:
    return expert_fn(params, xe, extras)
  g, e = xe.shape[:2]
  gaxes = _group_axes(axis)
  mesh = jax.sharding.get_abstract_mesh()
  shards = 1
  for a in gaxes:
    shards *= mesh.shape[a]
  if e % n:
    raise ExpertMeshError(
        f"expert parallelism: {e} experts must divide by the mesh's '{axis}' "
        f"size {n}; pass --config.mesh.{axis}={math.gcd(e, n)} (it divides "
        "the experts and the devices) and let one axis take the other "
        "devices (its size -1).")
  if g % shards:
    raise ExpertMeshError(
        f"expert parallelism: the {g} routing groups (batch rows) must "
        f"divide by the {shards} devices of mesh axes {gaxes}; pass a batch "
        f"of rows divisible by {shards}.")
  gspec = jax.P(gaxes)

  def body(p, x, ex):
    x = jax.lax.all_to_all(x, axis, 1, 0, tiled=True)    # [G*n/s, E/n, C, .]
    if ex is not None:
      ex = jax.tree.map(
          lambda a: jax.lax.all_gather(a, axis, axis=0, tiled=True), ex)
    y = expert_fn(p, x, ex)
    return jax.lax.all_to_all(y, axis, 0, 1, tiled=True)  # [G/s, E, C, .]

  return jax.shard_map(
      body,
      in_specs=(jax.tree.map(lambda _: jax.P(axis), params)
                if param_specs is None else param_specs, gspec,
                jax.tree.map(lambda _: gspec, extras)),
      out_specs=gspec)(params, xe, extras)


def route_groups(fn: Callable[..., Any], *args: Any,
                 axis: str = EXPERT_AXIS) -> Any:
  """``jax.vmap(fn)(*args)`` over the leading group axis of every arg.

  Under a mesh that splits the groups (the batch axes, ``axis``) the map
  runs inside ``jax.shard_map``, each device routing its own groups: XLA's
  partitioner would otherwise gather the groups around the reductions, the
  top-k and the sort of Base Layers' auction loop (with data parallelism
  alone every device routed the whole batch). ``None`` args are passed
  through.
  """
  mapped = jax.vmap(fn)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return mapped(*args)
  gaxes = tuple(a for a in _group_axes(axis) if a in mesh.axis_names)
  if math.prod(mesh.shape[a] for a in gaxes) == 1:
    return mapped(*args)
  gspec = jax.P(gaxes)
  return jax.shard_map(
      mapped, in_specs=tuple(None if a is None else gspec for a in args),
      out_specs=gspec, check_vma=False)(*args)   # no collectives inside


def sow_router_aux(module: nn.Module, aux: dict, weights: dict) -> None:
  """Sows weighted losses into 'aux_loss' and every statistic (losses
  unweighted too) into 'moe_metrics'. ``aux`` values carry a leading group
  axis; they are averaged over it."""
  for k, v in aux.items():
    v = jnp.mean(v, axis=0)
    module.sow("moe_metrics", k, v)
    if k in weights and weights[k]:
      module.sow("aux_loss", k, weights[k] * v)


class MoeFeedForward(nn.Module):
  """Mixture of feed-forward experts ``[B, N, d] -> [B, N, d]`` (no residual).

  Attributes:
    num_experts: E.
    d_ffn: hidden width of each expert.
    router: 'switch' (top-1), 'gshard' (top-2), 'base' (balanced) or 'hash'.
    capacity_factor: slots per expert = ceil(k N cf / E) in training
      (Base Layers uses exactly N / E).
    eval_capacity_factor: the same at inference (``deterministic=True``).
    jitter_noise: Switch's multiplicative U(1-eps, 1+eps) noise on the router
      input in training (drawn from the 'dropout' rng).
    load_balancing_weight, z_loss_weight: coefficients of the sown losses.
    token_priority: GShard fills slots token by token (both choices of a
      token before the next token), which keeps top-2 causal; the default
      is GShard's choice-major priority.
    second_expert_policy: GShard's second expert: 'all' (every token asks
      for it, as flaxformer's top-2 routers) or 'random' (the GShard paper's
      random routing: asked for with probability 2 g2 in training, drawn
      from the 'dropout' rng; every second choice asks at inference).
    vocab_size, hash_seed: the Hash router's table (call with ``token_ids``).
    auction_epsilon, auction_max_iters: Base Layers' assignment solver.
    dropout_rate: dropout on the layer's output.
    dispatch: how tokens reach the expert slots: 'index' (gather / scatter
      by slot, linear in the tokens) or 'einsum' (GShard's one-hot
      ``[S, E, C]`` tensors, quadratic; the same numbers).
  """
  num_experts: int
  d_ffn: int
  router: str = "switch"
  capacity_factor: float = 1.25
  eval_capacity_factor: float = 2.0
  jitter_noise: float = 0.0
  load_balancing_weight: float = 1e-2
  z_loss_weight: float = 1e-3
  token_priority: bool = False
  second_expert_policy: str = "all"
  vocab_size: int | None = None
  hash_seed: int = 0
  auction_epsilon: float | None = None
  auction_max_iters: int = 1000
  dropout_rate: float = 0.0
  dispatch: str = "index"
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  def _route(self, x, logits, mask, token_ids, deterministic):
    """Per-row routing: (``Routes`` [B, N, k], aux [B, ...], capacity)."""
    n, e = x.shape[1], self.num_experts
    k = 2 if self.router == "gshard" else 1
    cf = self.eval_capacity_factor if deterministic else self.capacity_factor
    cap = routers.expert_capacity(n, e, cf, k)
    if self.router in ("switch", "gshard"):
      draw = None
      if self.second_expert_policy == "random" and not deterministic:
        draw = jax.random.uniform(self.make_rng("dropout"), mask.shape)
      fn = lambda l, m, u: routers.top_k_route(
          l, k=k, capacity=cap, mask=m, normalize_gates=k > 1,
          priority="token" if self.token_priority else "choice",
          second_draw=u)
      return route_groups(fn, logits, mask, draw) + (cap,)
    if self.router == "base":
      fn = lambda l, m: routers.base_route(
          l, train=not deterministic, capacity=cap, mask=m,
          epsilon=self.auction_epsilon, max_iters=self.auction_max_iters)
      # Training's balanced assignment fills exactly N / E slots per expert.
      return route_groups(fn, logits, mask) + (
          cap if deterministic else n // e,)
    if token_ids is None or self.vocab_size is None:
      raise ValueError("MoeFeedForward(router='hash') needs vocab_size and "
                       "the token_ids of x.")
    table = jnp.asarray(routers.make_hash_table(self.vocab_size, e,
                                                self.hash_seed))
    fn = lambda t, m: routers.hash_route(t, table=table, num_experts=e,
                                         capacity=cap, mask=m)
    return route_groups(fn, token_ids, mask) + (cap,)

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None,
               segment_ids: Array | None = None,
               token_ids: Array | None = None,
               deterministic: bool = True) -> Array:
    if self.router not in ROUTERS:
      raise ValueError(f"MoeFeedForward: router={self.router!r}, expected "
                       f"one of {ROUTERS}.")
    if self.second_expert_policy not in SECOND_EXPERT_POLICIES:
      raise ValueError(
          f"MoeFeedForward: second_expert_policy={self.second_expert_policy!r}"
          f", expected one of {SECOND_EXPERT_POLICIES}.")
    if self.second_expert_policy != "all" and self.router != "gshard":
      raise ValueError(
          f"MoeFeedForward: second_expert_policy="
          f"{self.second_expert_policy!r} is GShard's (top-2); router="
          f"{self.router!r} has one expert a token: leave it at 'all'.")
    check_dispatch(self.dispatch, "MoeFeedForward")
    common.check_width(x, None, "MoeFeedForward")
    b, n, d = x.shape
    e, f = self.num_experts, self.d_ffn
    mask = common.resolve_mask(x, mask, segment_ids)
    if mask is None:
      mask = jnp.ones((b, n), bool)
    x = common.constrain(x, (common.BATCH, common.LENGTH, common.EMBED))

    logits = None
    if self.router != "hash":
      r_in = x
      if self.jitter_noise and not deterministic:
        r_in = r_in * jax.random.uniform(
            self.make_rng("dropout"), r_in.shape, r_in.dtype,
            1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
      # The router runs in float32: its softmax decides discrete routes.
      logits = common.Dense(e, (common.EMBED, None), use_bias=False,
                            dtype=jnp.float32, param_dtype=self.param_dtype,
                            name="router")(r_in.astype(jnp.float32))  # [B,N,E]
    routes, aux, cap = self._route(x, logits, mask, token_ids,
                                   deterministic)         # [B, N, k]
    sow_router_aux(self, aux, {"load_balancing_loss": self.load_balancing_weight,
                               "z_loss": self.z_loss_weight})

    def layer(kernel, bias, axes, size_in, size_out):
      """One linear layer per expert: ``[E, in, out]`` kernel, ``[E, out]``
      bias."""
      w = self.param(kernel, common.partitioned(
          nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                           in_axis=1, out_axis=2,
                                           batch_axis=0),
          (common.EXPERT, *axes)), (e, size_in, size_out), self.param_dtype)
      b = self.param(bias, common.partitioned(nn.initializers.zeros_init(),
                                              (common.EXPERT, axes[1])),
                     (e, size_out), self.param_dtype)
      return w, b

    w1, b1 = layer("wi", "bi", (common.EMBED, common.MLP), d, f)
    w2, b2 = layer("wo", "bo", (common.MLP, common.EMBED), f, d)
    dt = self.dtype
    xe = to_slots(x.astype(dt), routes, e, cap, self.dispatch)  # [B, E, C, d]
    # Under expert parallelism the hidden width stays split where the rules
    # split it (the tensor axis): each device applies its slice of every
    # expert and the partial outputs are summed, instead of gathering whole
    # experts onto every device.
    tp = split_axes(common.MLP, f)
    def experts(p, xs, _):
      w1, b1, w2, b2 = (a.astype(dt) for a in p)
      h = common.gelu(jnp.einsum("gecd,edf->gecf", xs, w1) + b1[:, None])
      if not tp:
        return jnp.einsum("gecf,efd->gecd", h, w2) + b2[:, None]
      # Partial outputs summed in float32, as one device's matmul sums.
      y = jnp.einsum("gecf,efd->gecd", h, w2,
                     preferred_element_type=jnp.promote_types(dt, jnp.float32))
      return jax.lax.psum(y, tp).astype(dt) + b2[:, None]

    specs = None
    if tp:
      ax = EXPERT_AXIS
      specs = (jax.P(ax, None, tp), jax.P(ax, tp), jax.P(ax, tp, None),
               jax.P(ax))
    ye = apply_experts(experts, (w1, b1, w2, b2), xe,
                       param_specs=specs)                    # [B, E, C, d]
    y = from_slots(ye, routes, self.dispatch)                # [B, N, d]
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    return common.constrain(y, (common.BATCH, common.LENGTH, common.EMBED))
