"""Probes of models trained on the synthetic pairs task (``data.task=
synthetic_pairs``): the test sequence a pseudo-attention map is drawn on, the
map of a trained model, and the test MSE of two trivial predictors."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from hypermixer_jax import models
from hypermixer_jax.data import synthetic
from hypermixer_jax.train import pseudo_attention as pa


def map_example(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """The first test sequence of ``config``'s data (inputs, targets [N, 1])."""
  ex = synthetic.generate(config.data.synthetic, "test", np.arange(1))
  return {k: ex[k][0] for k in ("inputs", "targets")}


def pseudo_attention_map(config: ml_collections.ConfigDict, params,
                         x: np.ndarray) -> np.ndarray:
  """``[N, N]`` pseudo-attention of the trained model on one sequence."""
  model = models.build_model(config.model)
  apply = jax.jit(lambda x: model.apply({"params": params}, x[None])[0])
  return np.asarray(pa.pseudo_attention(apply, jnp.asarray(x)))


def trivial_baselines(config: ml_collections.ConfigDict,
                      train_examples: int = 4096) -> dict[str, float]:
  """Test MSE of copying the input and of the training set's mean target
  (over its first ``train_examples`` sequences) on ``config``'s test set."""
  opts = config.data.synthetic
  test = synthetic.generate(
      opts, "test", np.arange(opts.num_eval_examples))
  train = synthetic.generate(opts, "train", np.arange(
      min(train_examples, opts.num_examples or train_examples)))
  mean = float(train["targets"].mean())
  return {"copy_input": float(np.mean((test["inputs"] - test["targets"]) ** 2)),
          "train_mean": float(np.mean((mean - test["targets"]) ** 2))}
