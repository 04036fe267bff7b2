r"""The HyperMixer paper's pair tasks on the dev files here (Mai et al. §4.3).

Only dev sets of the pair tasks are available offline (``--shared``: MNLI
matched 9,815, SNLI 9,842, QNLI 5,463 pairs; see its SOURCES.md). Each is cut
once into a fixed 80/20 train/test split by premise (QNLI: by question), so
that no premise is on both sides (a seeded permutation of the groups; the
files and their SHA-256 are recorded in results.json), and the paper's
GLUE models are trained on the 80% and tested on the 20%: HyperMixer,
Transformer and MLP-Mixer in the small layout of ``glue_from_scratch``
(width ``--width``, 2 layers, pair length ``--seq_len``), on a 4k
SentencePiece vocabulary per task trained on that task's train split only,
``--steps`` of batch 64 at lr 1e-3, seeds ``--seeds``; beside them a
bag-of-words Naive Bayes and the majority class on the same tokens and
splits, and the paper's test accuracy (models trained on the full train
sets: an upper reference, not a like-for-like number).

  python experiments/nli_splits.py --out=experiments/results/nli_splits

Writes ``results.json``, ``table.md`` and ``nli_splits.png`` (test accuracy
against step, mean over seeds, per task) into ``--out``; ``--report_only``
writes them from the runs recorded so far.
"""
from __future__ import annotations

import collections
import json
import pathlib

import numpy as np

import glue_from_scratch as glue
from hypermixer_jax import experiment

MODELS = ("hypermixer", "attention", "mlp_mixer")
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
      tmp = path.with_name(path.name + ".tmp")
      tmp.write_text("\n".join(header + [lines[i] for i in parts[part]])
                     + "\n", encoding="utf-8")
      tmp.replace(path)
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


def main() -> None:
  p = experiment.parser("nli_splits", __doc__, report_only=True,
                        models=MODELS, seeds="0,1,2", steps=SMALL["steps"])
  p.add_argument("--tasks", default=",".join(FILES))
  p.add_argument("--width", type=int, default=SMALL["width"])
  p.add_argument("--seq_len", type=int, default=SMALL["seq_len"])
  args = experiment.parse(p)
  exp = experiment.Experiment(args.out, args)
  shared = pathlib.Path(args.shared)
  tasks, models = experiment.split(args.tasks), experiment.split(args.models)
  seeds = experiment.split(args.seeds, int)
  # "_g": the cut by premise / question (the first runs' row-level cut put
  # test premises in train; its cells are not comparable).
  budget = f"w{args.width}_s{args.steps}_n{args.seq_len}_g"
  splits = exp.data.setdefault("splits", {})
  acc: dict[tuple, list] = {}
  for task in tasks:
    file, fields = FILES[task]
    split = split_file(experiment.require(shared / file, f"{task} dev file"),
                       exp.out, task)
    vocab = experiment.small_vocab(
        exp.out / f"{task}_by_{split['grouped_by']}", split["train"], fields,
        VOCAB_PIECES, store_dir=exp.vocab_store,
        digest=splits.get(task, {}).get("vocab"))
    splits[task] = dict(split, vocab=vocab["sha256"], source=file)
    exp.save()

    def config(model, seed, task=task, split=split, vocab=vocab):
      return task_config(task, model, split, vocab, shared, seed=seed,
                         width=args.width, steps=args.steps,
                         seq_len=args.seq_len)
    exp.baseline(f"{task}/{budget}", lambda config=config:
                 glue.bag_of_words_baselines(config(models[0], seeds[0])))
    runs = exp.cells(
        f"{budget}/task={task}", experiment.grid(model=models, seed=seeds),
        lambda cell, key, config=config: glue.run_cell(
            exp, config(cell["model"], cell["seed"]), key))
    acc.update({(task, model): r for model, r in runs.items()})
  _report(exp, args, tasks, models, budget, acc)


def _report(exp, args, tasks, models, budget, acc) -> None:
  rows = []
  for mixer in models:
    row = [glue.LABELS[mixer]]
    for task in tasks:
      final = [r["eval"]["accuracy"] for r in acc.get((task, mixer), [])]
      hyper = [r["eval"]["accuracy"] for r in acc.get((task, "hypermixer"),
                                                      [])]
      b = exp.data["baselines"].get(f"{task}/{budget}") or {}
      n_eval = b.get("dev_rows")
      row += [experiment.fmt_mean_sd(final, 100) or "not run",
              glue.PAPER[mixer][task],
              glue.hypermixer_above(task, mixer, hyper, final, n_eval),
              experiment.against_baseline(
                  final, b["naive_bayes"], n_eval=n_eval).text(100)
              if b and final else ""]
    rows.append(row)
  for name, label in (("naive_bayes", "Naive Bayes (bag of tokens)"),
                      ("majority", "majority class")):
    row = [label]
    for task in tasks:
      b = exp.data["baselines"].get(f"{task}/{budget}")
      row += [f"{100 * b[name]:.1f}" if b else "", "", "", ""]
    rows.append(row)
  headers = ["model"]
  for task in tasks:
    headers += [f"{task} 20% test (ours)", f"{task} test (paper)",
                "HyperMixer above it?", "vs Naive Bayes"]
  cuts = "; ".join(
      f"{t}: {s['rows']['train']:,} / {s['rows']['test']:,} rows by "
      f"{s.get('grouped_by', 'row')} of "
      f"{s['source']} (sha256 {s['source_sha256'][:12]}..., train "
      f"{s['sha256']['train'][:12]}..., test {s['sha256']['test'][:12]}...)"
      for t, s in exp.data["splits"].items() if t in tasks)
  exp.write_table(
      "Pair tasks on fixed 80/20 splits of the dev files (small scale)",
      experiment.markdown_table(headers, rows),
      f"Accuracy on the 20% test part at the last step, mean ± sd over seeds "
      f"{args.seeds}; width-{args.width} 2-layer models, pair length "
      f"{args.seq_len}, {args.steps} steps of batch 64, lr {SMALL['lr']:g}, "
      f"a {VOCAB_PIECES // 1000}k SentencePiece vocabulary per task trained on "
      "its train part. "
      f"Cuts: {cuts}. Paper: test accuracy of the ~11M models trained on "
      "the full train sets (not comparable in absolute value). "
      + experiment.VERDICT_NOTE)
  fig, axes = experiment.figure(ncols=len(tasks))
  for ax, task in zip(axes[0], tasks):
    for i, mixer in enumerate(models):
      if acc.get((task, mixer)):
        steps, values = experiment.mean_curve(acc[task, mixer], "accuracy",
                                              100)
        ax.plot(steps, values.mean(0), marker="o", ms=3, color=f"C{i}",
                label=f"{glue.LABELS[mixer]} (n={len(values)})")
    b = exp.data["baselines"].get(f"{task}/{budget}")
    if b:
      experiment.baseline_lines(ax, {"Naive Bayes": 100 * b["naive_bayes"]})
    experiment.style_axes(ax, "step", "test accuracy (%)", title=task,
                          legend=6)
  exp.save_figure(fig, "nli_splits")


if __name__ == "__main__":
  main()
