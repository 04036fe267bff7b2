"""configs/c4_lm.py: causal HyperMixer LM on C4 at N = 1024 (chunked scan)."""
import os

import numpy as np
import pytest

import flag_configs
from hypermixer_jax import models
from hypermixer_jax.train import loop
from hypermixer_jax.train import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C4_LM = os.path.join(ROOT, "configs", "c4_lm.py")


def _config(*overrides, arg="hypermixer"):
  return flag_configs.load(f"{C4_LM}:{arg}", *overrides)


def test_config_builds_a_causal_chunked_hypermixer():
  c = _config("--config.model.mixer_kwargs.causal_chunk_size=32")
  assert c.model.head == "causal_lm" and c.data.task == "c4_lm"
  assert c.data.seq_len == c.model.max_len == 1024 and c.data.packing
  # The causal flag and the chunk size reach the token mixer.
  text = repr(models.build_model(c.model).layer)
  assert "causal=True" in text and "causal_chunk_size=32" in text, text


@pytest.mark.slow
def test_hypermixer_lm_trains_at_length_1024(c4_slice, tmp_path):
  c4, vocab = c4_slice
  config = _config(
      f"--config.data.vocab_path={vocab}",
      # 300 pieces, EOS and the 100 extra ids fit.
      "--config.model.vocab_size=512",
      # Narrow and shallow (the length is what this test is about).
      "--config.model.num_layers=1", "--config.model.d_model=32",
      "--config.model.d_ffn=64", "--config.model.mixer_kwargs.hyper_dim=16",
      "--config.data.shuffle_buffer_size=64",
      # The batch splits over data only: one example on each of 2 devices.
      "--config.mesh.data=2", "--config.mesh.tensor=4",
      "--config.batch_size=2", "--config.eval_batch_size=2",
      "--config.num_train_steps=2", "--config.warmup_steps=1",
      "--config.log_every=1", "--config.eval_every=0",
      "--config.eval_steps=1", "--config.checkpoint_every=0")
  config.data.local_files = {"train": c4, "validation": c4}
  result = loop.train_and_evaluate(config, str(tmp_path))
  assert result.step == 2
  train = metrics_lib.read_metrics(str(tmp_path))
  assert sorted(train) == [1, 2]
  # Packed rows of 1024 tokens, nearly all of them real.
  assert all(r["denominator"] > 1500 and np.isfinite(r["loss"])
             for r in train.values())
  # An untrained model's loss is near a uniform guess over the vocabulary,
  # and the evaluation's perplexity is exp of its loss.
  assert abs(train[1]["loss"] - np.log(512)) < 1.0, train[1]
  np.testing.assert_allclose(result.eval_metrics["perplexity"],
                             np.exp(result.eval_metrics["loss"]), rtol=1e-6)
  assert abs(result.eval_metrics["loss"] - np.log(512)) < 1.0
