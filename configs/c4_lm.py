"""Causal language modelling on C4 with one of the GLUE-size token mixers.

    python -m hypermixer_jax.main --config=configs/c4_lm.py:hypermixer \
        --workdir=/ckpt/lm_hypermixer

Argument: a GLUE model of the zoo, ``glue_<ARG>``, that has a causal mode
(``hypermixer`` (tied), ``hypermixer_untied``, ``gmlp`` (its spatial gating
unit's causal mask), ``attention``, ``linear_attention``),
given a ``causal_lm`` head and trained on packed rows of N = 1024 tokens.
Causal HyperMixing runs as a chunked scan (``mixer_kwargs.causal_chunk_size``
tokens per step): per layer it keeps one chunk's [B, C, d, d'] hidden states
rather than N of them, and training stores N / C chunk-boundary states.
Packed examples never mix (each segment run restarts the prefix sums).
Optimiser as in GPT-style LM training (AdamW 0.9/0.95, cosine decay).
"""
import ml_collections

from hypermixer_jax import models
from hypermixer_jax.train.config import base_config
from hypermixer_jax.train.config import text_model

LM_SEQ_LEN = 1024


def get_config(arg: str = "hypermixer") -> ml_collections.ConfigDict:
  c = base_config()
  c.model = text_model(arg or "hypermixer", "causal_lm")
  c.model.max_len = LM_SEQ_LEN
  c.model.type_vocab_size = 0
  c.model.dropout_rate = 0.0
  # The mixer's causal options (HyperMixing's chunk), so that the command
  # line can change them.
  c.model.mixer_kwargs.update(models.causal_mixer_kwargs(c.model))
  c.data.task = "c4_lm"
  c.data.seq_len = LM_SEQ_LEN
  c.data.packing = True

  c.mesh.data = -1
  c.sharding.rules = "data_parallel"

  c.learning_rate = 6e-4
  c.warmup_steps = 2_000
  c.decay = "cosine"
  c.end_learning_rate_factor = 0.1
  c.weight_decay = 0.1
  c.b2 = 0.95
  c.clip_norm = 1.0
  c.num_train_steps = 100_000
  c.batch_size = 128
  c.eval_batch_size = 128
  c.eval_every = 5_000
  c.eval_steps = 50
  c.log_every = 100
  c.checkpoint_every = 5_000
  c.keep_checkpoints = 3
  return c
