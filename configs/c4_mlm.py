"""Masked-LM pretraining on C4 of one of the HyperMixer paper's GLUE models.

    python -m hypermixer_jax.main --config=configs/c4_mlm.py:hypermixer \
        --workdir=/ckpt/mlm_hypermixer

Argument: a GLUE model of the zoo, ``glue_<ARG>`` (``hypermixer``,
``hypermixer_untied``, ``mlp_mixer``, ``gmlp``, ``attention``,
``linear_attention``, ``fnet``), given an MLM head. BERT-style setting of the
gMLP paper's ablations (length 128, AdamW 0.9/0.999, linear warm-up, peak
lr 7e-4, 125k steps), at batch 256. The paper's batch of 2048: a bigger
``batch_size`` over a bigger mesh, or ``--config.grad_accum_steps=8``, which
makes ``num_train_steps`` and the other step counts count micro-batches of
256 (``warmup_steps`` counts updates): pass
``--config.num_train_steps=1000000`` for the 125k updates.
``configs/glue.py:TASK,ARG,finetune`` starts from here.
"""
import ml_collections

from hypermixer_jax import models
from hypermixer_jax.train.config import TEXT_SEQ_LEN
from hypermixer_jax.train.config import base_config
from hypermixer_jax.train.config import text_model


def get_config(arg: str = "hypermixer") -> ml_collections.ConfigDict:
  c = base_config()
  c.model = text_model(arg or "hypermixer", "mlm")
  c.data.task = "c4_mlm"
  c.data.seq_len = TEXT_SEQ_LEN
  # Whether the model may train on packed rows is the model's to say:
  # HyperMixing and the MLP-Mixer token MLP keep one hidden layer per packed
  # example (``mixer_kwargs.max_segments``), so they train on unpacked rows.
  # The options that decide it are set explicitly, so that the command line
  # can change them (raise max_segments to pack; cost grows). Packed rows
  # hold more real tokens: to compare models on the same rows, pass
  # --config.data.packing=False to every one (the MLM studies do).
  facts = models.model_facts(c.model)
  c.data.packing = facts.packing_error is None
  c.model.mixer_kwargs.update(facts.packing_options)

  c.mesh.data = -1
  c.sharding.rules = "data_parallel"

  c.learning_rate = 7e-4
  c.warmup_steps = 10_000
  c.decay = "linear"
  c.weight_decay = 0.01
  c.clip_norm = 1.0
  c.num_train_steps = 125_000
  c.batch_size = 256
  c.eval_batch_size = 256
  c.eval_every = 5_000
  c.eval_steps = 50
  c.log_every = 100
  c.checkpoint_every = 5_000
  c.keep_checkpoints = 3
  return c
