"""Linear probes: the pooled features are the classifier's input, and the
logistic regression is the L2-penalised maximum-likelihood fit."""
import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest

from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax import probe


def _classifier(head="classify", pooling="mean"):
  return ml_collections.ConfigDict(dict(
      family="text", mixer="hypermixer", block="pre_ln", head=head,
      num_layers=1, d_model=16, d_ffn=24, max_len=12, vocab_size=40,
      num_classes=3, dropout_rate=0.0, type_vocab_size=2, pooling=pooling,
      mixer_kwargs=dict(hyper_dim=8)))


def _rows(rng, n=5, length=12):
  lengths = rng.integers(3, length + 1, n)
  inputs = rng.integers(1, 40, (n, length)) * (
      np.arange(length) < lengths[:, None])
  return {"inputs": inputs.astype(np.int32),
          "segment_ids": (inputs > 0).astype(np.int32),
          "label": rng.integers(0, 3, n).astype(np.int32)}


@pytest.mark.parametrize("pooling", ["mean", "first"])
def test_pooled_features_times_the_head_are_the_logits(pooling):
  cfg = _classifier(pooling=pooling)
  model = models.build_model(cfg)
  arrays = _rows(np.random.default_rng(0))
  params = nn.unbox(model.init(jax.random.key(0), arrays["inputs"],
                               segment_ids=arrays["segment_ids"])["params"])
  # Five rows in batches of two: the last batch is padded and cut back.
  feats = probe.pooled_features(cfg, params, arrays, batch_size=2)
  assert feats.shape == (5, 16)
  logits = model.apply({"params": params}, arrays["inputs"],
                       segment_ids=arrays["segment_ids"])
  head = params[heads.get("classify").module]
  leaves = {"/".join(str(k.key) for k in p): x
            for p, x in jax.tree_util.tree_leaves_with_path(head)}
  kernel = next(v for k, v in leaves.items() if k.endswith("kernel"))
  bias = next(v for k, v in leaves.items() if k.endswith("bias"))
  np.testing.assert_allclose(feats @ kernel + bias, logits, rtol=1e-5,
                             atol=1e-5)
  # Padding is not a token: the mean pool reads the real tokens only.
  longer = {k: np.pad(v, ((0, 0), (0, 4))) if v.ndim == 2 else v
            for k, v in arrays.items()}
  cfg.max_len = 16
  np.testing.assert_allclose(probe.pooled_features(cfg, params, longer),
                             feats, rtol=1e-5, atol=1e-6)


def test_pooled_features_refuse_a_head_without_pooling():
  with pytest.raises(ValueError, match="head='mlm'.*classify"):
    probe.pooled_features(_classifier(head="mlm"), {}, {})


def _newton_binary(x, s, penalty, steps=50):
  """Binary logistic regression (labels s in {-1, 1}) minimising mean
  log(1 + exp(-s (x v + c))) + penalty |v|^2 by Newton's method."""
  n, d = x.shape
  xa = np.hstack([x, np.ones((n, 1))])
  theta = np.zeros(d + 1)
  reg = np.diag([2 * penalty] * d + [0.0])
  for _ in range(steps):
    m = s * (xa @ theta)
    p = 1 / (1 + np.exp(m))                 # sigmoid(-m)
    grad = -(xa * (s * p)[:, None]).mean(0) + reg @ theta
    hess = (xa * (p * (1 - p))[:, None]).T @ xa / n + reg
    theta -= np.linalg.solve(hess, grad)
  return theta[:d], theta[d]


def test_logistic_regression_is_the_penalised_fit():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(300, 5))
  y = (x @ np.array([1.5, -1.0, 0.5, 0.0, 2.0]) + 0.3
       + rng.normal(size=300) > 0).astype(np.int32)
  l2 = 0.05
  fit = probe.fit_logistic_regression(x, y, num_classes=2, l2=l2)
  assert fit["grad_norm"] < 1e-5
  # Two softmax classes with l2/2 (|w0|^2 + |w1|^2): the optimum has
  # w0 = -w1, i.e. the binary fit of v = w1 - w0 under (l2/4) |v|^2.
  v, c = _newton_binary(x.astype(np.float64), 2.0 * y - 1.0, l2 / 4)
  np.testing.assert_allclose(fit["w"][:, 1] - fit["w"][:, 0], v, atol=2e-4)
  np.testing.assert_allclose(fit["b"][1] - fit["b"][0], c, atol=2e-4)
  np.testing.assert_allclose(fit["w"][:, 0], -fit["w"][:, 1], atol=2e-4)


def test_logistic_regression_separates_shifted_scaled_clusters():
  rng = np.random.default_rng(2)
  centres = np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0]])
  y = rng.integers(0, 3, 600)
  x = centres[y] + rng.normal(scale=0.5, size=(600, 2))
  # Far from the origin and on very different scales: standardised first.
  x = x * np.array([1000.0, 0.001]) + 5e4
  pred = probe.logistic_regression(x[:400], y[:400], x[400:], num_classes=3,
                                   l2=1e-3)
  assert np.mean(pred == y[400:]) > 0.97
