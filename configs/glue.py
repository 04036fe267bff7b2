"""GLUE / SNLI classification with the HyperMixer paper's ~11M-parameter models.

    # from scratch (the paper's setting, no pretraining):
    python -m hypermixer_jax.main --config=configs/glue.py:mnli,hypermixer \
        --workdir=/tmp/mnli
    # fine-tuned from a C4 MLM run of configs/c4_mlm.py:
    python -m hypermixer_jax.main \
        --config=configs/glue.py:sst2,hypermixer,finetune \
        --config.init_checkpoint=/ckpt/mlm_hypermixer --workdir=/tmp/sst2_ft

Argument ``TASK,MIXER[,finetune]``: TASK in sst2, mnli, qnli, qqp, snli;
MIXER a ``glue_<MIXER>`` zoo model. ``finetune`` uses BERT's fine-tuning
hyper-parameters and loads the encoder of ``init_checkpoint`` (its MLM head
is dropped and the classifier initialised: ``init_reinit``).
"""
import ml_collections

from hypermixer_jax import models
from hypermixer_jax.train.config import TEXT_SEQ_LEN
from hypermixer_jax.train.config import base_config
from hypermixer_jax.train.config import text_model

NUM_CLASSES = {"sst2": 2, "mnli": 3, "qnli": 2, "qqp": 2, "snli": 3}
SINGLE_SENTENCE = ("sst2",)


def get_config(arg: str = "sst2,hypermixer") -> ml_collections.ConfigDict:
  parts = (arg or "sst2,hypermixer").split(",")
  task, mixer = parts[0], parts[1] if len(parts) > 1 else "hypermixer"
  finetune = "finetune" in parts[2:]
  if task not in NUM_CLASSES:
    raise ValueError(f"unknown GLUE task {task!r}; tasks: {sorted(NUM_CLASSES)}")
  c = base_config()
  head = "classify" if task in SINGLE_SENTENCE else "pair_classify"
  c.model = text_model(mixer, head)
  c.model.num_classes = NUM_CLASSES[task]
  c.data.task = f"glue_{task}"
  c.data.seq_len = TEXT_SEQ_LEN
  # One example per row (data.packing is off): the mixer's options for that
  # (e.g. linear attention sums each row in one einsum).
  c.model.mixer_kwargs.update(models.unpacked_mixer_kwargs(c.model))

  c.mesh.data = -1
  c.sharding.rules = "data_parallel"
  c.eval_split = "validation_matched" if task == "mnli" else "validation"
  c.batch_size = 32 if finetune else 64
  c.eval_batch_size = 128
  c.eval_steps = -1
  c.log_every = 100
  c.keep_checkpoints = 2          # an older step to fall back to
  c.decay = "linear"
  c.weight_decay = 0.01
  c.clip_norm = 1.0
  if finetune:
    # BERT fine-tuning: a few epochs at lr 2e-5..5e-5, 10% warm-up.
    c.learning_rate = 3e-5
    c.num_train_steps = 20_000
    c.warmup_steps = 2_000
    # Load the encoder; initialise everything else (the new classifier).
    c.init_reinit = "(?!encoder/)"
  else:
    # From scratch the paper tunes the lr per model; 1e-4 is mid-grid.
    c.learning_rate = 1e-4
    c.num_train_steps = 50_000
    c.warmup_steps = 1_000
  c.eval_every = c.num_train_steps // 10
  c.checkpoint_every = c.eval_every
  return c
