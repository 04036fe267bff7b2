"""The seqio tasks' side of ``pipeline``: epochs as tf.data datasets, the
tf.data iterator's state, and the checks of their config.

``pipeline`` imports this module only for a task read through tf.data, so
that runs of the synthetic task never import TensorFlow.
"""
from __future__ import annotations

import re

import ml_collections
import numpy as np
import seqio
import tensorflow as tf

from hypermixer_jax.data import config as config_lib
from hypermixer_jax.data import converters
from hypermixer_jax.data import sources
from hypermixer_jax.data import tasks
from hypermixer_jax.data import vocab as vocab_lib
from hypermixer_jax.data.checks import DataError


def epoch_seed(seed: int, epoch: int) -> int:
  """An int32 seed for epoch ``epoch`` of a pipeline seeded with ``seed``."""
  return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0] >> 1)


def translate(error: tf.errors.OpError, identity: dict) -> Exception:
  """A ``DataError`` for a tf.data failure caused by the data."""
  data_error = sources.data_error_from(error)
  if data_error is not None:
    return data_error
  text = str(error.message)
  missing = re.search(r": ([^:;\n]+); No such file or directory", text)
  if isinstance(error, tf.errors.NotFoundError) and missing:
    # A file a row names (an image of a TSV): TF's message names the path.
    return DataError(
        f"{identity['task']}:{identity['split']}: {missing[1]} does not "
        "exist; fix its path in the TSV that names it (relative to the "
        "TSV's folder or its images/ folder) or drop its row.")
  if "jpeg" in text.lower() or "decode" in text.lower():
    return DataError(
        f"{identity['task']}:{identity['split']}: an image failed to decode "
        f"({text.splitlines()[0][:300]}); one of the files is corrupt.")
  return error


# The tf.data iterator state, in the format of TF's own
# ``OwnedIterator._save``/``_restore`` (the serialised state's slices, each
# serialised, base64, joined by commas), so that states saved by either
# restore with the other. TF's versions run one eager op per slice: with the
# default 10k-example shuffle buffer (~10k slices) a save took 3.4 s and
# blocked the training loop at every checkpoint; these run as one graph
# (0.2 s; one-off runs, docs/performance.md, Input pipelines).
@tf.function(reduce_retracing=True, autograph=False)
def save_iterator(resource: tf.Tensor, policy: int) -> tf.Tensor:
  state = tf.raw_ops.SerializeIterator(resource_handle=resource,
                                       external_state_policy=policy)
  slices = tf.map_fn(tf.io.serialize_tensor, state,
                     fn_output_signature=tf.string)
  return tf.strings.reduce_join(tf.io.encode_base64(slices), separator=",")


@tf.function(reduce_retracing=True, autograph=False)
def restore_iterator(resource: tf.Tensor, blob: tf.Tensor) -> None:
  slices = tf.io.decode_base64(tf.strings.split(blob, ","))
  state = tf.map_fn(lambda x: tf.io.parse_tensor(x, tf.variant), slices,
                    fn_output_signature=tf.variant)
  tf.raw_ops.DeserializeIterator(resource_handle=resource, serialized=state)


def check_config(cfg: ml_collections.ConfigDict, split: str) -> None:
  """The checks of ``build_pipeline`` for a seqio task (its config fields,
  local files and vocabulary)."""
  name = cfg.task
  size = cfg.get("threadpool_size", 0)
  if not isinstance(size, int) or isinstance(size, bool) or size < 0:
    raise DataError(
        f"data.threadpool_size={size!r} must be an integer >= 0 (0 = the "
        "host's cores, at least 8); e.g. --config.data.threadpool_size=0.")
  if cfg.data_dir and not tf.io.gfile.isdir(cfg.data_dir):
    raise FileNotFoundError(f"data.data_dir={cfg.data_dir!r} does not exist.")
  layout = cfg.get("text_layout", "lines")
  if layout not in sources.TEXT_LAYOUTS:
    raise DataError(f"data.text_layout={layout!r}; valid layouts: "
                     f"{', '.join(sources.TEXT_LAYOUTS)}.")
  files = config_lib.local_files(cfg)
  if files:
    if split not in files:
      raise DataError(
          f"data.local_files has no entry for split {split!r} (has "
          f"{sorted(files)}); set --config.data.local_files.{split}=PATTERN.")
    sources.check_local_files({split: files[split]})
  if name == "imagenet_patches":
    if cfg.patch_size < 1 or cfg.image_size % cfg.patch_size:
      raise DataError(f"image_size={cfg.image_size} must be a positive "
                       f"multiple of patch_size={cfg.patch_size}.")
    return
  minimum = tasks.MIN_SEQ_LEN[name]
  if cfg.seq_len < minimum:
    raise DataError(f"data.seq_len={cfg.seq_len} is below the minimum "
                     f"{minimum} for task {name!r}.")
  vocab_lib.check_vocab_path(cfg.vocab_path)


def epoch_fn(cfg, split, *, batch_size, shard_index, num_shards, seed,
                 repeat, shuffle):
  """make_epoch for the seqio tasks: epoch -> tf.data.Dataset of batches."""
  name = cfg.task
  task_name = name
  if name == "imagenet_patches" and split == "train" and (repeat or shuffle):
    # Training reads: random crops and flips. The train split read once in
    # order (an evaluation of it) is scored on the whole images.
    task_name = "imagenet_patches_train"
  task = tasks.get_task(cfg, task_name,
                        shard_index=shard_index if num_shards > 1 else 0)
  shard_info = (seqio.ShardInfo(shard_index, num_shards)
                if num_shards > 1 else None)

  if name in ("c4_mlm", "c4_lm"):
    converter = (converters.MLMFeatureConverter(
        pack=cfg.packing, select_rate=cfg.mlm.select_rate)
                 if name == "c4_mlm"
                 else converters.CausalLMFeatureConverter(pack=cfg.packing))
    keys = converter.TASK_FEATURES
    lengths = {k: cfg.seq_len for k in keys}
  elif name in tasks.CLASSIFICATION:
    converter = converters.ClassificationFeatureConverter(pack=cfg.packing)
    lengths = {"inputs": cfg.seq_len, "token_type_ids": cfg.seq_len,
               "label": 0}
  else:
    converter, lengths = None, None

  options = tf.data.Options()
  options.deterministic = True
  # Fewer per-example hops: consecutive maps (our readers' checks, seqio's
  # preprocessors, the feature converter) run as one function, a filter
  # after a map runs inside it, and the remaining filters (blank lines,
  # empty documents) run in parallel instead of on the consumer's thread.
  # Deterministic order is kept. On the SST-2 pipeline this halved the
  # CPU time per example (a one-off run; docs/performance.md, Input pipelines).
  opt = options.experimental_optimization
  opt.map_fusion = True
  opt.map_and_filter_fusion = True
  opt.filter_parallelization = True
  # A private pool: in tf.data's shared one (a thread per core) the parallel
  # maps, the file interleave and the batching starve each other on few
  # cores (docs/performance.md, Input pipelines).
  options.threading.private_threadpool_size = (
      cfg.get("threadpool_size", 0) or config_lib.default_threadpool_size())
  # The iterator state is saved with the checkpoint. The only stateful ops
  # are our data checks (asserts) and the SentencePiece resources, neither of
  # which holds stream state, so nothing is lost by not saving them.
  options.experimental_external_state_policy = (
      tf.data.experimental.ExternalStatePolicy.IGNORE)

  # The task's maps (readers, seqio's and our preprocessors) are plain graph
  # code, traced with autograph off: converting them cost each process about
  # a second of CPU at its first pipeline (seqio's own functions included),
  # and a step that needs autograph fails loudly when traced here.
  get_dataset = tf.autograph.experimental.do_not_convert(task.get_dataset)

  def make_epoch(epoch: int) -> tf.data.Dataset:
    try:
      ds = get_dataset(
          sequence_length=lengths and {k: v for k, v in lengths.items()
                                       if k != "label"}, split=split,
          shuffle=shuffle, shuffle_buffer_size=cfg.shuffle_buffer_size,
          seed=epoch_seed(seed, epoch), shard_info=shard_info, num_epochs=1,
          try_in_mem_cache=False)
    except AssertionError as e:   # TFDS's: the dataset is not prepared there
      if "could not find data" not in str(e):
        raise
      raise sources.tfds_not_prepared(cfg.data_dir, task.source) from None
    if converter is not None:
      ds = converter(ds, lengths)
    ds = ds.batch(batch_size, drop_remainder=repeat,
                  num_parallel_calls=tf.data.AUTOTUNE)
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)

  return make_epoch
