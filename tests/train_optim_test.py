"""Tests of hypermixer_jax.train.optim: schedules, decay mask, clipping, accumulation."""
from flax import linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from hypermixer_jax import models
from hypermixer_jax.experiment.flags import load_config
from hypermixer_jax.train import optim
from hypermixer_jax.train import steps


def _config(**kw):
  c = ml_collections.ConfigDict(dict(
      learning_rate=1.0, warmup_steps=4, decay="linear", num_train_steps=14,
      end_learning_rate_factor=0.0, weight_decay=0.0, b1=0.9, b2=0.999,
      eps=1e-8, clip_norm=0.0, grad_accum_steps=1))
  c.update(kw)
  return c


@pytest.mark.parametrize("decay", ["linear", "cosine", "constant"])
def test_schedule_warmup_and_decay(decay):
  s = optim.make_schedule(_config(decay=decay))
  lrs = np.array([s(i) for i in range(15)])
  np.testing.assert_allclose(lrs[:5], [0, .25, .5, .75, 1.], atol=1e-6)
  if decay == "linear":
    np.testing.assert_allclose(lrs[4:], np.linspace(1, 0, 11), atol=1e-6)
  elif decay == "cosine":
    t = np.arange(11) / 10
    np.testing.assert_allclose(lrs[4:], 0.5 * (1 + np.cos(np.pi * t)),
                               atol=1e-6)
  else:
    np.testing.assert_allclose(lrs[4:], 1.0)


def test_with_accumulation_the_schedule_counts_updates():
  # warmup_steps=4 updates, 28 micro-batches in 14 updates of 2: the same
  # schedule as without accumulation, indexed by update (docs/training.md).
  with_k = optim.make_schedule(_config(num_train_steps=28,
                                       grad_accum_steps=2))
  plain = optim.make_schedule(_config())
  np.testing.assert_allclose([with_k(i) for i in range(15)],
                             [plain(i) for i in range(15)], atol=1e-7)


def test_unknown_decay_fails():
  with pytest.raises(ValueError, match="decay"):
    optim.make_schedule(_config(decay="exp"))


def test_weight_decay_only_on_matrices():
  params = {"w": jnp.ones((3, 5)), "b": jnp.ones((5,))}
  tx, _ = optim.make_optimizer(_config(weight_decay=0.5, warmup_steps=0,
                                       decay="constant", learning_rate=0.1),
                               params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  # Zero gradient: only decoupled weight decay moves the parameters.
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((3, 5)),
                             rtol=1e-6)
  np.testing.assert_allclose(updates["b"], 0.0)


def test_axes_that_stack_copies_are_not_counted():
  """A scanned stack's [L, d] LayerNorm scale and an expert bank's [E, F]
  biases are vectors (no decay); their matrices decay."""
  boxed = {
      "scale": nn.LogicallyPartitioned(jnp.ones((2, 5)), ("layers", "norm")),
      "bias": nn.LogicallyPartitioned(jnp.ones((4, 6)), ("expert", "mlp")),
      "kernel": nn.LogicallyPartitioned(jnp.ones((2, 5, 6)),
                                        ("layers", "embed", "mlp")),
      "wi": nn.LogicallyPartitioned(jnp.ones((4, 5, 6)),
                                    ("expert", "embed", "mlp")),
      "router": nn.LogicallyPartitioned(jnp.ones((5, 4)), ("embed", None)),
      "bo": nn.LogicallyPartitioned(jnp.ones((4, 5)), ("expert", "embed")),
      "query": {"bias": nn.LogicallyPartitioned(jnp.ones((2, 3)),
                                                ("heads", "kv"))}}
  assert optim.weight_decay_mask(boxed) == {
      "scale": False, "bias": False, "kernel": True, "wi": True,
      "router": True, "bo": False, "query": {"bias": False}}
  params = nn.unbox(boxed)
  tx, _ = optim.make_optimizer(_config(weight_decay=0.5, warmup_steps=0,
                                       decay="constant", learning_rate=0.1),
                               boxed)
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params),
                         tx.init(params), params)
  for name in ("scale", "bias", "bo"):
    np.testing.assert_array_equal(updates[name], 0.0)
  np.testing.assert_array_equal(updates["query"]["bias"], 0.0)
  for name in ("kernel", "wi", "router"):
    np.testing.assert_allclose(updates[name], -0.05, rtol=1e-6)


def _layer_masks(mask, scanned):
  """Layer 0's decay mask of a text model's stack, scanned or unrolled."""
  stack = mask["encoder"]["stack"]
  return stack["layers"]["layer"] if scanned else stack["layer_0"]


@pytest.mark.parametrize("mixer", ["hypermixer", "gmlp", "attention"])
def test_scanned_and_unrolled_stacks_decay_the_same_leaves(mixer):
  """The scanned stack's leaves carry a leading layer axis; its mask equals
  the unrolled stack's, layer by layer (LayerNorms and biases left alone)."""
  masks = {}
  for scanned in (False, True):
    cfg = models.get_model_config(f"glue_{mixer}")
    cfg.update(num_layers=2, d_model=16, d_ffn=32, max_len=8,
               vocab_size=50, scan_layers=scanned)
    if mixer == "hypermixer":
      cfg.mixer_kwargs.hyper_dim = 8
    shapes = steps.param_shapes(models.build_model(cfg),
                                {"inputs": jnp.zeros((2, 8), jnp.int32)})
    masks[scanned] = _layer_masks(optim.weight_decay_mask(shapes), scanned)
  assert masks[True] == masks[False]
  leaves = jax.tree_util.tree_leaves_with_path(masks[True])
  names = {jax.tree_util.keystr(p): m for p, m in leaves}
  assert any(names.values()) and not all(names.values())
  for path, decays in names.items():
    assert decays == path.endswith(("['kernel']", "['embedding']")), path


def test_expert_banks_decay_their_matrices_not_their_biases():
  """sMLP's expert banks (tMoE wi / wo, sMoE spatial kernels) decay; their
  [E, ...] biases do not."""
  cfg = load_config("smlp_lm.py", "tiny")
  shapes = steps.param_shapes(models.build_model(cfg.model),
                              {"inputs": jnp.zeros((2, cfg.model.max_len),
                                                   jnp.int32)})
  mask = optim.weight_decay_mask(shapes)
  experts = {jax.tree_util.keystr(p): (m, leaf.names)
             for (p, m), leaf in zip(
                 jax.tree_util.tree_leaves_with_path(mask),
                 jax.tree.leaves(shapes,
                                 is_leaf=lambda x: isinstance(
                                     x, nn.Partitioned)))
             if "expert" in leaf.names}
  assert experts, "the tiny sMLP has no expert banks"
  for path, (decays, names) in experts.items():
    assert decays == (len(names) == 3), (path, names)
  assert any(d for d, _ in experts.values())
  assert not all(d for d, _ in experts.values())


@pytest.mark.parametrize("weights", [None, (5.0, 0.0, 2.0)])
def test_grad_accumulation_equals_big_batch(weights):
  """k micro-steps == one step on the gradients' mean weighted by each
  micro-batch's loss positions (a plain mean without weights), twice in a
  row (the accumulator starts again after each update)."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
  grads = [{"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
           for _ in range(6)]
  w = np.ones(3) if weights is None else np.asarray(weights)
  kw = dict(warmup_steps=0, decay="constant", learning_rate=0.1,
            weight_decay=0.1, clip_norm=0.5)
  big, _ = optim.make_optimizer(_config(**kw), params)
  big_state, expected = big.init(params), params
  for part in (grads[:3], grads[3:]):
    mean = jax.tree.map(lambda *g: sum(x * float(c) for x, c in zip(g, w))
                        / w.sum(), *part)
    u, big_state = big.update(mean, big_state, expected)
    expected = optax.apply_updates(expected, u)

  acc, _ = optim.make_optimizer(_config(grad_accum_steps=3, **kw), params)
  state, p = acc.init(params), params
  update = jax.jit(acc.update)
  for i, g in enumerate(grads):
    extra = {} if weights is None else {"weight": w[i % 3]}
    u, state = update(g, state, p, **extra)
    p = optax.apply_updates(p, u)
    if i < 2:  # no change before the k-th micro-step
      np.testing.assert_array_equal(p["w"], params["w"])
  np.testing.assert_allclose(p["w"], expected["w"], rtol=1e-5, atol=1e-6)
