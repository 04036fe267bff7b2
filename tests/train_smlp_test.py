"""configs/smlp_lm.py: the sparse all-MLP LM trains through the loop, experts sharded."""
import os

import numpy as np
import pytest

import flag_configs
from hypermixer_jax import models
from hypermixer_jax.train import loop
from hypermixer_jax.train import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMLP = os.path.join(ROOT, "configs", "smlp_lm.py")


def _config(*overrides, size="tiny"):
  return flag_configs.load(f"{SMLP}:{size}", *overrides)


def test_configs_use_the_pipelines_vocabulary(shared_data):
  from hypermixer_jax.data import pipeline
  from hypermixer_jax.models import smlp
  from hypermixer_jax.train.config import TEXT_VOCAB_SIZE
  assert smlp.PIPELINE_VOCAB_SIZE == TEXT_VOCAB_SIZE
  assert smlp.smlp_config("base").vocab_size == TEXT_VOCAB_SIZE
  spm = f"--config.data.vocab_path={shared_data / 't5_spm/sentencepiece.model'}"
  for size in ("tiny", "base"):
    c = _config(spm, size=size)
    assert c.model.vocab_size == TEXT_VOCAB_SIZE, size
    # The pipeline's start-up check: every id it can emit fits the model.
    pipeline.check_fits_model(c.data, c.model)
  # The old tiny vocabulary is refused with the size to set.
  c = _config(spm, "--config.model.vocab_size=64")
  with pytest.raises(ValueError, match="model.vocab_size=64.*32128"):
    pipeline.check_fits_model(c.data, c.model)


def test_base_config_loads():
  c = _config("--config.mesh.expert=8", size="base")
  assert c.model.family == "smlp"
  assert models.model_facts(c.model).head == "causal_lm"
  assert c.sharding.rules == "expert" and c.mesh.expert == 8
  assert c.data.seq_len == c.model.max_len == 1024


@pytest.mark.slow
def test_tiny_smlp_trains_with_moe_metrics(c4_slice, tmp_path):
  c4, vocab = c4_slice
  config = _config(
      # The config's learning rate; 300 pieces, EOS and the 100 extra ids fit.
      f"--config.data.vocab_path={vocab}", "--config.model.vocab_size=512",
      "--config.data.shuffle_buffer_size=64",
      "--config.mesh.expert=4",             # 4 experts, one per device
      "--config.batch_size=8", "--config.eval_batch_size=8",
      "--config.num_train_steps=12", "--config.warmup_steps=1",
      "--config.log_every=1", "--config.eval_every=0",
      "--config.eval_steps=1", "--config.checkpoint_every=0")
  config.data.local_files = {"train": c4, "validation": c4}
  result = loop.train_and_evaluate(config, str(tmp_path))
  assert result.step == 12 and result.source == "scratch"
  train = metrics_lib.read_metrics(str(tmp_path))
  assert sorted(train) == list(range(1, 13))
  for record in train.values():
    assert np.isfinite(record["loss"])
    assert any(k.startswith("moe/") for k in record), sorted(record)
  # Real text: the loss falls.
  losses = [train[s]["loss"] for s in sorted(train)]
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.2, losses
  assert any(k.startswith("moe/") for k in result.eval_metrics)
  assert result.eval_metrics["perplexity"] > 1.0
