r"""Low-resource training: HyperMixer against the Transformer (Mai et al. §4.5).

The paper trains on 10% ... 100% of MNLI, SNLI and QQP with each model's best
grid-search learning rate and reports HyperMixer's relative improvement over
the Transformer: ~12-14% at 10% of SNLI/MNLI, < 2% at 100%.

  --scale=paper  MNLI, SNLI, QQP from TFDS (``--data_dir``), the ~11M models,
                 fractions 10/20/50/100% of train (``data.tfds_train_split``
                 slices), seeds ``--seeds``; at each fraction each model's lr
                 (the paper's grid) and warm-up chosen on the fraction's first
                 tenth (``glue.tune_tfds``), the seeds trained on the rest and
                 scored on dev at their last step.
  --scale=small  the real SST-2 files in ``--shared`` (the only GLUE train split
                 available offline) on the 8k SST-2 vocabulary of
                 ``glue_from_scratch``, two-layer GLUE models of ``--width``,
                 fractions 10% (a fixed random subset, written as TSV into
                 ``--out``) and 100% of the 67,349 phrases (the runs of
                 ``glue_from_scratch``'s main grid, adopted when recorded),
                 ``--steps`` of batch 64 each (the same compute at every
                 fraction), seeds ``--seeds``; a bag-of-words Naive Bayes on
                 the same subset and tokens beside them.

  python experiments/low_resource.py --scale=small \
      --out=experiments/results/low_resource

``--tune`` (small scale): both models tuned alike at 10%, their learning
rate and warm-up chosen among ``selection.settings`` on the 10% subset's
phrases of every 10th SST-2 sentence (``glue.sentence_groups``; seed 100),
then the seeds at each model's choice trained on the rest of the subset and
scored on dev: ``table_tuned.md``; ``--budget_check=500`` also trains each
model's choice for 500 steps on the carved phrases and records the length
the rule (the best model above Naive Bayes) picks there. (At 100% the
same search is ``glue_from_scratch --tune``'s.)

Writes ``results.json``, ``table.md`` and ``low_resource.png``.
"""
from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np

from hypermixer_jax import experiment
from hypermixer_jax.experiment import glue
from hypermixer_jax.experiment import vocab as vocab_store

MODELS = ("hypermixer", "attention")
PAPER_LRS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3)
PAPER_10PCT = "SNLI/MNLI: +12-14% relative at 10% of train, < 2% at 100%"


def glue_vocab(exp: experiment.Experiment) -> experiment.Experiment:
  """``exp`` with ``glue_from_scratch``'s vocabulary (in its directory beside
  ``exp.out``, restored from the store by the digest it recorded when its
  working copy is missing) copied in: SentencePiece's training is not
  bit-reproducible, and the same file makes the full-set cells its runs."""
  name = f"spm{glue.VOCAB_PIECES}.model"
  source = exp.out.parent / "glue_from_scratch" / "vocab" / name
  ours = exp.out / "vocab" / name
  results = source.parent.parent / "results.json"
  if not source.exists() and results.exists():
    digest = json.loads(results.read_text()).get("vocab", {}).get("sha256")
    if digest:
      vocab_store.restore(digest, exp.vocab_store, source)
  if source.exists() and not ours.exists():
    ours.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, ours)
  return exp


def glue_run(exp: experiment.Experiment, key: str, config, cell: dict,
             budget: dict, lr: float, shared: pathlib.Path) -> None:
  """All of SST-2 is ``glue_from_scratch``'s main grid: its run of the same
  model, seed and budget (in its directory beside ``exp.out``) is adopted
  when its config, vocabulary file included, is this cell's."""
  source = exp.out.parent / "glue_from_scratch"
  spm = source / "vocab" / f"spm{glue.VOCAB_PIECES}.model"
  if not spm.exists():
    return
  vocab = dict(path=str(spm), model_vocab_size=config.model.vocab_size)
  source_config = glue.glue_config("sst2", cell["model"], "small", lr, shared,
                                   seed=cell["seed"], vocab=vocab, **budget)
  exp.adopt(key, config, source, experiment.cell_key(
      glue.budget_tag(**budget),
      dict(task="sst2", model=cell["model"], lr=lr, seed=cell["seed"])),
            source_config)


def main() -> None:
  p = experiment.parser("low_resource", __doc__, report_only=True,
                        data_dir="", seeds="0,1,2", steps=glue.SMALL["steps"])
  p.add_argument("--width", type=int, default=glue.SMALL["width"])
  experiment.tune_flags(p, "sentences (with their phrases) of the 10% subset",
                        budget_check=True)
  args = experiment.parse(p)
  experiment.check_tune(args, "the SST-2 subset")
  experiment.check_budget(args)
  exp = experiment.Experiment(args.out, args)
  shared = pathlib.Path(args.shared)
  if args.tune:
    _tune(exp, args, shared)
    return
  if args.scale == "paper":
    tasks, fractions, seeds, acc = _paper_runs(exp, args, shared)
  else:
    tasks, fractions, seeds, acc = _small_runs(exp, args, shared)
  _report(exp, args, tasks, fractions, seeds, acc)


def _paper_runs(exp, args, shared):
  """The paper's grid on TFDS: (tasks, fractions, seeds, accuracies), each
  model at the setting chosen on the fraction's carved first tenth, its
  seeds scored on dev at their last step."""
  acc = {}
  tasks, fractions = ("mnli", "snli", "qqp"), (0.1, 0.2, 0.5, 1.0)
  seeds = experiment.split(args.seeds, int)
  for task in tasks:
    for fraction in fractions:
      _, _, _, runs = glue.tune_tfds(
          exp, MODELS, seeds, lambda m, s, task=task: glue.glue_config(
              task, m, "paper", PAPER_LRS[0], shared, args.data_dir, seed=s),
          f"{task}/{round(100 * fraction)}pct/", PAPER_LRS,
          fraction=fraction, reverse=args.order == "reverse")
      acc.update(((task, fraction, m, r["seed"]), r["eval"]["accuracy"])
                 for m in runs for r in runs[m])
  return tasks, fractions, seeds, acc


def _small_runs(exp, args, shared):
  """SST-2 at 10% and 100% here: (tasks, fractions, seeds, accuracies)."""
  acc = {}
  tasks, fractions = ("sst2",), (0.1, 1.0)
  seeds = experiment.split(args.seeds, int)
  budget = dict(steps=args.steps, width=args.width, seq_len=64)
  lr = glue.SMALL["lr"]
  vocab = glue.sst2_vocab(glue_vocab(exp), shared)
  tag = f"w{args.width}_s{args.steps}"
  train = experiment.require(shared / "glue/SST-2/train.tsv", "SST-2 train")
  for cell in experiment.grid(fraction=fractions, model=MODELS, seed=seeds):
    fraction, mixer, seed = cell["fraction"], cell["model"], cell["seed"]
    file = glue.subset_tsv(train, fraction, exp.out) if fraction < 1 else None
    cfg = glue.glue_config("sst2", mixer, "small", lr, shared,
                           train_file=file, seed=seed, vocab=vocab, **budget)
    exp.baseline(f"{fraction:g}",   # Naive Bayes on the same subset
                 lambda c=cfg: glue.bag_of_words_baselines(c))
    key = experiment.cell_key(tag, cell)
    if fraction == 1:
      glue_run(exp, key, cfg, cell, budget, lr, shared)
    result = exp.cell(key, lambda c=cfg, k=key: experiment.train(
        c, exp.workdir(k)))
    if result is not None:
      acc["sst2", fraction, mixer, seed] = result["eval"]["accuracy"]
  return tasks, fractions, seeds, acc


def _tune(exp, args, shared, fraction: float = 0.1) -> None:
  """``--tune``: both models' search on sentences carved from the subset at
  ``fraction``, then the seeds at each one's choice (``glue.tune``), and
  ``--budget_check``'s lengths (``glue.budget_check``)."""
  vocab = glue.sst2_vocab(glue_vocab(exp), shared)
  subset = glue.subset_tsv(glue.sst2_train(shared), fraction, exp.out)
  search = experiment.split(args.lrs, float) or None
  pct = f"{round(100 * fraction)}pct"
  prefix = f"w{args.width}_s{args.steps}/fraction={fraction:g}/"

  def config(m, s, steps=None):
    return glue.glue_config(
        "sst2", m, "small", glue.SMALL["lr"], shared, train_file=subset,
        seed=s, vocab=vocab, steps=steps or args.steps, width=args.width,
        seq_len=64)
  tuned = glue.tune(
      exp, MODELS, experiment.split(args.seeds, int), config, args.steps,
      prefix, subset, search, reverse=args.order == "reverse",
      task=f"sst2_{pct}", group=glue.sentence_groups(glue.sst2_train(shared)))
  lengths = experiment.split(args.budget_check, int)
  check = glue.budget_check(exp, prefix, tuned, MODELS, lengths, args.steps,
                            config) if lengths else None
  glue.report_tuned(exp, MODELS, args.seeds, args.steps, tuned, search,
                    check=check,
                    text=dict(glue.SST2_TUNED, title=(
                        f"Low resource: SST-2 at {fraction:.0%}, both models "
                        "tuned alike (small scale)"),
                              carved=f"sentence (with all its phrases) of "
                              f"the {fraction:.0%} subset of the SST-2 train "
                              "TSV", paper=False))


def _report(exp, args, tasks, fractions, seeds, acc) -> None:
  rows = []
  for task in tasks:
    for fraction in fractions:
      vals = {m: [acc[task, fraction, m, s] for s in seeds
                  if (task, fraction, m, s) in acc] for m in MODELS}
      mean = {m: float(np.mean(v)) for m, v in vals.items()}
      rel = (mean["hypermixer"] - mean["attention"]) / mean["attention"]
      nb = exp.data.get("baselines", {}).get(f"{fraction:g}")
      rows.append([task, f"{fraction:.0%}"]
                  + [experiment.fmt_mean_sd(vals[m], 100) for m in MODELS]
                  + [f"{100 * rel:+.1f}%",
                     experiment.verdict(
                         vals["hypermixer"], vals["attention"], "higher",
                         n_eval=nb["dev_rows"] if nb else None,
                         untuned=args.scale == "small").text(100),
                     f"{100 * nb['naive_bayes']:.1f}" if nb else "",
                     experiment.against_baseline(
                         vals["hypermixer"], nb["naive_bayes"],
                         n_eval=nb["dev_rows"]).text(100) if nb else ""])
  setting = (f"mean ± sd over seeds {list(seeds)}; width-{args.width} "
             f"2-layer models on the 8k SST-2 vocabulary, {args.steps} steps "
             f"of batch 64, lr {glue.SMALL['lr']:g}; Naive Bayes on the same "
             "subset and tokens" if args.scale == "small" else
             f"mean ± sd over seeds {list(seeds)}; each model's lr (grid "
             f"{list(PAPER_LRS)}) and warm-up chosen on the first tenth of "
             "each fraction, carved from train (dev never read in the "
             "choice; held-out pairs can share premises with training "
             "ones), the seeds trained on the other nine tenths (9% ... 90% "
             "of train)")
  exp.write_table(
      f"Low resource: dev accuracy ({args.scale} scale)",
      experiment.markdown_table(
          ["task", "train fraction", "HyperMixer", "Transformer",
           "relative improvement", "HyperMixer above (paper: yes)",
           "Naive Bayes", "HyperMixer vs Naive Bayes"], rows),
      (experiment.UNTUNED_NOTE if args.scale == "small" else "")
      + f"{setting}. Paper: {PAPER_10PCT}. {experiment.VERDICT_NOTE}")
  fig, axes = experiment.figure()
  ax = axes[0, 0]
  for task in tasks:
    for mixer in MODELS:
      ys = [100 * np.mean([acc[task, f, mixer, s] for s in seeds
                           if (task, f, mixer, s) in acc]) for f in fractions]
      ax.plot([100 * f for f in fractions], ys, marker="o",
              label=f"{glue.LABELS[mixer]} ({task})")
  experiment.style_axes(ax, "% of SST-2 train", "dev accuracy (%)",
                        xscale="log", legend=10)
  exp.save_figure(fig, "low_resource")


if __name__ == "__main__":
  main()
