"""Routers against hand-computed examples and NumPy loops."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from hypermixer_jax.models.moe import routers


def _softmax(x):
  x = x - x.max(-1, keepdims=True)
  return np.exp(x) / np.exp(x).sum(-1, keepdims=True)


def _np_top_k(logits, k, cap, mask, normalize, priority="choice", draw=None):
  """Reference: a loop over choices and tokens in slot-priority order
  (``draw``: GShard's random routing, second choice asked where 2 g2 > u)."""
  s, e = logits.shape
  probs = _softmax(logits.astype(np.float64))
  order = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
  gates = np.take_along_axis(probs, order, -1)
  if normalize and k > 1:
    gates = gates / gates.sum(-1, keepdims=True)
  count = np.zeros(e, int)
  dispatch = np.zeros((s, e, cap))
  combine = np.zeros((s, e, cap))
  pairs = [(i, t) for i in range(k) for t in range(s)]
  if priority == "token":
    pairs = sorted(pairs, key=lambda it: (it[1], it[0]))
  for i, t in pairs:
    if not mask[t] or (draw is not None and i == 1
                       and not 2 * gates[t, 1] > draw[t]):
      continue
    ex = order[t, i]
    if count[ex] < cap:
      dispatch[t, ex, count[ex]] = 1
      combine[t, ex, count[ex]] = gates[t, i]
    count[ex] += 1
  return dispatch, combine


# The routers as single programs: op by op, each of their operations would
# be compiled on its own.
_dense_jit = jax.jit(routers.dense, static_argnums=(1, 2))
_switch_route = jax.jit(routers.switch_route, static_argnames="capacity")
_balanced_assignment = jax.jit(
    routers.balanced_assignment,
    static_argnames=("epsilon", "max_iters", "scaling"))


def _dense(routed, capacity):
  """A router's (routes, aux) as GShard's (dispatch, combine, aux)."""
  routes, aux = routed
  return (*_dense_jit(routes, aux["expert_usage"].shape[-1], capacity), aux)


def test_switch_load_balancing_loss_hand_example():
  probs = np.array([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]])
  logits = jnp.asarray(np.log(probs), jnp.float32)
  _, aux = _switch_route(logits, capacity=4)
  # f = (3/4, 1/4), P = (0.6, 0.4): 2 * (0.75 * 0.6 + 0.25 * 0.4) = 1.1.
  np.testing.assert_allclose(aux["load_balancing_loss"], 1.1, rtol=1e-6)
  # The padding token 3 is not counted: f = (2/3, 1/3), P = (0.5, 0.5).
  mask = jnp.array([True, True, True, False])
  _, aux = _switch_route(logits, capacity=4, mask=mask)
  np.testing.assert_allclose(aux["load_balancing_loss"], 1.0, rtol=1e-6)
  # z-loss: logsumexp(log p) = 0 for every token.
  np.testing.assert_allclose(aux["z_loss"], 0.0, atol=1e-6)
  np.testing.assert_allclose(aux["router_confidence"], (0.7 + 0.6 + 0.8) / 3,
                             rtol=1e-6)


def test_load_balancing_loss_is_differentiable_and_z_loss_formula():
  logits = jax.random.normal(jax.random.key(0), (7, 3)) * 2
  real = jnp.ones((7,))

  def lb(l):
    p = jax.nn.softmax(l)
    return routers.load_balancing_loss(p, jax.nn.one_hot(jnp.argmax(l, -1), 3),
                                       real)
  g = jax.jit(jax.grad(lb))(logits)
  assert float(jnp.abs(g).sum()) > 0
  z = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
  np.testing.assert_allclose(jax.jit(routers.router_z_loss)(logits, real),
                             np.mean(z ** 2), rtol=1e-5)


def test_capacity_and_dropped_fraction_constructed_batch():
  # First choices: 0, 0, 0, 1, 0(padding), 1; capacity 2.
  first = np.array([0, 0, 0, 1, 0, 1])
  logits = jnp.asarray(np.eye(2)[first] * 3.0, jnp.float32)
  mask = jnp.array([1, 1, 1, 1, 0, 1], bool)
  assert routers.expert_capacity(6, 2, 1.25) == 4
  assert routers.expert_capacity(6, 2, 1.0, k=2) == 6
  dispatch, combine, aux = _dense(_switch_route(logits, capacity=2,
                                                mask=mask), 2)
  want = np.zeros((6, 2, 2))
  want[0, 0, 0] = want[1, 0, 1] = want[3, 1, 0] = want[5, 1, 1] = 1
  np.testing.assert_array_equal(dispatch, want)        # token 2 dropped
  p = 1 / (1 + np.exp(-3.0))
  np.testing.assert_allclose(combine, want * p, rtol=1e-6)
  np.testing.assert_allclose(aux["dropped_fraction"], 1 / 5, rtol=1e-6)
  np.testing.assert_allclose(aux["expert_usage"], [2 / 5, 2 / 5], rtol=1e-6)


@pytest.mark.parametrize("k,normalize,priority", [
    (1, False, "choice"), (2, True, "choice"), (2, True, "token"),
    (3, False, "token")])
def test_top_k_route_matches_numpy_loop(k, normalize, priority):
  rng = np.random.RandomState(k)
  s, e, cap = 13, 5, 3
  logits = rng.randn(s, e).astype(np.float32)
  mask = rng.rand(s) > 0.2
  routes, aux = jax.jit(
      lambda l, m: routers.top_k_route(
          l, k=k, capacity=cap, mask=m, normalize_gates=normalize,
          priority=priority))(logits, mask)
  dispatch, combine = _dense_jit(routes, e, cap)
  want_d, want_c = _np_top_k(logits, k, cap, mask, normalize, priority)
  np.testing.assert_array_equal(dispatch, want_d)
  np.testing.assert_allclose(combine, want_c, rtol=1e-5, atol=1e-7)
  # Moving tokens by index: the slots and the gated sum of the NumPy loop.
  x = rng.randn(s, 2, 7).astype(np.float32)
  xe = jax.jit(routers.gather_slots, static_argnums=(2, 3))(x, routes, e, cap)
  np.testing.assert_array_equal(xe, np.einsum("sec,sab->ecab", want_d, x))
  ye = rng.randn(e, cap, 2, 7).astype(np.float32)
  np.testing.assert_allclose(jax.jit(routers.combine_slots)(ye, routes),
                             np.einsum("sec,ecab->sab", want_c, ye),
                             rtol=1e-5, atol=1e-6)
  kept = want_d.sum()
  np.testing.assert_allclose(aux["dropped_fraction"],
                             1 - kept / (k * mask.sum()), rtol=1e-5)
  # Every slot holds at most one token, a token at most one slot per expert.
  assert want_d.sum(0).max() <= 1 and want_d.sum(2).max() <= 1


@pytest.mark.parametrize("priority", ["choice", "token"])
def test_gshard_random_routing_matches_numpy_loop(priority):
  rng = np.random.RandomState(7)
  s, e, cap = 17, 4, 5
  logits = (rng.randn(s, e) * 1.5).astype(np.float32)
  mask = rng.rand(s) > 0.15
  draw = rng.rand(s).astype(np.float32)
  routes, aux = jax.jit(
      lambda l, m, u: routers.top_k_route(
          l, k=2, capacity=cap, mask=m, priority=priority,
          second_draw=u))(logits, mask, draw)
  dispatch, combine = _dense_jit(routes, e, cap)
  want_d, want_c = _np_top_k(logits, 2, cap, mask, True, priority, draw)
  np.testing.assert_array_equal(dispatch, want_d)
  np.testing.assert_allclose(combine, want_c, rtol=1e-5, atol=1e-7)
  # Some second choices were not drawn (else the case tests nothing); they
  # count as neither used nor dropped.
  probs = _softmax(logits.astype(np.float64))
  top2 = np.sort(probs, -1)[:, ::-1][:, :2]
  asked = mask & (2 * top2[:, 1] / top2.sum(-1) > draw)
  assert 0 < asked.sum() < mask.sum()
  wanted = mask.sum() + asked.sum()
  np.testing.assert_allclose(aux["dropped_fraction"],
                             1 - want_d.sum() / wanted, rtol=1e-5)
  np.testing.assert_allclose(aux["expert_usage"],
                             want_d.sum((0, 2)) / wanted, rtol=1e-5)


def test_gshard_random_routing_asks_with_probability_twice_the_gate():
  # A token whose normalised second gate is g2 asks for its second expert
  # with probability 2 g2: over 4,000 draws, within 4.5 binomial SEs.
  g2 = np.array([0.05, 0.2, 0.35, 0.5 - 1e-4])
  logits = np.log(np.stack([1 - g2, g2, np.full_like(g2, 1e-9)], -1))
  n = 4000
  draws = jax.random.uniform(jax.random.key(0), (n, len(g2)))
  route = jax.jit(jax.vmap(lambda u: routers.top_k_route(
      jnp.asarray(logits, jnp.float32), k=2, capacity=8, second_draw=u)[0]))
  rate = np.asarray(route(draws).keep[:, :, 1]).mean(0)
  se = np.sqrt(2 * g2 * (1 - 2 * g2) / n) + 1e-3
  np.testing.assert_array_less(np.abs(rate - 2 * g2), 4.5 * se)
  with pytest.raises(ValueError, match="k=2 with normalize_gates=True"):
    routers.top_k_route(jnp.zeros((4, 3)), k=1, capacity=4,
                        second_draw=jnp.zeros((4,)))


@pytest.mark.parametrize("s,e", [(12, 3), (40, 4), (64, 8), (640, 8)])
def test_balanced_assignment_exact_loads_and_optimal(s, e):
  rng = np.random.RandomState(s)
  scores = rng.randn(s, e).astype(np.float32)
  scores[:, 0] += 2.0              # most tokens prefer expert 0
  eps = 1e-4
  got = np.asarray(jax.jit(lambda x: routers.balanced_assignment(
      x, epsilon=eps, max_iters=100_000))(scores))
  np.testing.assert_array_equal(np.bincount(got, minlength=e), [s // e] * e)
  # The optimum of the same problem by the Hungarian method (SciPy): each
  # expert replicated into S/E slots.
  rows, cols = linear_sum_assignment(-np.repeat(scores, s // e, axis=1))
  opt = np.repeat(scores, s // e, axis=1)[rows, cols].sum()
  total = scores[np.arange(s), got].sum()
  assert opt - s * eps - 1e-3 <= total <= opt + 1e-3


@pytest.mark.parametrize("s", [50, 600])   # pairwise and sorting paths
def test_rank_within_expert_matches_numpy(s):
  rng = np.random.RandomState(s)
  target = rng.randint(0, 5, s).astype(np.int32)
  offer = rng.randint(0, 7, s).astype(np.float32)     # many exact ties
  got = np.asarray(jax.jit(lambda t, o: routers._rank_within_expert(t, o, 5))(
      target, offer))
  want = [sum(1 for j in range(s) if target[j] == target[i] and (
      offer[j] > offer[i] or (offer[j] == offer[i] and j < i)))
          for i in range(s)]
  np.testing.assert_array_equal(got, want)


def test_balanced_assignment_scaling_phases_reach_the_same_optimum():
  # Epsilon scaling must not change the answer's quality: the optimum of
  # every phase schedule is within S * eps of the Hungarian one.
  rng = np.random.RandomState(5)
  scores = (rng.randn(48, 6) * 3).astype(np.float32)
  rows, cols = linear_sum_assignment(-np.repeat(scores, 8, axis=1))
  opt = np.repeat(scores, 8, axis=1)[rows, cols].sum()
  for scaling in (2.0, 8.0, 1e6):
    got = np.asarray(_balanced_assignment(
        jnp.asarray(scores), epsilon=1e-4, max_iters=100_000,
        scaling=scaling))
    np.testing.assert_array_equal(np.bincount(got, minlength=6), [8] * 6)
    assert scores[np.arange(48), got].sum() >= opt - 48 * 1e-4 - 1e-3
  with pytest.raises(ValueError, match="scaling=1.0 must be > 1"):
    routers.balanced_assignment(jnp.asarray(scores), scaling=1.0)


def test_balanced_assignment_final_balancing_step():
  # No auction round at all: the balancing step alone must balance exactly.
  scores = jnp.asarray(np.random.RandomState(0).randn(12, 4), jnp.float32)
  got = np.asarray(_balanced_assignment(scores, max_iters=0))
  np.testing.assert_array_equal(got, np.repeat(np.arange(4), 3))
  # One round: the few leftovers are balanced too.
  got = np.asarray(_balanced_assignment(scores + 5 * jnp.eye(4)[0],
                                        max_iters=1))
  np.testing.assert_array_equal(np.bincount(got, minlength=4), [3] * 4)


def test_base_route_train_balanced_and_inference_greedy():
  rng = np.random.RandomState(3)
  logits = jnp.asarray(rng.randn(16, 4) + [3, 0, 0, 0], jnp.float32)
  dispatch, combine, aux = base_route_jit(logits, True)
  np.testing.assert_array_equal(np.asarray(dispatch).sum((0, 2)), [4] * 4)
  np.testing.assert_allclose(aux["expert_usage"], [0.25] * 4)
  np.testing.assert_allclose(aux["dropped_fraction"], 0.0, atol=1e-7)
  chosen = np.asarray(dispatch).sum(-1).argmax(-1)
  gate = 1 / (1 + np.exp(-np.asarray(logits)[np.arange(16), chosen]))
  np.testing.assert_allclose(np.asarray(combine).sum((1, 2)), gate, rtol=1e-6)
  # Inference: the argmax expert, first come first served up to capacity 6.
  dispatch, _, aux = base_route_jit(logits, False)
  argmax = np.asarray(logits).argmax(-1)
  want = np.zeros((16, 4, 6))
  count = np.zeros(4, int)
  for t, ex in enumerate(argmax):
    if count[ex] < 6:
      want[t, ex, count[ex]] = 1
    count[ex] += 1
  np.testing.assert_array_equal(dispatch, want)


def test_base_route_padding_does_not_compete_in_training():
  # 8 real tokens that all prefer expert 0 and 8 padding tokens whose
  # logits (whatever the router makes of the pad embedding) prefer it even
  # more: the real tokens must still get the optimum of their own problem,
  # at most S / E = 4 of them per expert (Hungarian method, SciPy).
  rng = np.random.RandomState(11)
  s, e = 16, 4
  logits = rng.randn(s, e).astype(np.float32)
  logits[:, 0] += 2.0
  real = np.arange(s) % 2 == 0
  logits[~real, 0] += 20.0
  routes, _ = jax.jit(lambda l, m: routers.base_route(
      l, train=True, mask=m, epsilon=1e-5, max_iters=100_000))(
          jnp.asarray(logits), jnp.asarray(real))
  got = np.asarray(routes.expert[:, 0])
  assert not np.asarray(routes.keep)[~real].any()
  np.testing.assert_array_equal(np.bincount(got, minlength=e), [4] * e)
  sub = logits[real]
  rows, cols = linear_sum_assignment(-np.repeat(sub, s // e, axis=1))
  opt = np.repeat(sub, s // e, axis=1)[rows, cols].sum()
  total = sub[np.arange(len(sub)), got[real]].sum()
  np.testing.assert_allclose(total, opt, atol=s * 1e-5 + 1e-4)
  assert np.bincount(got[real], minlength=e)[0] == 4     # expert 0 full


@pytest.mark.parametrize("route", ["base", "switch", "hash"])
def test_padding_takes_no_slot_at_inference(route):
  """Every token picks expert 0, one slot per expert, token 0 is padding:
  the slot goes to the first real token (1), whatever the router."""
  mask = jnp.asarray([False, True, True, True])
  logits = jnp.asarray([[2.0, 0.0]] * 4, jnp.float32)
  if route == "base":
    routes, _ = routers.base_route(logits, train=False, capacity=1, mask=mask)
  elif route == "switch":
    routes, _ = _switch_route(logits, capacity=1, mask=mask)
  else:
    routes, _ = routers.hash_route(jnp.zeros((4,), jnp.int32),
                                   table=jnp.zeros((8,), jnp.int32),
                                   num_experts=2, capacity=1, mask=mask)
  np.testing.assert_array_equal(np.asarray(routes.keep).any(-1),
                                [False, True, False, False])


def base_route_jit(logits, train):
  cap = logits.shape[0] // logits.shape[1] if train else 6
  return _dense(jax.jit(lambda l: routers.base_route(
      l, train=train, capacity=6, epsilon=1e-4))(logits), cap)


def test_hash_route_table_and_dispatch():
  table = routers.make_hash_table(101, 4, seed=1)
  counts = np.bincount(table, minlength=4)
  assert counts.max() - counts.min() <= 1              # a balanced table
  np.testing.assert_array_equal(table, routers.make_hash_table(101, 4, 1))
  ids = np.random.RandomState(0).randint(0, 101, size=11)
  mask = np.ones(11, bool)
  mask[5] = False
  dispatch, combine, aux = _dense(jax.jit(functools.partial(
      routers.hash_route, num_experts=4, capacity=2))(
          jnp.asarray(ids), table=jnp.asarray(table),
          mask=jnp.asarray(mask)), 2)
  want = np.zeros((11, 4, 2))
  count = np.zeros(4, int)
  for t, i in enumerate(ids):
    if mask[t]:
      if count[table[i]] < 2:
        want[t, table[i], count[table[i]]] = 1
      count[table[i]] += 1
  np.testing.assert_array_equal(dispatch, want)
  np.testing.assert_array_equal(combine, want)
  np.testing.assert_allclose(aux["dropped_fraction"], 1 - want.sum() / 10,
                             rtol=1e-6)
