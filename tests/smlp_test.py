"""sMLP language model: causality, expert parallelism, a short training run."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax.models import smlp

COLLECTIONS = ["aux_loss", "moe_metrics"]
RULES = [("batch", ("data", "fsdp")), ("expert", "expert"), ("vocab", None),
         ("embed", None), ("mlp", None), ("seq_in", None), ("seq_out", None),
         ("norm", None), ("length", None)]


def _model(dense_layers=1, **kw):
  cfg = smlp.smlp_config("tiny")
  cfg.num_dense_layers = dense_layers
  cfg.moe.update(kw)
  return models.build_model(cfg), cfg


def test_configs():
  base = smlp.smlp_config("base")
  assert (base.d_model, base.d_ffn) == (1024, 4096)
  assert base.moe.tmoe_router == "base"
  assert (base.num_dense_layers, base.num_sparse_layers) == (12, 4)
  # The family owns its fields: nothing of the encoder families' config.
  for field in ("mixer", "block", "head", "num_layers", "num_classes",
                "position_embeddings", "mixer_kwargs"):
    assert field not in base, field
  assert models.model_facts(base) == models.ModelFacts(head="causal_lm")
  with pytest.raises(ValueError, match=r"fields \['num_classes'\] are not "
                     "fields of model family 'smlp'"):
    models.build_model(dict(base.to_dict(), num_classes=2))
  with pytest.raises(ValueError, match=r"unknown model.moe fields \['experts'\]"):
    models.build_model(dict(base.to_dict(), moe=dict(experts=2)))
  assert smlp.sparse_layer_indices(2, 2) == (1, 3)
  assert smlp.sparse_layer_indices(12, 4) == (3, 7, 11, 15)
  with pytest.raises(ValueError, match="size=.huge., expected .tiny. or .base."):
    smlp.smlp_config("huge")


@pytest.mark.parametrize("router,routing,deterministic", [
    ("base", "deterministic", True),
    ("switch", "partial", True),
    ("switch", "partial", False),
    ("hash", "deterministic", False),
    ("gshard", "partial", True),
])
def test_no_position_reads_a_later_token(router, routing, deterministic):
  # The sparse block alone (sMoE, then tMoE: what routes): the dense gMLP
  # block's causal SGU (tests/gmlp_test.py) would double the compile.
  model, cfg = _model(0, tmoe_router=router, smoe_routing=routing,
                      capacity_factor=0.75, eval_capacity_factor=0.75)
  n, vocab = cfg.max_len, cfg.vocab_size
  tokens = jax.random.randint(jax.random.key(0), (n,), 0, vocab)
  params = model.init(jax.random.key(1), tokens[None])["params"]
  # Row k changes token k (to a different id); row n is the original.
  rows = jnp.tile(tokens, (n + 1, 1))
  rows = rows.at[jnp.arange(n), jnp.arange(n)].set((tokens + 17) % vocab)
  logits, _ = jax.jit(lambda p, x: model.apply(
      {"params": p}, x, deterministic=deterministic, mutable=COLLECTIONS,
      rngs={"dropout": jax.random.key(2)}))(params, rows)
  logits = np.asarray(logits)
  for k in range(n):
    np.testing.assert_allclose(logits[k, :k], logits[n, :k], rtol=0,
                               atol=1e-6, err_msg=f"token {k} leaks")
    # ... and the perturbation is seen from position k on.
    assert np.abs(logits[k, k] - logits[n, k]).max() > 1e-4
  if routing == "partial":
    assert model.loss_start == 4
    assert models.model_facts(cfg).loss_start == 4
    w = models.model_facts(cfg).loss_weights(jnp.ones((2, n)), None)
    np.testing.assert_array_equal(w[:, :4], 0)
    np.testing.assert_array_equal(w[:, 4:], 1)


def test_lm_expert_parallel_equals_single_device():
  model, cfg = _model(0, tmoe_router="switch", smoe_routing="partial",
                      capacity_factor=0.75)   # the sparse block: it is split
  x = jax.random.randint(jax.random.key(3), (8, cfg.max_len), 0,
                         cfg.vocab_size)
  params = model.init(jax.random.key(4), x)["params"]
  fwd = jax.jit(lambda p, x: model.apply({"params": p}, x,
                                         deterministic=False,
                                         mutable=COLLECTIONS))
  y0, m0 = fwd(params, x)
  mesh = jax.make_mesh((2, 1, 1, 4), ("data", "fsdp", "tensor", "expert"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    y1, m1 = fwd(params, x)
    hlo = fwd.lower(params, x).compile().as_text()
  assert hlo.count("all-to-all") >= 4          # tMoE and sMoE, both ways
  np.testing.assert_allclose(y0, y1, rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6), m0, m1)


@pytest.mark.parametrize("router,routing,preset,shape", [
    ("gshard", "partial", "expert", (1, 2, 2, 2)),
    ("base", "deterministic", "fsdp", (2, 2, 2, 1)),
    ("hash", "partial", "fsdp_tensor", (1, 1, 2, 4)),
    ("switch", "deterministic", "data_parallel", (2, 2, 1, 2)),
    ("gshard", "partial", "data_parallel", (8, 1, 1, 1))])
def test_lm_loss_grads_and_router_statistics_equal_single_device(
    router, routing, preset, shape):
  """The sMLP LM's training objective (loss and auxiliary losses), its
  gradients and its router statistics under a rules preset equal the
  unsharded model's, with tokens dropped (capacity factor 0.5) and rows of
  several lengths."""
  from hypermixer_jax import sharding  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import steps  # pylint: disable=g-import-not-at-top
  model, cfg = _model(tmoe_router=router, smoe_routing=routing,
                      capacity_factor=0.5)
  facts = models.model_facts(cfg)
  rng = np.random.default_rng(0)
  n = cfg.max_len
  seg = (np.arange(n)[None] < np.array(
      [n, n, n - 4, n, n // 2, n, n, n - 2])[:, None]).astype(np.int32)
  tokens = rng.integers(1, cfg.vocab_size, (8, n)).astype(np.int32)
  batch = {"inputs": tokens * seg, "targets": np.roll(tokens, -1, 1),
           "weights": seg.astype(np.float32), "segment_ids": seg}

  def objective(params, b):
    inputs, kwargs = heads.model_inputs(b, facts.head)
    out, mutated = model.apply({"params": params}, inputs,
                               deterministic=False, mutable=COLLECTIONS,
                               rngs={"dropout": jax.random.key(1)}, **kwargs)
    loss, _ = heads.compute_loss(facts.head, out, b,
                                 loss_weights=facts.loss_weights)
    aux = sum(jnp.sum(x)
              for x in jax.tree.leaves(mutated.get("aux_loss", {})))
    return loss + aux, steps.moe_metrics(mutated["moe_metrics"])
  inputs, kwargs = heads.model_inputs(batch, facts.head)
  boxed = model.init(jax.random.key(0), inputs, **kwargs)["params"]
  params = nn.unbox(boxed)
  grad = jax.value_and_grad(objective, has_aux=True)
  (l0, m0), g0 = jax.jit(grad)(params, batch)
  if router != "base":   # (Base Layers' balanced assignment drops none)
    assert m0["moe/layer_1/tmoe/dropped_fraction"] > 0.1
  mesh = sharding.build_mesh(dict(zip(sharding.MESH_AXES, shape)))
  rules = sharding.get_rules(preset)
  shardings = sharding.logical_shardings(
      jax.eval_shape(lambda: boxed), mesh, rules)
  sharded = jax.jit(sharding.within(grad, mesh, rules), in_shardings=(
      shardings, sharding.batch_shardings(batch, mesh, rules)))
  args = (jax.device_put(params, shardings),
          sharding.make_global_batch(batch, mesh, rules))
  (l1, m1), g1 = sharded(*args)
  if shape == (8, 1, 1, 1):
    # Data parallelism alone: each device routes its own rows (the router's
    # [B, N, E] probabilities were gathered onto every device).
    assert "all-gather" not in sharded.lower(*args).compile().as_text()
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(jax.device_get(g1)), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  for k in m0:
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _batch(rng, b, n, vocab):
  """Arithmetic sequences mod vocab: the next token needs two earlier ones."""
  start = rng.randint(0, vocab, size=(b, 1))
  step = rng.randint(1, 4, size=(b, 1))
  seq = (start + step * np.arange(n + 1)) % vocab
  return jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:])


@pytest.mark.parametrize("router,routing", [("base", "deterministic"),
                                            ("switch", "partial")])
def test_short_training_lowers_loss_with_balanced_experts(router, routing):
  # A stronger balancing loss than the default 1e-2: 100 steps are few.
  model, cfg = _model(tmoe_router=router, smoe_routing=routing,
                      load_balancing_weight=0.1)
  rng = np.random.RandomState(0)
  x, y = _batch(rng, 16, cfg.max_len, cfg.vocab_size)
  params = nn.unbox(model.init(jax.random.key(5), x)["params"])
  opt = optax.adam(1e-2)
  state = (params, opt.init(params))
  weights = model.loss_position_weights(jnp.ones(x.shape))

  def loss_fn(p, x, y, key):
    logits, aux = model.apply({"params": p}, x, deterministic=False,
                              mutable=COLLECTIONS, rngs={"dropout": key})
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    ce = jnp.sum(ce * weights) / jnp.sum(weights)
    aux_loss = sum(jax.tree.leaves(aux.get("aux_loss", {})))
    return ce + aux_loss, (ce, aux["moe_metrics"])

  @jax.jit
  def step(state, x, y, key):
    p, o = state
    (_, (ce, metrics)), g = jax.value_and_grad(loss_fn, has_aux=True)(
        p, x, y, key)
    upd, o = opt.update(g, o, p)
    return (optax.apply_updates(p, upd), o), ce, metrics

  losses, usage = [], []
  for i in range(100):
    x, y = _batch(rng, 16, cfg.max_len, cfg.vocab_size)
    state, ce, metrics = step(state, x, y, jax.random.key(i))
    losses.append(float(ce))
    sparse = [k for k in metrics if k.startswith("layer_")]
    usage.append(np.asarray(metrics[sparse[0]]["tmoe"]["expert_usage"][0]))
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
  last = np.mean(usage[-10:], axis=0)
  if router == "base":
    np.testing.assert_allclose(np.stack(usage), 0.25, atol=1e-6)
  else:
    assert last.min() > 0.15 and last.max() < 0.35, last


def test_partial_loss_weights_start_at_each_rows_own_prefix():
  model, cfg = _model(smoe_routing="partial")
  facts = models.model_facts(cfg)
  n = cfg.max_len                                    # 20: unpadded start 4
  seg = np.zeros((3, n), np.int32)
  for r, length in enumerate((20, 10, 14)):
    seg[r, :length] = 1
  weights = jnp.asarray(seg, jnp.float32)
  got = np.asarray(facts.loss_weights(weights, jnp.asarray(seg)))
  for r, (length, start) in enumerate(((20, 4), (10, 2), (14, 2))):
    want = np.zeros(n)
    want[start:length] = 1
    np.testing.assert_array_equal(got[r], want, err_msg=f"row {r}")
  # The train/eval steps weight the loss the same way.
  batch = heads.with_loss_weights(
      {"weights": weights, "segment_ids": jnp.asarray(seg)},
      facts.loss_weights)
  np.testing.assert_array_equal(batch["weights"], got)
  # Without segment ids every row is full length; deterministic: unchanged.
  np.testing.assert_array_equal(
      model.loss_position_weights(jnp.ones((1, n)))[0, :4], 0)
  det, det_cfg = _model(smoe_routing="deterministic")
  assert models.model_facts(det_cfg).loss_weights is None
  np.testing.assert_array_equal(det.loss_position_weights(weights), weights)


def test_gshard_random_routing_reaches_the_tmoe():
  # model.moe.second_expert_policy reaches the sparse blocks' tMoE: training
  # draws differ by rng, inference equals the 'all' policy.
  model, cfg = _model(0, tmoe_router="gshard", second_expert_policy="random",
                      capacity_factor=4.0)
  every, _ = _model(0, tmoe_router="gshard", capacity_factor=4.0)
  tokens = jax.random.randint(jax.random.key(0), (2, cfg.max_len), 0,
                              cfg.vocab_size)
  params = model.init(jax.random.key(1), tokens)["params"]

  def logits(m, key, deterministic):
    return jax.jit(lambda p: m.apply(
        {"params": p}, tokens, deterministic=deterministic,
        rngs={"dropout": key}, mutable=COLLECTIONS)[0])(params)
  np.testing.assert_allclose(logits(model, jax.random.key(2), True),
                             logits(every, jax.random.key(2), True),
                             rtol=1e-6, atol=1e-6)
  assert not np.allclose(logits(model, jax.random.key(2), False),
                         logits(model, jax.random.key(3), False))
  np.testing.assert_allclose(logits(every, jax.random.key(2), False),
                             logits(every, jax.random.key(3), False),
                             rtol=1e-6, atol=1e-6)
