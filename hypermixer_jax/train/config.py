"""The fields every training config has, with their defaults.

``configs/*.py`` start from ``base_config()`` and change what their job
needs; ``main.py`` loads them with ``lock_config=True``, so a misspelt
``--config.lerning_rate=...`` is an error rather than a new field.
"""
from __future__ import annotations

import ml_collections

from hypermixer_jax import heads


# The heads' own parameter modules (the table of hypermixer_jax.heads):
# mlm_head, classifier (classify / pair_classify / image), regression_head;
# the causal LM's head is the tied token embedding, part of the encoder.
HEAD_PARAMS = heads.param_modules_regex()


def base_config() -> ml_collections.ConfigDict:
  """Top-level config: model, data, mesh, sharding, optimiser, loop, logs."""
  # Imported here so that configs can be read without the model zoo or the
  # input pipelines having been imported by the caller.
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top

  c = ml_collections.ConfigDict()
  c.model = models.default_model_config()
  c.data = data_lib.default_data_config()

  # Device mesh (sizes of the axes; one may be -1 = the rest of the devices)
  # and the logical-to-mesh rules preset (see hypermixer_jax.sharding).
  # indivisible: a parameter dimension its mesh axes do not divide is kept
  # replicated ("replicate") or stops the run ("error"); "auto" replicates
  # under a preset and stops under an explicit rules table.
  c.mesh = ml_collections.ConfigDict(
      dict(data=-1, fsdp=1, tensor=1, expert=1))
  c.sharding = ml_collections.ConfigDict(
      dict(rules="data_parallel", indivisible="auto"))

  # Optimiser: AdamW, linear warm-up then linear / cosine / constant decay.
  c.learning_rate = 1e-3
  c.warmup_steps = 100
  c.decay = "cosine"
  c.end_learning_rate_factor = 0.0
  c.weight_decay = 0.01
  c.b1 = 0.9
  c.b2 = 0.999
  c.eps = 1e-8
  c.clip_norm = 1.0            # <= 0: no clipping
  c.grad_accum_steps = 1       # effective batch = batch_size * this; every
  # step count then counts micro-batches, warmup_steps optimiser updates
  # (the schedule's unit: optim.make_schedule)

  # Loop.
  c.num_train_steps = 1000
  c.batch_size = 64            # global, per train step
  c.eval_batch_size = 64
  c.eval_every = 500           # 0: only at the end
  c.eval_steps = 10            # batches per evaluation; -1: the whole split
  c.eval_split = "validation"
  c.log_every = 50
  c.seed = 0

  # Checkpoints.
  c.checkpoint_every = 500     # 0: only at the end (and on preemption)
  c.keep_checkpoints = 3
  c.async_checkpoints = True
  # Initial checkpoint (fine-tuning): used only when the workdir has none
  # (a training workdir, or parameters from `main.py --mode=export` or
  # `hypermixer_jax.models.official_mixer`). Every parameter is loaded except
  # those whose '/'-joined path matches one of the comma-separated regular
  # expressions in init_reinit: by default every head's own parameters, in
  # the checkpoint (e.g. an MLM head) and in the new model (its head), so any
  # head fine-tunes from any checkpoint of the same encoder.
  c.init_checkpoint = ""
  c.init_reinit = HEAD_PARAMS

  # MFU: peak FLOP/s of one device; 0 takes the vendor's dense bf16 figure of
  # the device kind (train.metrics.PEAK_FLOPS: TPU v4/v5e/v5p/v6e, A100,
  # H100, H200), so MFU is not shown on unknown devices (CPUs).
  c.peak_flops_per_device = 0.0

  # Profiler: trace steps start_step .. start_step + num_steps - 1 into
  # workdir/profile (TensorBoard / Perfetto); -1: off.
  c.profile = ml_collections.ConfigDict(dict(start_step=-1, num_steps=5))

  # Evaluators beyond the task's metrics (big_vision style), name ->
  # dict(type=..., every=..., **options); see hypermixer_jax.train.evaluation.
  c.evals = ml_collections.ConfigDict()

  # Test hooks: SIGKILL this process after the given step has been logged,
  # saved (when due) and evaluated (kill_at_step), or right after its checkpoint, before its
  # evaluation (kill_after_save_at_step); SIGTERM it after the given step
  # (sigterm_at_step: a preemption notice); replace the loss of the given
  # step by NaN (by poisoning the batch's float arrays). -1 disables.
  c.debug = ml_collections.ConfigDict(dict(
      kill_at_step=-1, kill_after_save_at_step=-1, sigterm_at_step=-1,
      nan_at_step=-1))
  return c


# SentencePiece cc_all.32000 + 100 seqio extra ids = 32,100, padded to a
# multiple of 128 so that the vocab axis shards evenly.
TEXT_VOCAB_SIZE = 32_128
TEXT_SEQ_LEN = 128


def text_model(mixer: str, head: str) -> ml_collections.ConfigDict:
  """The zoo's GLUE-sized ``glue_<mixer>`` model with ``head``, on our
  vocabulary and sequence length (shared by MLM pretraining and GLUE, so
  that a pretrained encoder fits the classifier)."""
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  m = models.get_model_config(f"glue_{mixer}")
  m.head = head
  m.vocab_size = TEXT_VOCAB_SIZE
  m.max_len = TEXT_SEQ_LEN
  m.type_vocab_size = 2
  return m
