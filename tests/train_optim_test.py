"""Tests of hypermixer_jax.train.optim: schedules, decay mask, clipping, accumulation."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from hypermixer_jax.train import optim


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


def test_unknown_decay_fails():
  with pytest.raises(ValueError, match="decay"):
    optim.make_schedule(_config(decay="exp"))


def test_weight_decay_only_on_matrices():
  params = {"w": jnp.ones((3, 5)), "b": jnp.ones((5,))}
  tx, _ = optim.make_optimizer(_config(weight_decay=0.5, warmup_steps=0,
                                       decay="constant", learning_rate=0.1))
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  # Zero gradient: only decoupled weight decay moves the parameters.
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((3, 5)),
                             rtol=1e-6)
  np.testing.assert_allclose(updates["b"], 0.0)


def test_grad_accumulation_equals_big_batch():
  """k micro-steps of MultiSteps == one step on the mean gradient."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
  grads = [{"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
           for _ in range(3)]
  kw = dict(warmup_steps=0, decay="constant", learning_rate=0.1,
            weight_decay=0.1, clip_norm=0.5)
  big, _ = optim.make_optimizer(_config(**kw))
  mean = jax.tree.map(lambda *g: sum(g) / 3, *grads)
  u, _ = big.update(mean, big.init(params), params)
  expected = optax.apply_updates(params, u)

  acc, _ = optim.make_optimizer(_config(grad_accum_steps=3, **kw))
  state, p = acc.init(params), params
  for i, g in enumerate(grads):
    u, state = jax.jit(acc.update)(g, state, p)
    p = optax.apply_updates(p, u)
    if i < 2:  # no change before the k-th micro-step
      np.testing.assert_array_equal(p["w"], params["w"])
  np.testing.assert_allclose(p["w"], expected["w"], rtol=1e-5, atol=1e-6)
