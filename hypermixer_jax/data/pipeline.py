"""``build_pipeline``: per-host, seeded, resumable iterators of NumPy batches.

Every pipeline is a sequence of epochs. Epoch e is built from the seed
``(seed, e)`` (file order, shuffle buffer, masking and augmentation all
derive from it, statelessly), so it is a pure function of (config, split,
shard, seed, e). The state is ``(epoch, batches taken in the epoch)`` plus,
for the tf.data pipelines, the serialised tf.data iterator (file offsets,
shuffle and packing buffers, as t5x checkpoints its input): a restored
pipeline rebuilds epoch e and restores the iterator, so restarting costs the
same at step 10 and at step 1M, and it yields exactly what the uninterrupted
pipeline would have yielded. (A state without the iterator, e.g. written by
an older version, is resumed by skipping the batches already taken.) The
synthetic task indexes its examples directly.

Each host reads its own shard (``seqio.ShardInfo(shard_index, num_shards)``:
whole files when there are enough of them, else every num_shards-th example).
With ``repeat`` the last incomplete batch of an epoch is dropped so that every
batch has ``batch_size`` rows; without it, the last batch may be smaller.

Bad data stops iteration with ``sources.DataError`` naming file and line.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterator

import ml_collections
import numpy as np

from hypermixer_jax.data import synthetic
from hypermixer_jax.data import task_specs
from hypermixer_jax.data.checks import DataError

# TensorFlow and seqio are imported with ``seqio_pipeline``, only by the
# tasks read through tf.data (not by the synthetic task).

Batch = dict[str, np.ndarray]


class Pipeline:
  """An iterable of batches whose position can be saved and restored.

  Iterating continues from the current position; ``get_state()`` describes
  the batches handed out so far (a consumer that prefetches must save the
  state of the batches it has actually used).

  Args:
    make_epoch: for tf.data pipelines, ``epoch -> tf.data.Dataset`` of
      batches; otherwise ``(epoch, skip) -> iterator`` of NumPy batches that
      starts after ``skip`` batches (must be cheap).
    identity: what a state must match to be restored here.
    repeat: endless epochs.
    tf_data: whether ``make_epoch`` returns a tf.data.Dataset.
  """

  def __init__(self, make_epoch: Callable[..., Any], *,
               identity: dict[str, Any], repeat: bool, tf_data: bool):
    self._make_epoch = make_epoch
    self._identity = identity
    self._repeat = repeat
    self._tf_data = tf_data
    self._epoch = 0
    self._batch = 0
    self._done = False
    self._iterator = None            # live tf.data iterator of this epoch
    self._policy = None              # its external-state policy (save)
    self._restore_blob = None        # iterator state to resume from
    self.batches_replayed = 0        # batches skipped by the last restore

  def _epoch_batches(self) -> Iterator[Batch]:
    if not self._tf_data:
      self.batches_replayed = 0
      yield from self._make_epoch(self._epoch, self._batch)
      return
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from hypermixer_jax.data import seqio_pipeline  # pylint: disable=g-import-not-at-top
    ds = self._make_epoch(self._epoch)
    blob, self._restore_blob = self._restore_blob, None
    if self._batch and blob is None:  # a state without the iterator
      ds = ds.skip(self._batch)
      self.batches_replayed = self._batch
    self._policy = (ds.options().experimental_external_state_policy
                    or tf.data.experimental.ExternalStatePolicy.WARN)
    self._iterator = iter(ds)
    if blob is not None:
      try:
        seqio_pipeline.restore_iterator(
            self._iterator._iterator_resource,  # pylint: disable=protected-access
            tf.constant(blob))
      except (tf.errors.OpError, ValueError) as e:
        # A state saved by a version with another tf.data graph (e.g. before
        # the options above): resume by skipping the batches taken instead.
        logging.warning(
            "%s:%s: the saved tf.data iterator state does not fit this "
            "pipeline (%s); resuming by skipping %d batches of epoch %d.",
            self._identity["task"], self._identity["split"],
            str(e).splitlines()[0][:200], self._batch, self._epoch)
        self._iterator = iter(self._make_epoch(self._epoch).skip(self._batch))
        self.batches_replayed = self._batch
    try:
      while True:
        try:
          element = next(self._iterator)
        except StopIteration:
          return
        except tf.errors.OpError as e:
          error = seqio_pipeline.translate(e, self._identity)
        else:
          yield {k: v.numpy() for k, v in element.items()}
          continue
        # Raised outside the handler: the error does not carry tf.data's
        # (as its context), whose traceback would keep the failed iterator
        # and its threads alive for as long as the error is kept.
        raise error
    finally:
      self._iterator = None

  def __iter__(self) -> Iterator[Batch]:
    while not self._done:
      yielded = False
      for batch in self._epoch_batches():
        self._batch += 1
        yielded = True
        yield batch
      if not self._repeat:
        self._done = True
        return
      if not yielded and self._batch == 0:
        raise ValueError(
            f"{self._identity['task']}:{self._identity['split']} (shard "
            f"{self._identity['shard_index']}) has fewer examples than one "
            f"batch of {self._identity['batch_size']}.")
      self._epoch += 1
      self._batch = 0

  def restarted(self) -> Pipeline:
    """A new pipeline of the same stream, at its start. For a one-epoch
    unshuffled pipeline (an evaluation's) it reuses the tf.data dataset
    already built, so repeated evaluations do not trace it again."""
    return Pipeline(self._make_epoch, identity=self._identity,
                    repeat=self._repeat, tf_data=self._tf_data)

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable position in the stream (with the tf.data iterator
    state, whose size is that of the shuffle and packing buffers)."""
    state = {**self._identity, "epoch": self._epoch, "batch": self._batch,
             "done": self._done}
    if self._iterator is not None:
      from hypermixer_jax.data import seqio_pipeline  # pylint: disable=g-import-not-at-top
      state["iterator"] = seqio_pipeline.save_iterator(
          self._iterator._iterator_resource, self._policy.value  # pylint: disable=protected-access
      ).numpy().decode()
    elif self._restore_blob is not None:  # restored, not yet iterated
      state["iterator"] = self._restore_blob
    return state

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from ``state`` (from ``get_state`` of the same pipeline)."""
    for k, v in self._identity.items():
      if state.get(k) != v:
        what = ("a data field differs from the run's: files, their paths, "
                "vocabulary, splits; resume with the data config the run was "
                "trained with" if k == "task" else
                f"resume with the {k} the run was trained with")
        per = " (per host)" if k == "batch_size" else ""
        raise DataError(
            f"the checkpoint's input position is for {k}={state.get(k)!r}"
            f"{per}, this run's input pipeline has {k}={v!r} ({what}), or "
            "start "
            "another --workdir from its parameters with "
            "--config.init_checkpoint.")
    self._epoch = int(state["epoch"])
    self._batch = int(state["batch"])
    self._done = bool(state.get("done", False))
    self._restore_blob = state.get("iterator") if self._tf_data else None


def _check_config(cfg: ml_collections.ConfigDict, split: str) -> None:
  name = cfg.task
  if name not in task_specs.TASK_NAMES:
    raise DataError(f"Unknown data.task {name!r}; choose from "
                    f"{task_specs.TASK_NAMES}.")
  if name == "synthetic_pairs":
    try:
      synthetic.check_options(cfg.synthetic)
      synthetic.num_examples(cfg.synthetic, split)
    except ValueError as e:   # one line naming the data.synthetic field
      text = str(e)
      raise DataError(f"data.{text}" if text.startswith("synthetic.")
                      else text) from None
    return
  from hypermixer_jax.data import seqio_pipeline  # pylint: disable=g-import-not-at-top
  seqio_pipeline.check_config(cfg, split)


def check_fits_model(data_config: ml_collections.ConfigDict,
                     model_config: ml_collections.ConfigDict) -> None:
  """Checks at start that what the pipeline emits fits the model.

  Text tasks: the vocabulary is complete, and every id it can emit (pieces,
  EOS, [MASK]/[CLS]/[SEP]) is below ``model.vocab_size``. Classification:
  ``model.num_classes`` covers the task's labels (the readers refuse labels
  outside them); for images, ``model.num_classes >= data.num_classes`` (the
  pipeline refuses a class index outside ``[0, data.num_classes)`` at its
  row). Raises ValueError naming the field and the fix.
  """
  name = data_config.task
  if "vocab_size" in model_config and (name in task_specs.TEXT_TASKS
                                       or name in task_specs.CLASSIFICATION):
    from hypermixer_jax.data import vocab as vocab_lib  # pylint: disable=g-import-not-at-top
    vocab_lib.check_vocab_path(data_config.vocab_path)
    vocab = vocab_lib.get_vocabulary(data_config.vocab_path,
                                     data_config.extra_ids)
    vocab_lib.check_fits_model(vocab, int(model_config.vocab_size))
  if name in task_specs.CLASSIFICATION and "num_classes" in model_config:
    labels = task_specs.CLASSIFICATION[name].label_names
    if int(model_config.num_classes) < len(labels):
      raise ValueError(
          f"model.num_classes={model_config.num_classes} but {name} has "
          f"{len(labels)} labels ({', '.join(labels)}); set "
          f"--config.model.num_classes={len(labels)}.")
  if name == "imagenet_patches" and "num_classes" in model_config:
    if int(model_config.num_classes) < int(data_config.num_classes):
      raise ValueError(
          f"model.num_classes={model_config.num_classes} is below "
          f"data.num_classes={data_config.num_classes} (the class indices "
          "the labels may hold), so the loss would read past the logits; set "
          f"--config.model.num_classes={data_config.num_classes}, or "
          "--config.data.num_classes to the data's number of classes "
          "(class indices outside it stop the pipeline at their row).")


def _synthetic_epoch_fn(cfg, split, *, batch_size, shard_index, num_shards,
                        seed, repeat, shuffle):
  """make_epoch for synthetic_pairs, straight from NumPy (no tf.data)."""
  opts = cfg.synthetic
  n = synthetic.num_examples(opts, split)

  def make_epoch(epoch: int, skip: int) -> Iterator[Batch]:
    if not n:  # endless: this host reads examples shard, shard + hosts, ...
      for b in range(skip, np.iinfo(np.int64).max):
        rows = b * batch_size + np.arange(batch_size)
        yield synthetic.generate(opts, split, rows * num_shards + shard_index)
      return
    arrays = synthetic.split_arrays(opts, split)
    order = (np.random.default_rng([seed, epoch]).permutation(n) if shuffle
             else np.arange(n))[shard_index::num_shards]
    stop = (len(order) // batch_size * batch_size if repeat else len(order))
    for start in range(skip * batch_size, stop, batch_size):
      rows = order[start:start + batch_size]
      yield {k: v[rows] for k, v in arrays.items()}

  return make_epoch


def build_pipeline(data_config: ml_collections.ConfigDict, split: str, *,
                   batch_size: int, shard_index: int = 0, num_shards: int = 1,
                   seed: int, repeat: bool, shuffle: bool) -> Pipeline:
  """Batches of ``data_config.task`` for one host, in CONTRIBUTING.md formats.

  Args:
    data_config: see ``default_data_config()``.
    split: 'train', 'validation' (MNLI also 'validation_matched',
      'validation_mismatched'), 'test'.
    batch_size: rows per batch on this host.
    shard_index, num_shards: this host's shard of the data.
    seed: seeds shuffling, masking and augmentation (the same on all hosts).
    repeat: endless epochs (each reshuffled) with full batches only.
    shuffle: shuffle files and examples.

  Returns:
    A ``Pipeline``: iterable of NumPy batch dicts, with get_state/set_state.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be positive.")
  if not 0 <= shard_index < num_shards:
    raise ValueError(f"shard_index={shard_index} not in [0, {num_shards}).")
  _check_config(data_config, split)
  kwargs = dict(batch_size=batch_size, shard_index=shard_index,
                num_shards=num_shards, seed=seed, repeat=repeat,
                shuffle=shuffle)
  tf_data = data_config.task != "synthetic_pairs"
  if tf_data:
    from hypermixer_jax.data import seqio_pipeline  # pylint: disable=g-import-not-at-top
    fn = seqio_pipeline.epoch_fn
  else:
    fn = _synthetic_epoch_fn
  identity = {"task": task_specs.task_name_for(data_config), "split": split,
              **kwargs}
  make_epoch = fn(data_config, split, **kwargs)
  if tf_data and not repeat and not shuffle:
    # One unshuffled epoch: every iteration of its dataset yields the same
    # batches (seeded, stateless randomness), so ``restarted`` copies reuse
    # the built dataset instead of tracing it again (each evaluation).
    make_epoch = functools.lru_cache(maxsize=1)(make_epoch)
  return Pipeline(make_epoch, identity=identity, repeat=repeat,
                  tf_data=tf_data)
