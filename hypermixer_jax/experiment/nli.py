"""What the pair-task experiments share: the NLI dev files here cut once into
a fixed 80/20 train/test split by premise (QNLI: by question), and the small
GLUE run trained on one side and tested on the other.

``experiments/nli_splits.py`` runs the table; ``pretrain_finetune`` fine-tunes
on the same splits.
"""
from __future__ import annotations

import collections
import json
import os
import pathlib
import tempfile

import numpy as np

from hypermixer_jax import experiment
from hypermixer_jax.experiment import glue

# task -> (file under --shared, text fields of the file)
FILES = {"mnli": ("nli/mnli_dev_matched.jsonl", ("premise", "hypothesis")),
         "snli": ("nli/snli_dev.jsonl", ("premise", "hypothesis")),
         "qnli": ("glue/QNLI/dev.tsv", ("question", "sentence"))}
TEST_FRACTION = 0.2
# The field whose value groups a task's rows: every pair of one premise (or
# QNLI question) falls on the same side of the cut. MNLI and SNLI give each
# premise about three hypotheses, one per label, so a row-level cut would
# put a test pair's premise in train with the other labels: a model (or a
# bag of words) that memorises premises is then pushed below chance on test.
GROUP_BY = {"mnli": "premise", "snli": "premise", "qnli": "question"}
# SentencePiece pieces per task: SNLI's 7,874 train pairs allow at most
# ~4,860 (its short premises repeat), so every task gets 4k.
VOCAB_PIECES = 4000
SMALL = dict(width=128, steps=1000, seq_len=128, lr=1e-3)


def group_keys(lines: list[str], header: str | None, field: str) -> list[str]:
  """The value of ``field`` in each row (JSON lines, or TSV rows under
  ``header``)."""
  if header is None:
    return [json.loads(line)[field] for line in lines]
  columns = header.split("\t")
  if field not in columns:
    raise ValueError(f"nli_splits: no column {field!r} to group the rows by "
                     f"(columns: {columns}).")
  i = columns.index(field)
  return [line.split("\t")[i] for line in lines]


def split_file(source: str, out: pathlib.Path, task: str) -> dict:
  """The fixed 80/20 cut of ``source`` by groups of rows (``GROUP_BY``: all
  pairs of one premise or question on one side; a TSV keeps its header in
  both halves): ``{'train': path, 'test': path, 'rows': {...}, 'groups':
  {...}, 'sha256': {...}}``. Groups are taken in a seeded permutation until
  the test part holds 20% of the rows, so the same source always gives the
  same files; a file already written is kept."""
  src = pathlib.Path(source)
  suffix = src.suffix
  field = GROUP_BY[task]
  paths = {part: out / "splits" / f"{task}_{part}_by_{field}{suffix}"
           for part in ("train", "test")}
  lines = src.read_text(encoding="utf-8").splitlines()
  header = [lines.pop(0)] if suffix == ".tsv" else []
  keys = group_keys(lines, header[0] if header else None, field)
  sizes = collections.Counter(keys)
  groups = sorted(sizes)
  n_test = round(TEST_FRACTION * len(lines))
  test_groups, count = set(), 0
  for g in np.random.default_rng(0).permutation(len(groups)):
    if count >= n_test:
      break
    test_groups.add(groups[g])
    count += sizes[groups[g]]
  parts = {"test": [i for i, k in enumerate(keys) if k in test_groups],
           "train": [i for i, k in enumerate(keys) if k not in test_groups]}
  for part, path in paths.items():
    if not path.exists():
      path.parent.mkdir(parents=True, exist_ok=True)
      # A temporary name of its own per writer: processes sharing one
      # ``--out`` may write the same split at once (the contents are equal).
      with tempfile.NamedTemporaryFile(
          "w", encoding="utf-8", dir=path.parent, prefix=path.name,
          suffix=".tmp", delete=False) as f:
        f.write("\n".join(header + [lines[i] for i in parts[part]]) + "\n")
      os.replace(f.name, path)
  return {"train": str(paths["train"]), "test": str(paths["test"]),
          "rows": {p: len(parts[p]) for p in parts}, "grouped_by": field,
          "groups": {"test": len(test_groups),
                     "train": len(groups) - len(test_groups)},
          "source_sha256": experiment.file_digest(src),
          "sha256": {p: experiment.file_digest(paths[p]) for p in paths}}


def task_config(task: str, mixer: str, split: dict, vocab: dict,
                shared: pathlib.Path, *, seed: int, width: int, steps: int,
                seq_len: int):
  """``glue_from_scratch``'s small-scale run of ``task`` on the split: train
  on its 80%, evaluate (the recorded 'eval') on its 20%."""
  c = glue.glue_config(task, mixer, "small", SMALL["lr"], shared,
                       train_file=split["train"], seed=seed, vocab=vocab,
                       width=width, steps=steps, seq_len=seq_len)
  c.data.local_files.validation = split["test"]
  c.eval_split = "validation"
  return c


def carve_groups(train_file: str, task: str):
  """``selection.carve_lines``' ``group`` for ``task``'s train part: each
  row's premise (QNLI: question), so that a carved validation split shares
  no premise with the rows trained on."""
  path = pathlib.Path(train_file)
  header = (path.read_text(encoding="utf-8").split("\n", 1)[0]
            if path.suffix == ".tsv" else None)
  return lambda rows: group_keys([r.rstrip("\n") for r in rows], header,
                                 GROUP_BY[task])


def tuned_text(task: str) -> dict:
  """What ``glue.report_tuned`` says of ``task``'s tuned runs."""
  return dict(
      title=f"{task.upper()} on its fixed split, every model tuned alike "
      "(small scale)", column=f"{task} 20% test (ours)",
      carved=f"{GROUP_BY[task]} (all its pairs) of the {task.upper()} "
      "train part", reported_on="the {n} pairs of the 20% test part",
      caveat="")
