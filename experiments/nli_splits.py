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

``--tune``: every model tuned alike on each task, its learning rate and
warm-up chosen among ``selection.settings`` on every 10th premise (QNLI:
question) of the train part with all its pairs (seed 100), then the seeds at
each model's choice trained on the rest of the train part and scored on the
test part: ``table_tuned_<task>.md``; ``--budget_check=500`` also trains
each model's choice for 500 steps on the carved premises and records the
length the rule (the best model above Naive Bayes) picks there.
"""
from __future__ import annotations

import pathlib

from hypermixer_jax import experiment
from hypermixer_jax.experiment import glue
from hypermixer_jax.experiment import nli

MODELS = ("hypermixer", "attention", "mlp_mixer")


def main() -> None:
  p = experiment.parser("nli_splits", __doc__, report_only=True,
                        models=MODELS, seeds="0,1,2",
                        steps=nli.SMALL["steps"])
  p.add_argument("--tasks", default=",".join(nli.FILES))
  p.add_argument("--width", type=int, default=nli.SMALL["width"])
  p.add_argument("--seq_len", type=int, default=nli.SMALL["seq_len"])
  experiment.tune_flags(p, "premises", table="table_tuned_<task>.md",
                        budget_check=True)
  args = experiment.parse(p)
  experiment.check_tune(args, "each task's train part")
  experiment.check_budget(args)
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
    file, fields = nli.FILES[task]
    split = nli.split_file(
        experiment.require(shared / file, f"{task} dev file"), exp.out, task)
    vocab = experiment.small_vocab(
        exp.out / f"{task}_by_{split['grouped_by']}", split["train"], fields,
        nli.VOCAB_PIECES, store_dir=exp.vocab_store,
        digest=splits.get(task, {}).get("vocab"))
    splits[task] = dict(split, vocab=vocab["sha256"], source=file)
    exp.save()

    def config(model, seed, steps=None, task=task, split=split,
               vocab=vocab):
      return nli.task_config(task, model, split, vocab, shared, seed=seed,
                             width=args.width, steps=steps or args.steps,
                             seq_len=args.seq_len)
    if args.tune:
      _tune(exp, args, task, models, seeds, config, budget, split)
      continue
    exp.baseline(f"{task}/{budget}", lambda config=config:
                 glue.bag_of_words_baselines(config(models[0], seeds[0])))
    runs = exp.cells(
        f"{budget}/task={task}", experiment.grid(model=models, seed=seeds),
        lambda cell, key, config=config: glue.run_cell(
            exp, config(cell["model"], cell["seed"]), key))
    acc.update({(task, model): r for model, r in runs.items()})
  if not args.tune:
    _report(exp, args, tasks, models, budget, acc)


def _tune(exp, args, task, models, seeds, config, budget, split) -> None:
  """``--tune`` on ``task``: the search on premises carved from the train
  part, the seeds at each model's choice (``glue.tune``) and
  ``--budget_check``'s lengths (``glue.budget_check``; ``config(model,
  seed, steps)``)."""
  search = experiment.split(args.lrs, float) or None
  prefix = f"{budget}/task={task}/"
  tuned = glue.tune(exp, models, seeds, config, args.steps, prefix,
                    split["train"], search,
                    reverse=args.order == "reverse", task=task,
                    group=nli.carve_groups(split["train"], task))
  lengths = experiment.split(args.budget_check, int)
  check = glue.budget_check(exp, prefix, tuned, models, lengths,
                            args.steps, config) if lengths else None
  glue.report_tuned(exp, models, args.seeds, args.steps, tuned, search,
                    task=task, text=nli.tuned_text(task),
                    name=f"table_tuned_{task}", check=check)


def _report(exp, args, tasks, models, budget, acc) -> None:
  rows = []
  for mixer in models:
    row = [glue.LABELS[mixer]]
    for task in tasks:
      final, hyper = ([r["eval"]["accuracy"] for r in acc.get((task, m), [])]
                      for m in (mixer, "hypermixer"))
      b = exp.data["baselines"].get(f"{task}/{budget}") or {}
      n_eval = b.get("dev_rows")
      row += [experiment.fmt_mean_sd(final, 100) or "not run",
              glue.PAPER[mixer][task],
              glue.hypermixer_above(task, mixer, hyper, final, n_eval,
                                    untuned=True),
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
      experiment.UNTUNED_NOTE
      + f"Accuracy on the 20% test part at the last step, mean ± sd over seeds "
      f"{args.seeds}; width-{args.width} 2-layer models, pair length "
      f"{args.seq_len}, {args.steps} steps of batch 64, "
      f"lr {nli.SMALL['lr']:g}, a {nli.VOCAB_PIECES // 1000}k SentencePiece "
      "vocabulary per task trained on its train part. "
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
