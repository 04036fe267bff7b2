"""Tests of the losses, train/eval steps and the sharded train state."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.models import common
from hypermixer_jax.train import evaluation
from hypermixer_jax.train import steps

P = jax.P
B, N, F, D, E, H = 8, 6, 5, 16, 2, 24   # batch, length, features, d, experts


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ---------------------------------------------------------------------------
# Losses against NumPy.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("head", ["mlm", "causal_lm"])
def test_token_loss(head):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, size=(3, 5))
  weights = (rng.random((3, 5)) < 0.6).astype(np.float32)
  loss, m = heads.compute_loss(head, jnp.asarray(logits, jnp.bfloat16)
                               .astype(jnp.float32),
                               dict(targets=targets, weights=weights))
  lp = _log_softmax(np.asarray(jnp.asarray(logits, jnp.bfloat16), np.float32))
  ce = np.array([[-lp[b, n, targets[b, n]] for n in range(5)]
                 for b in range(3)])
  np.testing.assert_allclose(loss, (ce * weights).sum() / weights.sum(),
                             rtol=1e-6)
  acc = ((lp.argmax(-1) == targets) * weights).sum() / weights.sum()
  np.testing.assert_allclose(m["accuracy"], acc, rtol=1e-6)
  assert m["denominator"] == weights.sum()


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("head", ["classify", "pair_classify", "image"])
def test_classification_loss(head, weighted):
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(7, 3)).astype(np.float32)
  labels = rng.integers(0, 3, size=7)
  w = np.array([1, 1, 0, 1, 1, 1, 0], np.float32) if weighted else np.ones(7)
  batch = dict(label=labels, **({"weights": w} if weighted else {}))
  loss, m = heads.compute_loss(head, jnp.asarray(logits), batch)
  ce = -_log_softmax(logits)[np.arange(7), labels]
  np.testing.assert_allclose(loss, (ce * w).sum() / w.sum(), rtol=1e-6)
  np.testing.assert_allclose(
      m["accuracy"], ((logits.argmax(-1) == labels) * w).sum() / w.sum())
  assert m["denominator"] == w.sum()


def test_regression_loss():
  rng = np.random.default_rng(2)
  out, tgt = rng.normal(size=(2, 2, 3, 4)).astype(np.float32)
  w = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  loss, m = heads.compute_loss("regression", jnp.asarray(out),
                               dict(targets=tgt, weights=w))
  per_token = ((out - tgt) ** 2).mean(-1)
  np.testing.assert_allclose(loss, (per_token * w).sum() / 3, rtol=1e-6)
  assert set(m) == {"loss", "denominator"}


def test_unknown_head():
  with pytest.raises(ValueError, match="unknown head 'mlmm'"):
    heads.compute_loss("mlmm", jnp.zeros((1, 2)), {})
  with pytest.raises(ValueError, match="unknown head 'mlmm'"):
    steps.make_train_step(_Toy(), "mlmm")
  with pytest.raises(ValueError, match="unknown head 'mlmm'"):
    evaluation.make_eval_step(_Toy(), "mlmm")


def test_missing_batch_keys_are_named():
  with pytest.raises(ValueError, match=r"needs batch keys \['weights'\]"):
    heads.check_batch("causal_lm", dict(inputs=0, targets=0))
  heads.check_batch("classify", dict(inputs=0, label=0))  # weights optional


# ---------------------------------------------------------------------------
# Steps on a small model with experts, dropout and sown MoE outputs.
# ---------------------------------------------------------------------------
class _Toy(nn.Module):
  """Per-token regressor with a dense mixture of E experts that sows the
  MoE collections like the real MoE layers do."""

  @nn.compact
  def __call__(self, inputs, *, segment_ids=None, positions=None,
               deterministic=True):
    del positions
    x = common.Dense(D, (common.PATCH, common.EMBED), name="stem")(inputs)
    x = common.constrain(x, (common.BATCH, common.LENGTH, common.EMBED))
    x = nn.Dropout(0.5)(x, deterministic=deterministic)
    w = self.param("experts", common.partitioned(
        nn.initializers.lecun_normal(), (common.EXPERT, common.EMBED,
                                         common.MLP)), (E, D, H))
    gate = jax.nn.softmax(common.Dense(E, (common.EMBED, None),
                                       name="router")(x))       # [B, N, E]
    h = jnp.einsum("bne,bnd,edh->bnh", gate, x, w)
    h = common.constrain(nn.gelu(h), (common.BATCH, common.LENGTH,
                                      common.MLP))
    self.sow("aux_loss", "balance", 0.1 * jnp.mean(jnp.square(gate)))
    self.sow("moe_metrics", "gate_max", jnp.max(gate, -1))
    y = common.Dense(1, (common.MLP, None), name="out")(h)
    if segment_ids is not None:
      y = y * (segment_ids > 0)[..., None]
    return y


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  return {
      "inputs": rng.normal(size=(B, N, F)).astype(np.float32),
      "targets": rng.normal(size=(B, N, 1)).astype(np.float32),
      "weights": (rng.random((B, N)) < 0.8).astype(np.float32),
      "segment_ids": np.ones((B, N), np.int32),
  }


MODEL = _Toy()
BATCH = _batch()
RNG = jax.random.key(3)


def _mesh(preset="expert", shape=(1, 2, 2, 2)):
  return (sharding.build_mesh(dict(zip(sharding.MESH_AXES, shape))),
          sharding.get_rules(preset))


def _manual_loss(params, batch, dropout_rng):
  """The training objective written out by hand."""
  out, col = MODEL.apply({"params": params}, batch["inputs"],
                         segment_ids=batch["segment_ids"],
                         deterministic=False, rngs={"dropout": dropout_rng},
                         mutable=["aux_loss", "moe_metrics"])
  se = jnp.mean(jnp.square(out - batch["targets"]), -1)
  loss = jnp.sum(se * batch["weights"]) / jnp.sum(batch["weights"])
  aux = col["aux_loss"]["balance"][0]
  return loss + aux, (loss, aux, jnp.mean(col["moe_metrics"]["gate_max"][0]))


def test_train_step_objective_dropout_and_aux_loss():
  mesh, rules = _mesh()
  state, shardings = steps.create_train_state(MODEL, optax.sgd(1.0), RNG,
                                              BATCH, mesh, rules)
  step = steps.make_train_step(MODEL, "regression")
  params = jax.device_get(state.params)
  state = state.replace(step=state.step + 5)  # dropout key must use it
  new, m = jax.jit(step)(state, BATCH, RNG)

  (total, (loss, aux, gate_max)), grads = jax.value_and_grad(
      _manual_loss, has_aux=True)(params, BATCH, jax.random.fold_in(RNG, 5))
  np.testing.assert_allclose(m["total_loss"], total, rtol=1e-6)
  np.testing.assert_allclose(m["loss"], loss, rtol=1e-6)
  np.testing.assert_allclose(m["aux_loss"], aux, rtol=1e-6)
  assert aux > 0
  np.testing.assert_allclose(m["moe/gate_max"], gate_max, rtol=1e-6)
  np.testing.assert_allclose(m["grad_norm"], optax.tree.norm(grads),
                             rtol=1e-5)
  assert bool(m["is_finite"]) and int(new.step) == 6
  # SGD(lr=1): new = old - grad of (task loss + aux loss).
  chex.assert_trees_all_close(
      new.params, jax.tree.map(lambda p, g: p - g, params, grads), rtol=1e-5,
      atol=1e-6)
  # Another step number draws another dropout mask.
  _, m2 = jax.jit(step)(state.replace(step=state.step + 1), BATCH, RNG)
  assert abs(float(m2["loss"]) - float(m["loss"])) > 1e-4


def test_is_finite_flag():
  step = steps.make_train_step(MODEL, "regression")
  mesh, rules = _mesh("data_parallel", (8, 1, 1, 1))
  state, _ = steps.create_train_state(MODEL, optax.sgd(0.1), RNG, BATCH,
                                      mesh, rules)
  bad = dict(BATCH, targets=np.full_like(BATCH["targets"], np.inf))
  _, m = jax.jit(step)(state, bad, RNG)
  assert not bool(m["is_finite"])


def test_sharded_steps_with_accumulating_optimizer():
  """weighted_accumulation(chain(clip, masked AdamW)): every state leaf that
  mirrors a parameter is sharded like it; the jitted steps (weighted by
  each batch's tokens) match unsharded ones."""
  from hypermixer_jax.train import optim  # pylint: disable=g-import-not-at-top
  tx = optim.weighted_accumulation(optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(1e-2, weight_decay=0.1,
                  mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))), 2)
  mesh, rules = _mesh()
  state, shardings = steps.create_train_state(MODEL, tx, RNG, BATCH, mesh,
                                              rules)
  experts = state.params["experts"]
  assert experts.sharding.spec == P("expert", "fsdp", "tensor")
  assert experts.addressable_shards[0].data.shape == (E // 2, D // 2, H // 2)
  mirrored = 0
  for path, x in jax.tree_util.tree_leaves_with_path(state.opt_state):
    name = jax.tree_util.keystr(path)
    if name.endswith("['experts']"):
      assert x.sharding.spec == experts.sharding.spec, name
      mirrored += 1
    elif x.ndim == 0:
      assert x.sharding.spec == P(), name
  assert mirrored == 3  # the accumulator's acc_grads, Adam's mu and nu

  batch_sh = sharding.batch_shardings(BATCH, mesh, rules)
  train = steps.jit_train_step(steps.make_train_step(MODEL, "regression"),
                               shardings, batch_sh, mesh, rules)
  evaluate = steps.jit_eval_step(
      evaluation.make_eval_step(MODEL, "regression"), shardings, batch_sh,
      mesh, rules)
  ref = jax.device_get(state)
  ref_train = jax.jit(steps.make_train_step(MODEL, "regression"))
  batch = sharding.make_global_batch(BATCH, mesh, rules)
  for i in range(2):
    ref, ref_m = ref_train(ref, BATCH, RNG)
    state, m = train(state, batch, RNG)
    np.testing.assert_allclose(m["total_loss"], ref_m["total_loss"],
                               rtol=1e-5, err_msg=f"step {i}")
  chex.assert_trees_all_close(jax.device_get(state.params), ref.params,
                              rtol=1e-4, atol=1e-6)
  for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
    assert x.sharding == s

  sums = evaluate(state, batch)
  assert sums["loss_sum"].sharding.spec == P()
  metrics = evaluation.finalize(jax.device_get(sums), "regression")
  # The model's sown MoE statistics are reported by eval too.
  assert "moe/gate_max" in metrics, sorted(metrics)
  out = MODEL.apply({"params": jax.device_get(state.params)},
                    BATCH["inputs"], segment_ids=BATCH["segment_ids"])
  _, expected = heads.compute_loss("regression", out, BATCH)
  np.testing.assert_allclose(metrics["loss"], expected["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["mse"], expected["loss"], rtol=1e-5)
  np.testing.assert_allclose(sums["denominator"], expected["denominator"])


# ---------------------------------------------------------------------------
# sMLP: partial-prediction routing and per-expert statistics reach the steps.
# ---------------------------------------------------------------------------
def test_smlp_steps_count_only_routed_positions_and_log_each_expert():
  """The evaluation step the loop runs counts the positions training counts
  (it once counted the first 20% that partial routing excludes)."""
  from hypermixer_jax.models import smlp
  cfg = smlp.smlp_config("tiny")
  cfg.moe.smoe_routing = "partial"
  cfg.moe.tmoe_router = "switch"
  # Same capacity in training and evaluation, so both see the same model.
  cfg.moe.eval_capacity_factor = cfg.moe.capacity_factor
  model = models.build_model(cfg)
  facts = models.model_facts(cfg)
  n, e = cfg.max_len, cfg.moe.num_experts
  start = facts.loss_start
  assert 0 < start < n and start == model.loss_start
  rng = np.random.default_rng(3)
  inputs = rng.integers(1, cfg.vocab_size, size=(2, n)).astype(np.int32)
  batch = dict(inputs=inputs, targets=np.roll(inputs, -1, 1),
               weights=np.ones((2, n), np.float32),
               segment_ids=np.ones((2, n), np.int32))

  # Init, eval step, forward and train step in one jit: one compilation
  # instead of thousands of eager MoE ops.
  @jax.jit
  def run(batch):
    params = model.init(jax.random.key(0), batch["inputs"])["params"]
    state = steps.TrainState.create(apply_fn=model.apply, params=params,
                                    tx=optax.sgd(0.0))
    sums = evaluation.make_eval_step(
        model, facts.head, loss_weights=facts.loss_weights)(state, batch)
    logits = model.apply({"params": params}, batch["inputs"])
    _, train_metrics = steps.make_train_step(
        model, facts.head, loss_weights=facts.loss_weights)(
            state, batch, jax.random.key(1))
    return sums, logits, train_metrics

  sums, logits, train_metrics = run(batch)
  metrics = evaluation.finalize(jax.device_get(sums), facts.head)
  # The loss is the mean over positions >= loss_start only.
  ce = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), jnp.asarray(batch["targets"]))
  np.testing.assert_allclose(metrics["loss"], np.mean(ce[:, start:]),
                             rtol=1e-5)
  assert sums["denominator"] == 2 * (n - start)
  # Training's loss on the same batch (no dropout): the same positions.
  np.testing.assert_allclose(train_metrics["loss"], metrics["loss"],
                             rtol=1e-5)
  # One scalar per expert for the usage vector, and they sum to ~1.
  usage = sorted(k for k in metrics if "expert_usage" in k)
  assert len(usage) % e == 0 and usage, sorted(metrics)
  per_layer = {k.rsplit("/", 1)[0] for k in usage}
  for layer in per_layer:
    total = sum(float(metrics[f"{layer}/{i}"]) for i in range(e))
    assert 0.5 < total <= 1.0 + 1e-5, (layer, total)
  assert any("expert_usage" in k for k in train_metrics)


@pytest.mark.parametrize("head", ["classify", "causal_lm"])
def test_a_split_that_does_not_fill_its_last_batch_evaluates_on_a_mesh(head):
  """11 examples in batches of 4 on a mesh whose batch axis is split 4
  ways: the last batch (3 rows) is padded with rows of weight 0, so every
  example counts once and no padding does (the pooled NumPy reference)."""
  rng = np.random.default_rng(5)
  n, classes = 11, 3
  if head == "classify":   # its batches carry no weights of their own
    logits = rng.normal(size=(n, classes)).astype(np.float32)
    split = {"logits": logits, "label": rng.integers(0, classes, n)}
    w = np.ones(n, np.float32)
    ce = -_log_softmax(logits)[np.arange(n), split["label"]]
    right = logits.argmax(-1) == split["label"]
  else:
    logits = rng.normal(size=(n, N, classes)).astype(np.float32)
    targets = rng.integers(0, classes, (n, N))
    w = (rng.random((n, N)) < 0.7).astype(np.float32)
    split = {"logits": logits, "targets": targets, "weights": w}
    ce = -np.take_along_axis(_log_softmax(logits), targets[..., None],
                             -1)[..., 0]
    right = logits.argmax(-1) == targets
  mesh = sharding.build_mesh(dict(data=4), devices=jax.devices()[:4])
  rules = sharding.get_rules("data_parallel")
  assert sharding.batch_shards(mesh, rules) == 4
  batches = [evaluation.with_example_weights(
      {k: v[i:i + 4] for k, v in split.items()}, head) for i in (0, 4, 8)]
  def sums(state, b):
    # A per-row statistic averaged over rows, as the MoE routers' are: the
    # share of rows with logits (an empty padding row would lower it).
    out = heads.eval_sums(head, b["logits"], b)
    out["moe/rows_with_logits"] = jnp.mean(jnp.any(
        b["logits"].reshape(len(b["logits"]), -1) != 0, -1))
    out["num_batches"] = jnp.ones(())
    return out
  step = jax.jit(sums)
  got = evaluation.evaluate(step, None, batches, mesh, rules, head)
  assert got["moe/rows_with_logits"] == 1.0
  np.testing.assert_allclose(got["loss"], (ce * w).sum() / w.sum(),
                             rtol=1e-5)
  np.testing.assert_allclose(got["accuracy"], (right * w).sum() / w.sum(),
                             rtol=1e-6)
  # A split that gives a process no batch at all is named (on every
  # process: the others would wait for it).
  with pytest.raises(ValueError, match=(
      r"^the evaluation split 'validation' gave no batch to process\(es\) "
      r"\[0\] of 1: it has fewer examples than processes, or none")):
    evaluation._every_process_has_a_batch(False, "validation")  # pylint: disable=protected-access
  # Padding rows need weights to be told apart: a batch without refuses.
  with pytest.raises(ValueError, match="without 'weights' cannot be padded"):
    evaluation.evaluate(step, None, [{"logits": logits[:3],
                                      "label": np.zeros(3, int)}],
                        mesh, rules, head)


class _Linear(nn.Module):
  """A per-token regressor without dropout (micro-batches and the whole
  batch then compute the same function)."""

  @nn.compact
  def __call__(self, inputs, *, segment_ids=None, positions=None,
               deterministic=True):
    del segment_ids, positions, deterministic
    return common.Dense(1, (common.EMBED, None), name="out")(inputs)


def test_grad_accumulation_weighs_micro_batches_by_their_tokens():
  """Two micro-batches holding 24 and 3 loss tokens, accumulated, update
  the parameters as one step on the whole batch does (the token-weighted
  loss); the plain mean of their gradients is another update. (Adam's eps
  is large, so that its first update follows the gradient's size, not
  only its sign.)"""
  from hypermixer_jax.train import optim  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(4)
  batch = {"inputs": rng.normal(size=(8, N, F)).astype(np.float32),
           "targets": rng.normal(size=(8, N, 1)).astype(np.float32),
           "weights": np.zeros((8, N), np.float32)}
  batch["weights"][:4] = 1.0            # the first half: 24 tokens
  batch["weights"][4, :3] = 1.0         # the second half: 3 tokens
  halves = [{k: v[:4] for k, v in batch.items()},
            {k: v[4:] for k, v in batch.items()}]
  model = _Linear()
  params = nn.unbox(model.init(jax.random.key(0), batch["inputs"])["params"])

  def optimizer(accum):
    return optim.make_optimizer(ml_collections.ConfigDict(dict(
        learning_rate=0.1, warmup_steps=0, decay="constant",
        num_train_steps=2, end_learning_rate_factor=0.0, weight_decay=0.0,
        b1=0.9, b2=0.999, eps=10.0, clip_norm=0.0,
        grad_accum_steps=accum)), params)[0]

  def run(accum, batches):
    state = steps.TrainState.create(apply_fn=model.apply, params=params,
                                    tx=optimizer(accum))
    step = jax.jit(steps.make_train_step(model, "regression"))
    for b in batches:
      state, _ = step(state, b, RNG)
    return state.params
  whole = run(1, [batch])
  chex.assert_trees_all_close(run(2, halves), whole, rtol=1e-5, atol=1e-8)

  def loss(p, b):
    return heads.compute_loss("regression", model.apply({"params": p},
                                                        b["inputs"]), b)[0]
  tx = optimizer(2)
  state, plain = tx.init(params), params
  for b in halves:   # no weights: the mean of the two mean-loss gradients
    u, state = tx.update(jax.grad(loss)(plain, b), state, plain)
    plain = optax.apply_updates(plain, u)
  gap = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), plain, whole)
  assert max(jax.tree.leaves(gap)) > 1e-3, gap
