r"""GLUE from scratch: the HyperMixer paper's main table (Mai et al. 2023, §4.3).

Six equal-size models (HyperMixer, Transformer, Linear Transformer, MLP-Mixer,
gMLP, FNet), no pretraining.

  --scale=paper  the ~11M ``glue_<mixer>`` models on SST-2, QNLI, MNLI, QQP and
                 SNLI from TFDS (``--data_dir``) on the 32k T5 vocabulary, 50k
                 steps of batch 64, length 128; each model's lr (the paper's
                 grid {1e-5 ... 1e-3}) and warm-up chosen on the first tenth
                 of train (``glue.tune_tfds``), the seeds trained on the rest
                 and scored on dev.
  --scale=small  the real SST-2 files in ``--shared`` (67,349 train phrases,
                 872 dev sentences) on an 8k SentencePiece vocabulary trained
                 on the train phrases (built into ``OUT/vocab``), the same
                 layouts at ``--width`` (see ``small_model``), ``--seq_len``,
                 ``--steps`` of batch 64, lr 1e-3, seeds ``--seeds``; beside
                 them a bag-of-words Naive Bayes and the majority class on the
                 same tokens and splits.

``--tune`` (small scale): every model tuned alike, its learning rate and
warm-up chosen among ``selection.settings`` on every 10th SST-2 train
sentence with all its phrases (``glue.sentence_groups``; seed 100), then
the seeds at each model's choice trained on the other sentences' phrases
and scored on dev: ``table_tuned.md``.

  python experiments/glue_from_scratch.py --scale=small \
      --out=experiments/results/glue_from_scratch

Writes ``results.json``, ``table.md`` and ``glue_curves.png`` (dev accuracy
against step, mean over seeds) into ``--out``.
"""
from __future__ import annotations

import pathlib

import numpy as np

from hypermixer_jax import experiment
from hypermixer_jax.experiment import glue
from hypermixer_jax.experiment import selection


def main() -> None:
  p = experiment.parser("glue_from_scratch", __doc__, report_only=True,
                        data_dir="", mixers=glue.MIXERS, seeds="0,1,2",
                        steps=glue.SMALL["steps"])
  p.add_argument("--width", type=int, default=glue.SMALL["width"])
  p.add_argument("--seq_len", type=int, default=glue.SMALL["seq_len"])
  p.add_argument("--dropout", type=float, default=None,
                 help="the models' dropout rate (default: configs/glue.py's "
                 "0.1); part of the recorded budget")
  experiment.tune_flags(p, "SST-2 sentences (with their phrases)",
                        budget_check=True)
  args = experiment.parse(p)
  experiment.check_tune(args, "the SST-2 train phrases")
  experiment.check_budget(args)
  exp = experiment.Experiment(args.out, args)
  shared = pathlib.Path(args.shared)
  mixers = experiment.split(args.mixers)
  if args.scale == "small":
    tasks, lrs = ("sst2",), (glue.SMALL["lr"],)
    small = dict(width=args.width, steps=args.steps, seq_len=args.seq_len,
                 vocab=glue.sst2_vocab(exp, shared), dropout=args.dropout)
    budget = glue.budget_tag(args.width, args.steps, args.seq_len,
                             args.dropout)
  else:
    tasks, lrs, small, budget = glue.TASKS, glue.PAPER_LRS, {}, "paper"

  def config(cell, steps=None):
    return glue.glue_config(cell["task"], cell["model"], args.scale,
                            cell["lr"], shared, args.data_dir,
                            seed=cell.get("seed", 0),
                            **dict(small, steps=steps or args.steps))
  base = {}
  if args.scale == "small":
    base = exp.baseline(budget, lambda: glue.bag_of_words_baselines(
        config(dict(task="sst2", model=mixers[0], lr=lrs[0]))))
  if args.scale == "paper":
    _report(exp, _paper(exp, args, mixers, shared), tasks, mixers, base, args)
    return
  if args.tune:
    _tuned(exp, args, mixers, f"{budget}/", shared, lambda m, s, steps=None:
           config(dict(task="sst2", model=m, lr=lrs[0], seed=s), steps))
    return
  # (cell, result) of each recorded cell, in grid order.
  done = []
  for cell in experiment.grid(task=tasks, model=mixers, lr=lrs,
                              seed=experiment.split(args.seeds, int)):
    key = experiment.cell_key(budget, cell)
    result = exp.cell(key,
                      lambda c=config(cell), k=key: glue.run_cell(exp, c, k))
    if result is not None:
      done.append((cell, result))
  _report(exp, done, tasks, mixers, base, args)


def _tuned(exp, args, mixers, prefix, shared, config) -> None:
  """``--tune``: every model's search on the carved SST-2 sentences, the
  seeds at each one's choice, and ``--budget_check``'s lengths
  (``config(mixer, seed, steps)``: the untuned run config)."""
  search = experiment.split(args.lrs, float) or None
  tuned = glue.tune(
      exp, mixers, experiment.split(args.seeds, int), config, args.steps,
      prefix, glue.sst2_train(shared), search,
      reverse=args.order == "reverse")
  lengths = experiment.split(args.budget_check, int)
  check = glue.budget_check(exp, prefix, tuned, mixers, lengths,
                            args.steps, config) if lengths else None
  glue.report_tuned(exp, mixers, args.seeds, args.steps, tuned, search,
                    check=check)


def _paper(exp, args, mixers, shared) -> list:
  """(cell, result) of each recorded seed of every task, each model at the
  setting ``glue.tune_tfds`` chose on the first tenth of train."""
  done = []
  for task in glue.TASKS:
    _, _, chosen, runs = glue.tune_tfds(
        exp, mixers, experiment.split(args.seeds, int),
        lambda m, s, task=task: glue.glue_config(
            task, m, "paper", glue.PAPER_LRS[0], shared, args.data_dir,
            seed=s),
        f"paper/{task}/", glue.PAPER_LRS, reverse=args.order == "reverse")
    done += [(dict(task=task, model=m, lr=chosen[m]["lr"], seed=r["seed"]),
              r) for m in runs for r in runs[m]]
  return done


def _accs(done: list, **match) -> dict:
  """{seed: dev accuracy at the last step} of the recorded cells matching,
  all at one learning rate: the small scale's, or the paper scale's choice
  on the split carved from train (dev is never read in a choice)."""
  return {cell["seed"]: r["eval"]["accuracy"]
          for cell, r in done if all(cell[k] == v for k, v in match.items())}


def _report(exp, done, tasks, mixers, base, args) -> None:
  per = {(t, m): _accs(done, task=t, model=m) for t in tasks for m in mixers}
  headers = ["model"]
  for task in tasks:
    headers += [f"{task} dev, final (ours)", f"{task} test (paper)",
                "HyperMixer above it?"]
    headers += ["vs Naive Bayes"] if base else []
  n_eval = base.get("dev_rows")
  if args.scale == "small":
    headers += ["params (embedding / token mixing)", "GFLOP / train step",
                "wall min per run"]
  rows = []
  for mixer in mixers:
    row = [glue.LABELS[mixer]]
    for task in tasks:
      got = per[(task, mixer)]
      final = list(got.values())
      hyper = list(per.get((task, "hypermixer"), {}).values())
      row += [experiment.fmt_mean_sd(final, 100) or "not run",
              glue.PAPER[mixer][task],
              glue.hypermixer_above(task, mixer, hyper, final, n_eval,
                                    untuned=args.scale == "small")]
    if base:
      row.append(experiment.against_baseline(
          final, base["naive_bayes"], n_eval=n_eval).text(100)
                 if final else "")
    if args.scale == "small":
      mine = [r for c, r in done if c["model"] == mixer]
      r = mine[0] if mine else {}
      row.append(f"{r['params'] / 1e6:.2f}M ({r['params_embedding'] / 1e6:.2f}M"
                 f" / {r['params_token_mixing'] / 1e6:.3f}M)"
                 if "params_embedding" in r else "")
      row.append(f"{experiment.flops_per_step(r) / 1e9:.2f}" if r else "")
      row.append(f"{np.mean([r['wall_s'] / 60 for r in mine]):.0f}"
                 if mine else "")
    rows.append(row)
  if base:
    for name, label in (("naive_bayes", "Naive Bayes (bag of tokens)"),
                        ("majority", "majority class")):
      rows.append(experiment.table_row(headers, {
          "model": label, headers[1]: f"{100 * base[name]:.1f}"}))
  exp.write_table(f"GLUE from scratch ({args.scale} scale)",
                  experiment.markdown_table(headers, rows),
                  _notes(exp, args, mixers))
  _figure(exp, done, tasks[0], mixers, base)


def _notes(exp, args, mixers) -> str:
  """The table's notes: what a cell holds and, at small scale, the budget
  and every budget recorded."""
  notes = ("Final: dev accuracy at the last step (the only dev number "
           "reported: the best of a run's evaluations would be chosen on "
           "dev); mean ± sample sd over seeds. Paper: test accuracy of the "
           "~11M models. "
           + experiment.VERDICT_NOTE)
  if args.scale == "paper":
    notes += (f" Each model's lr and warm-up chosen among "
              f"{len(selection.settings(1, glue.PAPER_LRS))} settings (seed "
              f"{selection.SEED}) on the first tenth of its task's train "
              "split (digests under baselines in results.json; held-out pairs "
              "can share premises with training ones), the seeds trained on "
              "the other nine tenths; dev is never read in the choice.")
  if args.scale == "small":
    same = (args.width, args.steps, args.seq_len) == tuple(
        glue.SMALL[k] for k in ("width", "steps", "seq_len"))
    checked = selection.length_confirmed(exp.data, glue.budget_tag(
        args.width, args.steps, args.seq_len, args.dropout) + "/",
                                         args.steps, glue.MIXERS)
    notes = experiment.UNTUNED_NOTE + (glue.SMALL_BUDGET_NOTE.format(
        checked=selection.length_note(checked, tuned=False))
                                       if same else "") + notes
    vocab = exp.data.get("vocab", {})
    dropout = (args.dropout if args.dropout is not None else
               experiment.load_config("glue.py", "sst2,attention")
               .model.dropout_rate)
    notes += (f" Small scale: width-{args.width} 2-layer models (see "
              f"small_model), sequence length {args.seq_len}, batch 64, "
              f"{args.steps} steps ({args.steps * 64 / 67349:.2f} epoch), "
              f"lr {glue.SMALL['lr']:g}, dropout {dropout:g}, on "
              f"{vocab.get('pieces')} SentencePiece "
              f"pieces trained on the SST-2 train phrases (sha256 "
              f"{vocab.get('sha256', '')[:12]}...). Baselines on the same "
              "tokens and splits. GFLOP / train step: XLA's count of the "
              "compiled step (batch 64; equal parameters are not equal "
              "FLOPs), the figure to compare the models' cost by; wall "
              "time on one core of a shared 2-core machine, which moves "
              "with its load (up to 2.3x between seeds of one model).\n\n"
              + glue.budget_table(exp.runs, mixers))
  return notes


def _figure(exp, done, task, mixers, base) -> None:
  """Dev accuracy of ``task`` against step, mean ± sd over the seeds."""
  fig, axes = experiment.figure()
  ax = axes[0, 0]
  for mixer in mixers:
    mine = [r for c, r in done if c["model"] == mixer and c["task"] == task]
    if mine:
      steps, acc = experiment.mean_curve(mine, "accuracy", 100)
      ax.errorbar(steps, acc.mean(0),
                  yerr=acc.std(0, ddof=min(1, len(acc) - 1)), marker="o",
                  ms=3, capsize=2,
                  label=f"{glue.LABELS[mixer]} (n={len(mine)})")
  if base:
    experiment.baseline_lines(ax, {"Naive Bayes": 100 * base["naive_bayes"],
                                   "majority class": 100 * base["majority"]})
  experiment.style_axes(ax, "step", f"{task} dev accuracy (%)")
  exp.save_figure(fig, "glue_curves")


if __name__ == "__main__":
  main()
