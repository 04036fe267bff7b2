"""Token-routed MoE Transformer LM (``smlp`` family, ``token_mixer='attention'``).

Checked against an independent NumPy forward pass (float64, per-token
routing written out, packed rows run as separate sequences), for causality
by Jacobian (d logits[t] / d input[s] = 0 for s > t) and by token flips
(discrete routing), and expert-parallel == single device.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax import models
from hypermixer_jax.models import smlp
from hypermixer_jax.models.moe import routers

COLLECTIONS = ["aux_loss", "moe_metrics"]
ROUTERS = ("switch", "gshard", "base", "hash")
RULES = [("batch", ("data", "fsdp")), ("expert", "expert"), ("vocab", None),
         ("embed", None), ("mlp", None), ("heads", None), ("kv", None),
         ("norm", None), ("length", None)]


def _config(router, **moe):
  # Distinct sizes (d=12, d_ffn=28, 3 experts, 2 heads of 6, vocab 37, N=11)
  # so that a transposed axis cannot pass.
  cfg = smlp.smlp_config("tiny")
  cfg.update(dict(token_mixer="attention", num_heads=2, d_model=12, d_ffn=28,
                  vocab_size=37, max_len=11))
  cfg.moe.update(dict(num_experts=3, expert_d_ffn=28, tmoe_router=router,
                      **moe))
  return cfg


# ---------------------------------------------------------------------------
# NumPy reference (float64).
# ---------------------------------------------------------------------------
def _ln(x, p):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + 1e-6) * p["ln"]["scale"] + p["ln"]["bias"]


def _gelu(x):
  return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _attention(x, p):
  """Causal multi-head attention of one sequence ``x [n, d]``."""
  n = x.shape[0]
  proj = {k: np.einsum("nd,dhk->nhk", x, p[k]["kernel"]) + p[k]["bias"]
          for k in ("query", "key", "value")}
  dh = proj["query"].shape[-1]
  out = np.zeros_like(proj["value"])
  for h in range(proj["query"].shape[1]):
    for t in range(n):
      s = proj["key"][: t + 1, h] @ proj["query"][t, h] / math.sqrt(dh)
      w = np.exp(s - s.max())
      out[t, h] = (w / w.sum()) @ proj["value"][: t + 1, h]
  return np.einsum("nhk,hkd->nd", out, p["out"]["kernel"]) + p["out"]["bias"]


def _ffn(x, wi, bi, wo, bo):
  return _gelu(x @ wi + bi) @ wo + bo


def _moe(x, ids, p, router, num_experts, vocab):
  """Token by token: the chosen experts' outputs times their gates."""
  y = np.zeros_like(x)
  for t in range(x.shape[0]):
    if router == "hash":
      chosen = {int(routers.make_hash_table(vocab, num_experts)[ids[t]]): 1.0}
    else:
      logits = x[t] @ p["router"]["dense"]["kernel"]
      probs = np.exp(logits - logits.max())
      probs /= probs.sum()
      order = np.argsort(-logits)
      if router == "switch":
        chosen = {int(order[0]): probs[order[0]]}
      elif router == "gshard":
        top = probs[order[:2]]
        chosen = dict(zip(map(int, order[:2]), top / top.sum()))
      else:  # base, inference: greedy top-1, gate sigmoid(logit)
        chosen = {int(order[0]): 1.0 / (1.0 + np.exp(-logits[order[0]]))}
    for e, g in chosen.items():
      y[t] += g * _ffn(x[t], p["wi"][e], p["bi"][e], p["wo"][e], p["bo"][e])
  return y


def _reference(params, ids, cfg):
  """Logits ``[n, vocab]`` of one sequence ``ids [n]`` (positions 0..n-1)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), nn.unbox(params))
  n, d = len(ids), cfg.d_model
  half = d // 2
  angles = np.arange(n)[:, None] * np.exp(
      -math.log(10000.0) * np.arange(half) / half)[None]
  x = p["embed"]["embedding"][ids] + np.concatenate(
      [np.sin(angles), np.cos(angles)], -1)
  sparse = smlp.sparse_layer_indices(cfg.num_dense_layers,
                                     cfg.num_sparse_layers)
  for i in range(cfg.num_dense_layers + cfg.num_sparse_layers):
    lp = p[f"layer_{i}"]
    if i in sparse:
      x = x + _attention(_ln(x, lp["mixing_norm"]), lp["attention"])
      x = x + _moe(_ln(x, lp["ffn_norm"]), ids, lp["tmoe"],
                   cfg.moe.tmoe_router, cfg.moe.num_experts, cfg.vocab_size)
    else:
      x = x + _attention(_ln(x, lp["mixing_norm"]), lp["token_mixing"])
      f = lp["feature_mixing"]
      x = x + _ffn(_ln(x, lp["ffn_norm"]), f["wi"]["dense"]["kernel"],
                   f["wi"]["dense"]["bias"], f["wo"]["dense"]["kernel"],
                   f["wo"]["dense"]["bias"])
  x = _ln(x, p["final_norm"])
  return x @ p["embed"]["embedding"].T / math.sqrt(d)


@pytest.mark.parametrize("router", ROUTERS)
def test_matches_numpy_reference_on_packed_rows(router):
  # Capacity for every token (cf = E): the reference drops nothing either.
  cfg = _config(router, eval_capacity_factor=3.0)
  cfg.num_dense_layers = 1
  cfg.num_sparse_layers = 2          # layers: sparse, dense, sparse
  model = models.build_model(cfg)
  rng = np.random.RandomState(7)
  # Row 0: one sequence of 11; row 1: two packed examples (4 + 7 tokens).
  ids = rng.randint(1, cfg.vocab_size, size=(2, 11)).astype(np.int32)
  segs = np.array([[1] * 11, [1] * 4 + [2] * 7], np.int32)
  pos = np.array([list(range(11)), list(range(4)) + list(range(7))], np.int32)
  params = model.init(jax.random.key(0), jnp.asarray(ids))["params"]
  logits, _ = jax.jit(lambda p: model.apply(
      {"params": p}, jnp.asarray(ids), segment_ids=jnp.asarray(segs),
      positions=jnp.asarray(pos), mutable=COLLECTIONS))(params)
  want = [_reference(params, ids[0], cfg),
          np.concatenate([_reference(params, ids[1, :4], cfg),
                          _reference(params, ids[1, 4:], cfg)])]
  np.testing.assert_allclose(np.asarray(logits), np.stack(want), rtol=2e-4,
                             atol=2e-4)


@pytest.mark.parametrize("router,deterministic", [
    ("switch", False), ("switch", True), ("gshard", False), ("gshard", True),
    ("hash", False), ("base", True)])
def test_causal_by_jacobian_and_token_flips(router, deterministic):
  # Tight capacities, so that drops (which depend on earlier tokens only)
  # happen too. Base Layers in training is the documented exception: its
  # balanced assignment reads the whole sequence. The sparse layer alone
  # (causal attention, then the routed experts): a dense layer's attention
  # would double the compiles and route nothing.
  cfg = _config(router, capacity_factor=0.7, eval_capacity_factor=0.7)
  cfg.num_dense_layers = 0
  model = models.build_model(cfg)
  n, vocab, d = cfg.max_len, cfg.vocab_size, cfg.d_model
  ids = jax.random.randint(jax.random.key(1), (1, n), 0, vocab)
  params = model.init(jax.random.key(2), ids)["params"]

  def logits_of(eps, x):
    out, _ = model.apply({"params": params, "perturbations": {"embedded": eps}},
                         x, deterministic=deterministic, mutable=COLLECTIONS,
                         rngs={"dropout": jax.random.key(3)})
    return out

  jac = jax.jit(jax.jacfwd(logits_of))(jnp.zeros((1, n, d)), ids)
  jac = np.abs(np.asarray(jac))[0, :, :, 0].sum(axis=(1, 3))  # [t, s]
  later = np.triu(np.ones((n, n), bool), k=1)
  assert jac[later].max() == 0.0
  assert (np.diag(jac) > 0).all() and jac[n - 1, 0] > 0

  # Discrete routing (hash ids, top-k choices, slots): flip token k.
  rows = jnp.tile(ids, (n + 1, 1))
  rows = rows.at[jnp.arange(n), jnp.arange(n)].set((ids[0] + 17) % vocab)
  out = np.asarray(jax.jit(logits_of)(jnp.zeros((n + 1, n, d)), rows))
  for k in range(n):
    np.testing.assert_allclose(out[k, :k], out[n, :k], rtol=0, atol=1e-6,
                               err_msg=f"token {k} leaks")


def test_base_layers_training_assignment_reads_later_tokens():
  # The documented caveat, shown: in training, Base Layers' balanced
  # assignment of a row moves an early token to another expert when later
  # tokens change (here: the last half of the row).
  cfg = _config("base")
  cfg.update(dict(num_dense_layers=0, num_sparse_layers=1, max_len=12))
  model = models.build_model(cfg)
  n, vocab = cfg.max_len, cfg.vocab_size
  ids = jax.random.randint(jax.random.key(4), (1, n), 0, vocab)
  params = model.init(jax.random.key(5), ids)["params"]
  fwd = jax.jit(lambda x: model.apply({"params": params}, x,
                                      deterministic=False,
                                      mutable=COLLECTIONS)[0])
  leaks = 0
  for seed in range(8):
    other = ids.at[0, n // 2:].set(jax.random.randint(
        jax.random.key(10 + seed), (n - n // 2,), 0, vocab))
    diff = np.abs(np.asarray(fwd(ids) - fwd(other)))[0, : n // 2].max()
    leaks += diff > 1e-5
  assert leaks > 0


def test_expert_parallel_equals_single_device():
  cfg = _config("switch", capacity_factor=0.9)
  cfg.moe.num_experts = 4            # divisible by the expert axis
  cfg.num_dense_layers = 0           # the sparse layer is what is split
  model = models.build_model(cfg)
  x = jax.random.randint(jax.random.key(6), (8, cfg.max_len), 0,
                         cfg.vocab_size)
  params = model.init(jax.random.key(7), x)["params"]
  fwd = jax.jit(lambda p, x: model.apply({"params": p}, x,
                                         deterministic=False,
                                         mutable=COLLECTIONS))
  y0, m0 = fwd(params, x)
  mesh = jax.make_mesh((2, 1, 1, 4), ("data", "fsdp", "tensor", "expert"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    y1, m1 = fwd(params, x)
    hlo = fwd.lower(params, x).compile().as_text()
  assert hlo.count("all-to-all") >= 2
  np.testing.assert_allclose(y0, y1, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6), m0, m1)


def test_config_fields_and_errors():
  cfg = _config("hash")
  facts = models.model_facts(cfg)
  assert facts == models.ModelFacts(head="causal_lm")
  # Partial sMoE routing means nothing without sMoE: no routing prefix.
  cfg.moe.smoe_routing = "partial"
  assert models.model_facts(cfg).loss_start == 0
  assert models.model_facts(dict(cfg.to_dict(), token_mixer="gmlp")
                            ).loss_start == 2
  with pytest.raises(ValueError, match=r"model.token_mixer='attn' is not a "
                     r"registered token mixer"):
    models.build_model(dict(cfg.to_dict(), token_mixer="attn"))
  with pytest.raises(ValueError, match="num_heads=5 does not divide"):
    model = models.build_model(dict(cfg.to_dict(), num_heads=5))
    model.init(jax.random.key(0), jnp.zeros((1, 11), jnp.int32))
