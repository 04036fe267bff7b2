r"""Tuning cost: expected validation performance vs trials (Mai et al. §4.6).

Random search with log10(lr) ~ U(-8, -1) and dropout ~ U(0, 0.5), the same
trials for HyperMixer and the Transformer; the expected best validation
accuracy after n trials (Dodge et al. 2019) is computed from the empirical
distribution of the trials: with accuracies v_(1) <= ... <= v_(T),

    E[max of n] = sum_i v_(i) [ (i/T)^n - ((i-1)/T)^n ].

The paper (20 trials) finds HyperMixer's curve above the Transformer's: it
needs fewer trials for the same expected accuracy. One trial is one draw, so
the spread of a curve is that of its draws: a bootstrap over the trials
(resampled with replacement, the same resample for both models, since they
share the draws) describes the gap at each n with a 95% interval, and
"HyperMixer above?" is decided by a paired permutation test of the gap
(each draw's two scores swapped at random; exact at every n, where the
bootstrap of a maximum is not): "agrees" / "disagrees" where p < 0.05.

  --scale=paper  ``--trials`` (20) of the ~11M models on a GLUE task from
                 TFDS.
  --scale=small  ``--trials`` (20) of the SST-2 models of
                 ``glue_from_scratch`` (width 128, 2 layers, length 64, the
                 8k SentencePiece vocabulary of the SST-2 train phrases,
                 ``--steps`` of batch 64) on the real SST-2 files in
                 ``--shared``, beside Naive Bayes on the same tokens.

  python experiments/tuning_cost.py --scale=small --out=experiments/results/tuning_cost

Two processes on one ``--out`` can split the study with ``--models=hypermixer``
and ``--models=attention`` (the report pairs the draws recorded for both); a
process with ``--order=reverse`` takes the draws from the end, so that two
processes on the same model meet halfway instead of waiting on each other.

``--carve`` (small scale): nothing is chosen on dev. Each trial trains on
the SST-2 train phrases less every 10th sentence's and is scored on those
(``glue.carve``), so the curves are of validation accuracy; once every draw
is recorded for both models, each model's best draw trains seeds 0 and
``--best_seeds`` (1, 2) on the same phrases, scored on dev
(``table_carved.md``): the top of its curve, over seeds, tested by Welch.
Without ``--carve`` the curves are of dev accuracy and no draw is trained
again (it would be chosen on the sentences it is scored on).

The gap's interval and test carry the evaluation sentences' binomial noise
beside the draws' (``tuning`` module).

Writes ``results.json``, ``table.md`` and ``tuning_cost.png``.
"""
from __future__ import annotations

import pathlib

import numpy as np

from hypermixer_jax import experiment
from hypermixer_jax.experiment import glue
from hypermixer_jax.experiment import selection
from hypermixer_jax.experiment import tuning

MODELS = ("hypermixer", "attention")
TRIALS = 20


def run_trial(config, workdir: str) -> dict:
  """One trial; a run stopped by the loop's NaN guard scores 0."""
  out = dict(lr=config.learning_rate, dropout=config.model.dropout_rate)
  try:
    out.update(experiment.train(config, workdir))
  except FloatingPointError as e:  # the loop refuses to go on with NaN
    out.update(eval={"accuracy": 0.0}, diverged=str(e).splitlines()[0])
  return out


def _parser():
  p = experiment.parser("tuning_cost", __doc__, report_only=True,
                        data_dir="", steps=glue.SMALL["steps"], models=MODELS)
  p.add_argument("--task", default="sst2")
  p.add_argument("--trials", type=int, default=TRIALS)
  p.add_argument("--best_seeds", default="1,2",
                 help="with --carve, once every draw is recorded, each "
                      "model's best draw is trained again with seed 0 and "
                      "these seeds (its seed spread)")
  p.add_argument("--carve", action="store_true",
                 help="small scale: trials scored on phrases carved from "
                 "train, the best draws' seeds on dev (table_carved.md)")
  p.add_argument("--order", choices=("forward", "reverse"), default="forward",
                 help="reverse: a second process takes the draws from the end")
  return p


def main() -> None:
  args = experiment.parse(_parser())
  trained = experiment.split(args.models)
  if not trained or set(trained) - set(MODELS):
    raise SystemExit(f"tuning_cost: --models={args.models!r}: give "
                     f"{' and/or '.join(MODELS)}, comma-separated.")
  exp = experiment.Experiment(args.out, args)
  shared = pathlib.Path(args.shared)
  small = args.scale == "small"
  task = "sst2" if small else args.task
  space = tuning.trials(args.trials)
  if small:
    kw = dict(steps=args.steps, vocab=glue.sst2_vocab(exp, shared))
    budget = glue.budget_tag(glue.SMALL["width"], args.steps,
                             glue.SMALL["seq_len"])
  else:
    kw, budget = {}, "paper"
  split = (glue.carve(exp, glue.sst2_train(shared)) if small and args.carve
           else None)
  budget += "_carved" if split else ""

  def config(mixer, lr, dropout, seed=0, select=False):
    c = glue.glue_config(task, mixer, args.scale, lr, shared, args.data_dir,
                         dropout=dropout, seed=seed, **kw)
    return glue.carved_config(c, split, select=select) if split else c
  if small and not exp.report_only:
    exp.baseline(budget, lambda: glue.bag_of_words_baselines(
        config(MODELS[0], 1e-3, 0.0)))
  def key(mixer, t):
    return f"{budget}/{task}/{mixer}/trial{t}"
  # Every carved run records the carve (one of another is run again).
  stamp = selection.split_tag(split) if split else {}
  # Draw by draw, both models each, so that a run cut short leaves pairs.
  draws = list(enumerate(space))
  for t, (lr, dropout) in draws[::-1] if args.order == "reverse" else draws:
    for mixer in trained:
      selection.retire_other_carve(exp, key(mixer, t), stamp)
      exp.cell(key(mixer, t), lambda c=config(mixer, lr, dropout, select=True),
               k=key(mixer, t): dict(run_trial(c, exp.workdir(k)), **stamp))
  exp.reload()   # with what another process recorded meanwhile
  by_trial = {(m, t): tuning.accuracy(exp.runs[key(m, t)])
              for t in range(len(space)) for m in MODELS
              if key(m, t) in exp.runs}
  best = {}
  # The best draws' seeds: only where the draws were scored on carved
  # phrases (on dev, the best draw is chosen on the sentences its seeds
  # would be scored on).
  if split and len(by_trial) == len(MODELS) * len(space):   # complete
    seeds = [0] + experiment.split(args.best_seeds, int)
    best = _best_draws(exp, space, by_trial, seeds, trained,
                       f"{budget}/{task}", config, stamp)
  # The examples a trial is scored on, for the evaluation noise: the dev
  # sentences, or the carved sentences (their phrases nest inside them, so
  # the sentence is the unit of independent noise; conservative).
  n_eval = (split["validation"]["groups"] if split
            else exp.data.get("baselines", {}).get(budget, {}).get("dev_rows"))
  _report(exp, args, task, budget, tuning.paired_trials(by_trial, len(space), MODELS), best,
          n_eval)


def _best_draws(exp, space, by_trial, seeds, trained, prefix, config,
                stamp: dict) -> dict:
  """Each model's best draw (on the carved phrases), trained again with
  ``seeds`` (by the models of ``trained``) and scored on dev: its lr,
  dropout and accuracies (each run recording the carve, ``stamp``)."""
  best = {}
  for mixer in MODELS:
    t = max(range(len(space)), key=lambda t, m=mixer: by_trial[m, t])
    best[mixer] = dict(draw=t, lr=space[t][0], dropout=space[t][1],
                       accuracy=[])
    for seed in seeds:
      k = f"{prefix}/{mixer}/best/trial{t}/seed={seed}"
      if mixer in trained:
        selection.retire_other_carve(exp, k, stamp)
        exp.cell(k, lambda c=config(mixer, *space[t], seed=seed), k=k:
                 dict(run_trial(c, exp.workdir(k)), **stamp))
      exp.reload()
      if k in exp.runs:
        best[mixer]["accuracy"].append(tuning.accuracy(exp.runs[k]))
  return best


def _report(exp, args, task, budget, acc, best, n_eval) -> None:
  done = len(acc[MODELS[0]])
  if not done:
    print("tuning_cost: no trial recorded for both models yet.")
    return
  ns = list(range(1, done + 1))
  curves = {m: [tuning.expected_max(acc[m], n) for n in ns] for m in MODELS}
  tag = "_carved" if budget.endswith("_carved") else ""   # --carve
  split = "validation (carved)" if tag else "dev"
  exp.save(**{f"expected_max{tag}": curves}, **(
      {f"best_draws{tag}": best} if tag else {}))
  rows = []
  for n in sorted({1, 2, 3, 5, 10, 15, done} & set(ns)):
    rows.append([n] + [f"{100 * curves[m][n - 1]:.1f}" for m in MODELS]
                + tuning.gap_cells(acc["hypermixer"], acc["attention"], n,
                                   n_eval))
  base = exp.data.get("baselines", {}).get(budget)
  if base:
    rows.append([f"Naive Bayes (bag of tokens), dev: "
                 f"{100 * base['naive_bayes']:.1f}", "", "", "", ""])
  if best:
    rows.append(["best draw, over seeds"] + [
        f"{experiment.fmt_mean_sd(best[m]['accuracy'], 100)}: draw "
        f"{best[m]['draw']} (lr {best[m]['lr']:.2g}, dropout "
        f"{best[m]['dropout']:.2f})" for m in MODELS] + [
            "", experiment.verdict(
                best["hypermixer"]["accuracy"], best["attention"]["accuracy"],
                "higher", n_eval=(base or {}).get("dev_rows")).text(100)])
  exp.write_table(
      f"Tuning cost: expected best {task} {split} accuracy after n trials "
      f"({args.scale} scale)",
      experiment.markdown_table(
          ["trials"] + [glue.LABELS[m] for m in MODELS]
          + ["gap, 95% bootstrap interval (points)", "HyperMixer above?"],
          rows),
      tuning.table_note(done, split, bool(tag), n_eval, layout=(
          f"the small GLUE layout (width {glue.SMALL['width']}, 2 layers, "
          f"length {glue.SMALL['seq_len']}, 8k SST-2 vocabulary), "
          f"{args.steps} steps of batch 64" if args.scale == "small"
          else "")),
      name=f"table{tag}")
  _plot(exp, ns, curves, None if tag else base, split, tag)


def _plot(exp, ns, curves, base, split="dev", tag="") -> None:
  fig, axes = experiment.figure()
  ax = axes[0, 0]
  for mixer in MODELS:
    ax.plot(ns, [100 * v for v in curves[mixer]], marker="o",
            label=glue.LABELS[mixer])
  if base:
    experiment.baseline_lines(ax, {"Naive Bayes": 100 * base["naive_bayes"]})
  experiment.style_axes(ax, "random-search trials",
                        f"expected best {split} accuracy (%)", legend=10)
  exp.save_figure(fig, f"tuning_cost{tag}")


if __name__ == "__main__":
  main()
