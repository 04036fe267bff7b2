"""sMLP: sparse all-MLP causal language model on C4 (Yu et al. 2022).

    python -m hypermixer_jax.main --config=configs/smlp_lm.py:base \
        --workdir=/ckpt/smlp

Argument: a size of ``hypermixer_jax.models.smlp.smlp_config``. Experts are
sharded over the ``expert`` mesh axis (preset ``expert``); set
``--config.mesh.expert=N`` to the number of devices the experts span.
MoE load-balancing statistics are logged under ``moe/...``.
"""
import ml_collections

from hypermixer_jax.models import smlp
from hypermixer_jax.train.config import base_config


def get_config(arg: str = "base") -> ml_collections.ConfigDict:
  c = base_config()
  c.model = smlp.smlp_config(arg or "base")
  c.model.dtype = "bfloat16"
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
  return c
