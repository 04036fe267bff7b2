"""sMLP: sparse all-MLP causal language model on C4 (Yu et al. 2022).

    python -m hypermixer_jax.main --config=configs/smlp_lm.py:base \
        --workdir=/ckpt/smlp

Argument: a size of ``hypermixer_jax.models.smlp.smlp_config``, with the
vocabulary the data pipeline emits (``TEXT_VOCAB_SIZE``, the T5 SentencePiece
model + extra ids). Experts are sharded over the ``expert`` mesh axis (preset
``expert``); set ``--config.mesh.expert=N`` to the number of devices the
experts span. MoE load-balancing statistics are logged under ``moe/...``.

``tiny`` is a CPU smoke run (float32, batch 16, 60 steps, short warm-up),
e.g. on the local C4 sample:

    D=../shared/data
    python -m hypermixer_jax.main --config=configs/smlp_lm.py:tiny \
        --workdir=/tmp/smlp_tiny \
        --config.data.vocab_path=$D/t5_spm/sentencepiece.model \
        --config.data.local_files.train=$D/c4/c4_en_tfds_minimal_train_1000.jsonl \
        --config.data.local_files.validation=$D/c4/c4_en_tfds_minimal_validation_200.jsonl
"""
import ml_collections

from hypermixer_jax.models import smlp
from hypermixer_jax.train.config import TEXT_VOCAB_SIZE, base_config


def get_config(arg: str = "base") -> ml_collections.ConfigDict:
  c = base_config()
  arg = arg or "base"
  c.model = smlp.smlp_config(arg)
  c.model.vocab_size = TEXT_VOCAB_SIZE     # what the SentencePiece task emits
  c.data.task = "c4_lm"
  c.data.seq_len = c.model.max_len
  c.data.packing = True

  c.mesh.data = -1
  c.mesh.expert = 1
  c.sharding.rules = "expert"

  c.batch_size = 256
  c.eval_batch_size = 256
  c.learning_rate = 6e-4
  c.warmup_steps = 2_000
  c.decay = "cosine"
  c.weight_decay = 0.1
  c.b2 = 0.98
  c.clip_norm = 1.0
  c.num_train_steps = 100_000
  c.eval_every = 5_000
  c.eval_steps = 50
  c.log_every = 100
  c.checkpoint_every = 5_000
  c.keep_checkpoints = 3
  if arg == "tiny":
    c.batch_size = c.eval_batch_size = 16
    c.learning_rate = 2e-2                 # d=16: small steps barely move
    c.warmup_steps = 5
    c.num_train_steps = 60
    c.eval_every = 60
    c.eval_steps = 5
    c.log_every = 10
    c.checkpoint_every = 60
  return c
