"""Token routers for mixture-of-experts layers, as small pure functions.

Every router works on ONE routing group of ``S`` tokens (the layers vmap them
over groups) and returns

  routes    ``Routes``: for each token's k choices its expert, its slot in
            that expert, its gate and whether it was kept ([S, k] each);
  aux       dict of scalars / [E] vectors (losses and statistics),

with ``E`` experts of capacity ``C`` slots. A token whose expert is full is
dropped (not kept): the MoE output is zero there and the token passes
through the block's residual. Padding tokens (``mask`` False) are never
routed.

Two ways to move tokens into the ``[E, C, ...]`` expert slots and back:
``gather_slots`` / ``combine_slots`` index them (O(S k) copies, the layers'
default), ``dense`` builds GShard's one-hot ``[S, E, C]`` dispatch and
combine tensors for einsums, whose cost grows with S * E * C, i.e. with S^2
at a fixed capacity factor (kept for comparison and tests). Slots are filled in token order (earlier
tokens first), so with a per-sequence group a token's routing never depends
on later tokens (top-1 routers, and top-k with ``priority='token'``).

Routers (Yu et al. 2022, Sec. 2.2, and the papers they cite):
  * Switch (Fedus et al.): top-1, gate p_e(x) = softmax(x W_r)_e,
    load-balancing loss  E * sum_e f_e P_e  (f_e: fraction of tokens whose
    argmax is e, P_e: mean router probability of e), router z-loss
    mean(logsumexp(x W_r)^2) (Zoph et al.), capacity factor.
  * GShard (Lepikhin et al.): top-2, gates renormalised over the two, the
    second choices fill the slots left by all first choices; optionally its
    random routing (the second expert asked for with probability 2 g2).
  * Base Layers (Lewis et al.): a balanced assignment (every expert exactly
    S / E tokens) by an auction (Bertsekas), gate sigmoid(x . w_e); greedy
    top-1 at inference.
  * Hash Layers (Roller et al.): a fixed random token-id -> expert table.

Statistics in ``aux`` (over real tokens): ``expert_usage`` [E] (share of the
k * #tokens assignments each expert processed), ``dropped_fraction``,
``router_confidence`` (mean top probability) and ``router_entropy``.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

LOSS_KEYS = ("load_balancing_loss", "z_loss")


def expert_capacity(num_tokens: int, num_experts: int,
                    capacity_factor: float, k: int = 1) -> int:
  """Slots per expert: ``ceil(k * S * capacity_factor / E)``, at least 1."""
  return max(1, int(math.ceil(k * num_tokens * capacity_factor / num_experts)))


def _real(mask: Array | None, s: int) -> Array:
  return (jnp.ones((s,), jnp.float32) if mask is None
          else mask.astype(jnp.float32))


class Routes(NamedTuple):
  """Where a group's tokens go: ``[S, k]`` each (k choices per token).

  ``slot`` is the token's place in its expert in filling order; it is
  ``>= capacity`` for a dropped choice. ``keep``: routed (a real token) and
  within the capacity. ``gate``: the choice's weight in the output (also
  given where not kept; ``keep`` decides).
  """
  expert: Array
  slot: Array
  gate: Array
  keep: Array


def _slots(choice: Array, taken: Array, capacity: int):
  """Token-order slot of each token in its chosen expert.

  Args:
    choice: [S, E] one-hot (0 rows for tokens not routed by this choice).
    taken: [E] slots already filled by earlier choices.
  Returns:
    keep [S] bool (a choice and a free slot), slot [S] int, new ``taken``.
  """
  pos = jnp.cumsum(choice, axis=0) - choice + taken[None, :]     # [S, E]
  keep = jnp.sum(choice * (pos < capacity), axis=-1) > 0
  slot = jnp.sum(pos * choice, axis=-1).astype(jnp.int32)         # [S]
  return keep, slot, taken + jnp.sum(choice, axis=0)


def _flat_slots(routes: Routes, num_experts: int, capacity: int) -> Array:
  """[S, k] index into the flattened ``[E * C]`` slots; ``E * C`` when not
  kept (out of range: dropped by scatters, filled by gathers)."""
  flat = routes.expert * capacity + routes.slot
  return jnp.where(routes.keep, flat, num_experts * capacity)


def gather_slots(x: Array, routes: Routes, num_experts: int,
                 capacity: int) -> Array:
  """``x [S, ...]`` -> ``[E, C, ...]``: each slot holds its token (0 if
  empty). One scatter of S * k token ids and one gather of the slots."""
  s, k = routes.expert.shape
  flat = _flat_slots(routes, num_experts, capacity).reshape(-1)
  token = jnp.full((num_experts * capacity,), s, jnp.int32).at[flat].set(
      jnp.repeat(jnp.arange(s, dtype=jnp.int32), k), mode="drop")
  xe = jnp.take(x, token, axis=0, mode="fill", fill_value=0)
  return xe.reshape((num_experts, capacity) + x.shape[1:])


def combine_slots(ye: Array, routes: Routes) -> Array:
  """``ye [E, C, ...]`` -> ``[S, ...]``: y_s = sum_i gate_si ye[e_si, c_si]
  over the kept choices i of token s (0 for a token with none)."""
  e, c = ye.shape[:2]
  flat = _flat_slots(routes, e, c)                                  # [S, k]
  picked = jnp.take(ye.reshape((e * c,) + ye.shape[2:]), flat, axis=0,
                    mode="fill", fill_value=0)                      # [S, k, ..]
  gate = jnp.where(routes.keep, routes.gate, 0).astype(ye.dtype)
  gate = gate.reshape(gate.shape + (1,) * (ye.ndim - 2))
  return jnp.sum(picked * gate, axis=1)


def dense(routes: Routes, num_experts: int, capacity: int):
  """GShard's one-hot tensors of ``routes``: dispatch [S, E, C] (0/1: token
  s fills slot c of expert e) and combine [S, E, C] (dispatch times gate)."""
  d = (jax.nn.one_hot(routes.expert, num_experts)
       * routes.keep[..., None])[..., None] * jax.nn.one_hot(
           routes.slot, capacity)[..., None, :]                   # [S,k,E,C]
  return jnp.sum(d, axis=1), jnp.einsum("skec,sk->sec", d, routes.gate)


def _stats(probs: Array | None, routes: Routes, num_experts: int,
           real: Array, wanted: Array | None = None) -> dict:
  """``wanted``: [S, k] the choices that asked for a slot (default: all k of
  every real token); usage and drops are shares of them."""
  n_real = jnp.maximum(jnp.sum(real), 1.0)
  k = routes.expert.shape[1]
  n_wanted = (k * n_real if wanted is None
              else jnp.maximum(jnp.sum(wanted * real[:, None]), 1.0))
  processed = jnp.sum(jax.nn.one_hot(routes.expert, num_experts)
                      * routes.keep[..., None], axis=(0, 1))      # [E]
  out = {
      "expert_usage": processed / n_wanted,
      "dropped_fraction": 1.0 - jnp.sum(processed) / n_wanted,
  }
  if probs is not None:
    top = jnp.max(probs, axis=-1)
    ent = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
    out["router_confidence"] = jnp.sum(top * real) / n_real
    out["router_entropy"] = jnp.sum(ent * real) / n_real
  return out


def _single_choice(expert: Array, gate: Array, real: Array, num_experts: int,
                   capacity: int) -> Routes:
  """Routes of a top-1 assignment ``expert [S]`` filled in token order."""
  choice = jax.nn.one_hot(expert, num_experts) * real[:, None]
  keep, slot, _ = _slots(choice, jnp.zeros((num_experts,), jnp.float32),
                         capacity)
  return Routes(expert[:, None].astype(jnp.int32), slot[:, None],
                gate[:, None], keep[:, None])


def load_balancing_loss(probs: Array, top1: Array, real: Array) -> Array:
  """Switch's ``E * sum_e f_e P_e`` over the real tokens.

  ``f_e`` (fraction of tokens whose first choice is e) is not differentiable;
  the gradient flows through ``P_e`` (mean probability of e), pushing it down
  where the load is high.
  """
  n_real = jnp.maximum(jnp.sum(real), 1.0)
  e = probs.shape[-1]
  f = jnp.sum(top1 * real[:, None], axis=0) / n_real
  p = jnp.sum(probs * real[:, None], axis=0) / n_real
  return e * jnp.sum(f * p)


def router_z_loss(logits: Array, real: Array) -> Array:
  """ST-MoE's ``mean(logsumexp(logits)^2)`` over the real tokens."""
  z = jax.nn.logsumexp(logits, axis=-1)
  return jnp.sum(z * z * real) / jnp.maximum(jnp.sum(real), 1.0)


def top_k_route(logits: Array, *, k: int, capacity: int,
                mask: Array | None = None, normalize_gates: bool = True,
                priority: str = "choice", second_draw: Array | None = None):
  """Top-k routing with capacity (GShard for k=2).

  Args:
    logits: [S, E] router logits of one group.
    k: experts per token.
    capacity: slots per expert.
    mask: [S] bool, False for padding (never routed).
    normalize_gates: divide the k gates by their sum (GShard); Switch keeps
      the raw probability.
    priority: 'choice' (GShard): the i-th choices of all tokens fill the
      slots before any (i+1)-th choice, so a token's second choice may be
      dropped because of a LATER token's first choice (not causal);
      'token': all choices of token s before those of token s+1 (causal).
      Identical for k = 1.
    second_draw: [S] uniform(0, 1) draws for GShard's random routing (k = 2,
      normalised gates): token s asks for its second expert only where
      ``2 * g2 > draw``, i.e. with probability 2 g2 <= 1, so a second choice
      with a small gate mostly frees its slot. None: every second choice asks.
  Returns:
    (``Routes`` [S, k], aux). A second choice that was not drawn is not kept
    and counts as neither used nor dropped in the statistics.
  """
  if priority not in ("choice", "token"):
    raise ValueError(f"top_k_route: priority={priority!r}, expected 'choice' "
                     "or 'token'.")
  if second_draw is not None and (k != 2 or not normalize_gates):
    raise ValueError(
        f"top_k_route: second_draw (GShard's random routing) needs k=2 with "
        f"normalize_gates=True, got k={k}, normalize_gates={normalize_gates}.")
  s, e = logits.shape
  logits = logits.astype(jnp.float32)
  real = _real(mask, s)
  probs = jax.nn.softmax(logits, axis=-1)
  gates, experts = jax.lax.top_k(probs, k)                        # [S, k]
  if normalize_gates and k > 1:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  wanted = None
  if second_draw is not None:
    wanted = jnp.stack([jnp.ones((s,), jnp.float32),
                        (2.0 * gates[:, 1] > second_draw).astype(jnp.float32)],
                       axis=-1)                                   # [S, 2]
  choice = jax.nn.one_hot(experts, e) * real[:, None, None]       # [S, k, E]
  if wanted is not None:
    choice = choice * wanted[..., None]
  if priority == "choice":
    choice = jnp.swapaxes(choice, 0, 1)                           # [k, S, E]
  keep, slot, _ = _slots(choice.reshape(-1, e), jnp.zeros((e,), jnp.float32),
                         capacity)
  keep, slot = keep.reshape(choice.shape[:2]), slot.reshape(choice.shape[:2])
  if priority == "choice":
    keep, slot = keep.T, slot.T                                   # [S, k]
  routes = Routes(experts.astype(jnp.int32), slot, gates, keep)
  top1 = jax.nn.one_hot(experts[:, 0], e)
  aux = {"load_balancing_loss": load_balancing_loss(probs, top1, real),
         "z_loss": router_z_loss(logits, real)}
  aux.update(_stats(probs, routes, e, real, wanted))
  return routes, aux


def switch_route(logits: Array, *, capacity: int, mask: Array | None = None):
  """Switch Transformer top-1 routing; gate = the chosen probability.

  Jitter noise (Switch's multiplicative noise on the router input) is applied
  by the layer before the router projection, as it acts on tokens.
  """
  return top_k_route(logits, k=1, capacity=capacity, mask=mask,
                     normalize_gates=False)


def balanced_assignment(scores: Array, *, epsilon: float | None = None,
                        max_iters: int = 1000,
                        scaling: float = 8.0) -> Array:
  """Expert of each token, every expert getting exactly ``S / E`` tokens.

  Solves max sum_s scores[s, a(s)] subject to |a^-1(e)| = S / E by
  Bertsekas' auction for similar objects (each expert is S/E identical
  slots): unassigned tokens bid for their best expert net of its price; an
  expert keeps its S/E highest bids and its price becomes the lowest bid it
  keeps. The result is within ``S * epsilon`` of the optimum.

  Epsilon scaling (Bertsekas & Castanon): the auction first runs with a bid
  increment near the score range, which settles the prices coarsely in a few
  rounds, then again from those prices with the increment divided by
  ``scaling`` each time until it reaches ``epsilon``; a phase starts with
  every token unassigned. The total number of rounds drops from about
  range / epsilon to a few per phase. Each round ranks the bids of all
  experts at once (all pairs of tokens compared, or one sort of the S tokens
  by expert and bid for long groups).

  Tokens still unassigned after ``max_iters`` rounds (over all phases) fill
  the free slots in token order (the exact balancing step), so the loads are
  always exactly equal.

  Args:
    scores: [S, E] (e.g. router logits); S must be a multiple of E.
    epsilon: final bid increment; default 1e-3 * (score range), at least
      1e-6.
    max_iters: auction rounds (all phases) before the balancing step.
    scaling: the increment's divisor between phases (> 1).
  Returns:
    [S] int32 expert index.
  """
  owner, _ = _auction(scores, epsilon, max_iters, scaling)
  return _fill_free_slots(owner, scores.shape[1])


def _auction(scores, epsilon, max_iters, scaling):
  """The auction of ``balanced_assignment``: ([S] owner or -1, rounds)."""
  s, e = scores.shape
  if s % e:
    raise ValueError(
        f"balanced_assignment: {s} tokens cannot be split equally over {e} "
        "experts; use a group size that is a multiple of the expert count.")
  if scaling <= 1:
    raise ValueError(f"balanced_assignment: scaling={scaling} must be > 1 "
                     "(the bid increment's divisor between phases).")
  cap = s // e
  scores = jax.lax.stop_gradient(scores).astype(jnp.float32)
  if e == 1:
    return jnp.zeros((s,), jnp.int32), jnp.int32(0)
  spread = jnp.max(scores) - jnp.min(scores)
  if epsilon is None:
    eps = jnp.maximum(1e-3 * spread, 1e-6)
  else:
    eps = jnp.float32(epsilon)

  def cond(state):
    owner, _, _, _, it = state
    return jnp.logical_and(jnp.any(owner < 0), it < max_iters)

  def body(state):
    owner, bid, price, step, it = state
    value = scores - price[None, :]                                # [S, E]
    # Best and second-best net values by reductions (top_k lowers to a sort
    # per token on CPU, which dominated the round).
    best = jnp.argmax(value, axis=1).astype(jnp.int32)
    first = jnp.max(value, axis=1)
    second = jnp.max(jnp.where(jnp.arange(e) == best[:, None], -jnp.inf,
                               value), axis=1)
    bidding = owner < 0
    # Every token holds one candidate: a new bid for its best expert, or
    # the bid with which it holds its current expert.
    target = jnp.where(bidding, best, owner)
    offer = jnp.where(bidding, price[best] + first - second + step, bid)
    keep = _rank_within_expert(target, offer, e) < cap
    owner = jnp.where(keep, target, -1).astype(jnp.int32)
    bid = jnp.where(keep, offer, 0.0)
    # A full expert's price is the lowest bid it keeps.
    held = keep[:, None] & (target[:, None] == jnp.arange(e))       # [S, E]
    count = jnp.sum(held, axis=0)
    lowest = jnp.min(jnp.where(held, offer[:, None], jnp.inf), axis=0)
    price = jnp.where(count == cap, lowest, price)
    # Phase end: all assigned with a coarse increment -> refine and restart.
    refine = jnp.logical_and(jnp.all(owner >= 0), step > eps)
    owner = jnp.where(refine, -1, owner)
    step = jnp.where(refine, jnp.maximum(step / scaling, eps), step)
    return owner, bid, price, step, it + 1

  start = jnp.maximum(spread / scaling, eps)
  init = (jnp.full((s,), -1, jnp.int32), jnp.zeros((s,), jnp.float32),
          jnp.zeros((e,), jnp.float32), start, jnp.int32(0))
  owner, _, _, _, rounds = jax.lax.while_loop(cond, body, init)
  return owner, rounds


# Below this many tokens per group, bids are ranked by comparing all pairs
# ([S, S] elementwise work); above it, by one sort (XLA's CPU sort costs a
# comparator call per comparison, ~0.5 ms per round for 16 x 128 tokens).
_PAIRWISE_RANK_MAX_TOKENS = 512


def _rank_within_expert(target: Array, offer: Array, e: int) -> Array:
  """[S] rank of each token's offer among the offers made to its expert
  (0 = highest; ties go to the earlier token)."""
  s = target.shape[0]
  tokens = jnp.arange(s, dtype=jnp.int32)
  if s <= _PAIRWISE_RANK_MAX_TOKENS:
    ahead = (offer[None, :] > offer[:, None]) | (
        (offer[None, :] == offer[:, None]) & (tokens[None, :] < tokens[:, None]))
    return jnp.sum(ahead & (target[None, :] == target[:, None]), axis=1,
                   dtype=jnp.int32)
  sorted_target, _, order = jax.lax.sort((target, -offer, tokens), num_keys=2)
  # "compare_all": the default scan is a loop of kernels on a GPU (the
  # accelerator kit's profile of the sMLP step); [S, E] compares are not.
  starts = jnp.searchsorted(sorted_target, jnp.arange(e, dtype=jnp.int32),
                            method="compare_all")
  rank = tokens - starts[sorted_target]
  return jnp.zeros((s,), jnp.int32).at[order].set(rank)


def _fill_free_slots(owner: Array, e: int) -> Array:
  cap = owner.shape[0] // e
  # Exact balancing of whatever the auction left: the j-th unassigned token
  # takes the j-th free slot (free slots listed expert by expert).
  free = cap - jnp.sum(jax.nn.one_hot(owner, e, dtype=jnp.int32), axis=0)
  left = owner < 0
  j = jnp.cumsum(left) - 1
  fill = jnp.searchsorted(jnp.cumsum(free), j, side="right",
                          method="compare_all").astype(jnp.int32)
  return jnp.where(left, fill, owner)


def base_route(logits: Array, *, train: bool, capacity: int | None = None,
               mask: Array | None = None, epsilon: float | None = None,
               max_iters: int = 1000):
  """Base Layers routing; gate = sigmoid(logit of the chosen expert).

  Training: ``balanced_assignment`` of all S tokens (padding included, so the
  loads stay exactly S / E; padding slots are then left empty). Padding
  scores 0 for every expert: indifferent, it takes the slots the real tokens
  leave, so the real tokens get the best assignment with at most S / E of
  them per expert, whatever the router makes of the padding. Inference:
  greedy top-1 with ``capacity`` slots in token order, filled by the real
  tokens only.
  """
  s, e = logits.shape
  logits = logits.astype(jnp.float32)
  real = _real(mask, s)
  if train:
    capacity = s // e
    expert = balanced_assignment(jnp.where(real[:, None] > 0, logits, 0.0),
                                 epsilon=epsilon, max_iters=max_iters)
  else:
    if capacity is None:
      raise ValueError("base_route: inference routing needs a capacity.")
    expert = jnp.argmax(logits, axis=-1)
  gate = jax.nn.sigmoid(jnp.take_along_axis(logits, expert[:, None], -1))[:, 0]
  # Padding takes its slot in training (the loads stay exactly S / E), then
  # is left out; at inference it takes none.
  routes = _single_choice(expert, gate,
                          jnp.ones((s,), jnp.float32) if train else real, e,
                          capacity)
  routes = routes._replace(keep=routes.keep & (real[:, None] > 0))
  return routes, _stats(jax.nn.softmax(logits, -1), routes, e, real)


def make_hash_table(vocab_size: int, num_experts: int, seed: int = 0
                    ) -> np.ndarray:
  """Fixed random token-id -> expert table, each expert ~vocab/E ids."""
  rng = np.random.RandomState(seed)
  return (rng.permutation(vocab_size) % num_experts).astype(np.int32)


def hash_route(token_ids: Array, *, table: Array, num_experts: int,
               capacity: int, mask: Array | None = None):
  """Hash Layers routing: expert ``table[token_id]``, gate 1, token order."""
  s = token_ids.shape[0]
  real = _real(mask, s)
  expert = jnp.asarray(table)[token_ids]
  routes = _single_choice(expert, jnp.ones((s,), jnp.float32), real,
                          num_experts, capacity)
  return routes, _stats(None, routes, num_experts, real)
