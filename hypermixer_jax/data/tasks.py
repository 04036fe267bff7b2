"""All seqio tasks of hypermixer-jax, registered in this one module.

| name | data | features |
| --- | --- | --- |
| ``c4_mlm`` | TFDS ``c4/en`` or local text | BERT-masked ``inputs``, ``targets``, ``weights`` |
| ``c4_lm`` | TFDS ``c4/en`` or local text | ``targets`` (causal LM) |
| ``glue_sst2``, ``glue_mnli``, ``glue_qnli``, ``glue_qqp``, ``glue_snli`` | TFDS ``glue/*``, ``snli`` or local TSV/JSONL | ``inputs``, ``token_type_ids``, ``label`` |
| ``imagenet_patches`` (+ ``_train`` with augmentation) | TFDS ``imagenet2012`` or a local labels TSV | ``inputs`` patches, ``label`` |
| ``synthetic_pairs`` | generated (``synthetic.py``) | ``inputs``, ``targets``, ``weights`` |

The tasks registered at import use ``default_data_config()``. A config that
changes what a task reads (vocabulary, data_dir, local files, masking,
image or synthetic options) gets its own task, registered on first use by
``get_task`` under ``<name>__<fingerprint>``.
"""
from __future__ import annotations

import functools

import ml_collections
import numpy as np
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from hypermixer_jax.data import images
from hypermixer_jax.data import metrics
from hypermixer_jax.data import preprocessors as prep
from hypermixer_jax.data import sources
from hypermixer_jax.data import synthetic
from hypermixer_jax.data import vocab as vocab_lib
from hypermixer_jax.data.config import default_data_config
from hypermixer_jax.data.config import local_files
# The names and specifications of the tasks (importable without TensorFlow).
from hypermixer_jax.data.task_specs import C4_TFDS
from hypermixer_jax.data.task_specs import CLASSIFICATION
from hypermixer_jax.data.task_specs import ClassificationSpec  # noqa: F401
from hypermixer_jax.data.task_specs import IMAGENET_TFDS
from hypermixer_jax.data.task_specs import MIN_SEQ_LEN  # noqa: F401
from hypermixer_jax.data.task_specs import TASK_NAMES
from hypermixer_jax.data.task_specs import TEXT_TASKS
from hypermixer_jax.data.task_specs import task_name_for


def _source(cfg, tfds_name, splits, make_reader, decoders=None):
  """Local files when any is set (``make_reader(format)`` reads them), else
  the TFDS dataset."""
  if local_files(cfg):
    return sources.local_source(local_files(cfg), make_reader,
                                by_format=True)
  for split in ("train", "validation"):
    if cfg.get(f"tfds_{split}_split"):
      splits = {**splits, split: cfg[f"tfds_{split}_split"]}
  return sources.tfds_source(tfds_name, cfg.data_dir, splits, decoders)


def _text_task(name: str, task_name: str, cfg, shard_index: int = 0
               ) -> seqio.Task:
  vocab = vocab_lib.get_vocabulary(cfg.vocab_path, cfg.extra_ids)
  mlm = name == "c4_mlm"
  source = _source(cfg, C4_TFDS, {"train": "train", "validation": "validation"},
                   lambda fmt: sources.local_reader(
                       fmt, {"text": ("text",)},
                       text_layout=cfg.get("text_layout", "lines"),
                       allow_empty_inputs=cfg.get("allow_empty_inputs",
                                                  False)))
  steps = [functools.partial(prep.rekey, key_map={"text": "text"}),
           functools.partial(prep.tokenize_text, append_eos=not mlm),
           prep.split_into_chunks]
  features = {"targets": seqio.Feature(vocab, add_eos=not mlm)}
  if mlm:
    # The mask ids need the vocabulary's size, read lazily inside the map.
    steps.append(functools.partial(_mask_with_vocab, vocab=vocab,
                                   shard_index=shard_index,
                                   **cfg.mlm.to_dict()))
    features["inputs"] = seqio.Feature(vocab, add_eos=False)
    features["weights"] = seqio.ContinuousFeature(dtype=tf.int32, rank=1)
  return seqio.Task(task_name, source, output_features=features,
                    preprocessors=steps)


def _mask_with_vocab(ds, vocab, select_rate, mask_token_rate,
                     random_token_rate, shard_index=0):
  ids = vocab_lib.special_ids(vocab)
  return prep.mask_tokens(ds, shard_index=shard_index, mask_id=ids.mask,
                          first_regular=ids.first_regular,
                          num_regular=ids.num_regular, select_rate=select_rate,
                          mask_token_rate=mask_token_rate,
                          random_token_rate=random_token_rate)


def _classification_task(name: str, task_name: str, cfg) -> seqio.Task:
  spec = CLASSIFICATION[name]
  vocab = vocab_lib.get_vocabulary(cfg.vocab_path, cfg.extra_ids)
  text_keys = ("text_a", "text_b")[:len(spec.keys)]
  fields = {**dict(zip(text_keys, spec.columns)), "label": spec.label_columns}
  source = _source(cfg, spec.tfds_name, spec.splits,
                   lambda fmt: sources.local_reader(
                       fmt, fields, spec.label_names,
                       allow_unlabelled=spec.drop_unlabelled,
                       allow_empty_inputs=cfg.get("allow_empty_inputs",
                                                  False)))
  steps = [functools.partial(prep.rekey, key_map={
      **{k: (v if not local_files(cfg) else k)
         for k, v in zip(text_keys, spec.keys)}, "label": "label"})]
  if spec.drop_unlabelled:
    steps.append(prep.drop_negative_labels)
  steps.append(functools.partial(_encode_with_vocab, vocab=vocab,
                                 keys=text_keys))
  return seqio.Task(
      task_name, source,
      output_features={
          "inputs": seqio.Feature(vocab, add_eos=False),
          "token_type_ids": seqio.ContinuousFeature(dtype=tf.int32, rank=1),
          "label": seqio.ContinuousFeature(dtype=tf.int32, rank=0)},
      preprocessors=steps,
      metric_fns=[getattr(metrics, m) for m in metrics.metric_names(name)])


def _encode_with_vocab(ds, sequence_length, output_features, vocab, keys):
  ids = vocab_lib.special_ids(vocab)
  return prep.encode_pair(ds, sequence_length, output_features,
                          cls_id=ids.cls, sep_id=ids.sep, keys=keys)


def _image_task(name: str, task_name: str, cfg, shard_index: int = 0
                ) -> seqio.Task:
  source = _source(cfg, IMAGENET_TFDS,
                   {"train": "train", "validation": "validation"},
                   lambda fmt: sources.image_reader(cfg.num_classes),
                   decoders={"image": tfds.decode.SkipDecoding()})
  # Error messages name the example: file:line (image) of the labels TSV,
  # or the TFDS record's file name.
  local = bool(local_files(cfg))
  key_map = {"image": "image", "label": "label",
             "source": "source" if local else "file_name"}
  steps = [functools.partial(prep.rekey, key_map=key_map),
           functools.partial(images.preprocess,
                             train=name.endswith("_train"),
                             image_size=cfg.image_size,
                             patch_size=cfg.patch_size,
                             min_crop_area=cfg.min_crop_area,
                             crop_fraction=cfg.crop_fraction,
                             num_classes=cfg.num_classes,
                             normalization=cfg.get("image_normalization",
                                                   "imagenet"),
                             source_prefix="" if local else
                             f"TFDS {IMAGENET_TFDS} record file_name=",
                             shard_index=shard_index)]
  return seqio.Task(
      task_name, source,
      output_features={
          "inputs": seqio.ContinuousFeature(dtype=tf.float32, rank=2),
          "label": seqio.ContinuousFeature(dtype=tf.int32, rank=0)},
      preprocessors=steps, metric_fns=[metrics.accuracy])


def _synthetic_task(task_name: str, cfg) -> seqio.Task:
  opts = ml_collections.ConfigDict(cfg.synthetic.to_dict())

  def dataset_fn(split, shuffle_files, seed=None):
    del shuffle_files, seed  # the Task's seeded shuffle orders the examples
    n = synthetic.num_examples(opts, split)
    if n:
      return tf.data.Dataset.from_tensor_slices(
          synthetic.generate(opts, split, np.arange(n)))
    blocks = tf.data.Dataset.counter().map(
        lambda b: tf.numpy_function(
            lambda i: tuple(synthetic.generate(
                opts, split, np.arange(i * synthetic.BLOCK,
                                       (i + 1) * synthetic.BLOCK)).values()),
            [b], (tf.float32,) * 3))
    return blocks.map(lambda x, y, w: {"inputs": x, "targets": y,
                                       "weights": w}).unbatch()

  return seqio.Task(
      task_name, seqio.FunctionDataSource(dataset_fn, splits=list(synthetic.STREAMS)),
      output_features={
          "inputs": seqio.ContinuousFeature(dtype=tf.float32, rank=2),
          "targets": seqio.ContinuousFeature(dtype=tf.float32, rank=2),
          "weights": seqio.ContinuousFeature(dtype=tf.float32, rank=1)})


def _build(name: str, task_name: str, cfg, shard_index: int) -> seqio.Task:
  if name in TEXT_TASKS:
    return _text_task(name, task_name, cfg, shard_index)
  if name in CLASSIFICATION:
    return _classification_task(name, task_name, cfg)
  if name.startswith("imagenet_patches"):
    return _image_task(name, task_name, cfg, shard_index)
  return _synthetic_task(task_name, cfg)


def get_task(cfg: ml_collections.ConfigDict, name: str | None = None, *,
             shard_index: int = 0) -> seqio.Task:
  """The seqio Task for ``cfg`` (registering it on first use);
  ``shard_index``: the host reading it, whose random masks and crops are
  its own (``preprocessors.for_host``)."""
  name = name or cfg.task
  task_name = task_name_for(cfg, name) + (
      f"__host{shard_index}" if shard_index else "")
  if task_name not in seqio.TaskRegistry.names():
    seqio.TaskRegistry.add_provider(task_name, _build(name, task_name, cfg,
                                                      shard_index))
  return seqio.get_mixture_or_task(task_name)


def _register_defaults() -> None:
  cfg = default_data_config()
  for name in TASK_NAMES + ("imagenet_patches_train",):
    get_task(cfg, name)


_register_defaults()
