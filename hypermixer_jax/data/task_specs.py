"""What each task is called and reads, without TensorFlow.

The task names, the classification tasks' specifications, the minimum
``seq_len`` per task and the registry name of the task a config describes
(``task_name_for``). Kept apart from ``tasks`` (the seqio tasks, which need
TensorFlow) so that a run of the synthetic task, which reads no tf.data
pipeline, and a command stopped by a config mistake never import it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Mapping

import ml_collections

from hypermixer_jax.data.config import default_data_config
from hypermixer_jax.data.config import local_files

C4_TFDS = "c4/en:3.*.*"
IMAGENET_TFDS = "imagenet2012:5.*.*"


@dataclasses.dataclass(frozen=True)
class ClassificationSpec:
  """A sentence (pair) classification task."""
  tfds_name: str
  splits: Mapping[str, str]        # our split name -> TFDS split
  keys: tuple[str, ...]            # TFDS features of sentence a (and b)
  columns: tuple[tuple[str, ...], ...]  # local column names of a (and b)
  label_names: tuple[str, ...]
  label_columns: tuple[str, ...] = ("label",)
  drop_unlabelled: bool = False    # SNLI: -1 marks pairs without gold label


_NLI3 = ("entailment", "neutral", "contradiction")
CLASSIFICATION = {
    "glue_sst2": ClassificationSpec(
        "glue/sst2:2.*.*", {"train": "train", "validation": "validation",
                            "test": "test"},
        ("sentence",), (("sentence",),), ("negative", "positive")),
    "glue_mnli": ClassificationSpec(
        "glue/mnli:2.*.*",
        {"train": "train", "validation": "validation_matched",
         "validation_matched": "validation_matched",
         "validation_mismatched": "validation_mismatched",
         "test_matched": "test_matched", "test_mismatched": "test_mismatched"},
        ("premise", "hypothesis"),
        (("premise", "sentence1"), ("hypothesis", "sentence2")), _NLI3,
        ("label", "gold_label")),
    "glue_qnli": ClassificationSpec(
        "glue/qnli:2.*.*", {"train": "train", "validation": "validation",
                            "test": "test"},
        ("question", "sentence"), (("question",), ("sentence",)),
        ("entailment", "not_entailment")),
    "glue_qqp": ClassificationSpec(
        "glue/qqp:2.*.*", {"train": "train", "validation": "validation",
                           "test": "test"},
        ("question1", "question2"), (("question1",), ("question2",)),
        ("not_duplicate", "duplicate"), ("label", "is_duplicate")),
    "glue_snli": ClassificationSpec(
        "snli:1.*.*", {"train": "train", "validation": "validation",
                       "test": "test"},
        ("premise", "hypothesis"),
        (("premise", "sentence1"), ("hypothesis", "sentence2")), _NLI3,
        ("label", "gold_label"), drop_unlabelled=True),
}
TEXT_TASKS = ("c4_mlm", "c4_lm")
TASK_NAMES = TEXT_TASKS + tuple(CLASSIFICATION) + (
    "imagenet_patches", "synthetic_pairs")

# Minimum seq_len per task: MLM needs room for a masked token among several,
# pairs need [CLS] a [SEP] b [SEP] with a word on each side.
MIN_SEQ_LEN = {"c4_mlm": 8, "c4_lm": 2, "glue_sst2": 3, **{
    k: 5 for k in CLASSIFICATION if k != "glue_sst2"}}


def _set_splits(cfg: ml_collections.ConfigDict, fields) -> dict:
  """The TFDS split expressions of ``fields`` that are set (one left unset
  leaves the task's registry name as it was before the field existed)."""
  return {k: cfg[k] for k in fields if cfg.get(k)}


def relevant_fields(cfg: ml_collections.ConfigDict, name: str) -> dict:
  """The config fields that change what task ``name`` produces."""
  if name in TEXT_TASKS or name in CLASSIFICATION:
    rel = {"vocab_path": cfg.vocab_path, "extra_ids": cfg.extra_ids,
           "data_dir": cfg.data_dir, "local_files": local_files(cfg),
           "tfds_train_split": cfg.get("tfds_train_split", ""),
           "allow_empty_inputs": cfg.get("allow_empty_inputs", False)}
    rel.update(_set_splits(cfg, ("tfds_validation_split",)))
    if name in TEXT_TASKS:
      rel["text_layout"] = cfg.get("text_layout", "lines")
    if name == "c4_mlm":
      rel["mlm"] = cfg.mlm.to_dict()
    return rel
  if name.startswith("imagenet_patches"):
    return {"data_dir": cfg.data_dir, "local_files": local_files(cfg),
            **{k: cfg[k] for k in ("image_size", "patch_size",
                                   "min_crop_area", "crop_fraction",
                                   "num_classes")},
            "image_normalization": cfg.get("image_normalization", "imagenet"),
            **_set_splits(cfg, ("tfds_train_split", "tfds_validation_split"))}
  if name == "synthetic_pairs":
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in cfg.synthetic.to_dict().items()}
  raise ValueError(f"Unknown task {name!r}; choose from {TASK_NAMES}.")


def task_name_for(cfg: ml_collections.ConfigDict, name: str | None = None
                  ) -> str:
  """Registry name of the task that ``cfg`` describes."""
  name = name or cfg.task
  rel = relevant_fields(cfg, name)
  if rel == relevant_fields(default_data_config(), name):
    return name
  blob = json.dumps(rel, sort_keys=True, default=str).encode()
  return f"{name}__{hashlib.sha1(blob).hexdigest()[:10]}"
