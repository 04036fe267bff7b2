r"""Tuning cost: expected validation performance vs trials (Mai et al. §4.6).

Random search with log10(lr) ~ U(-8, -1) and dropout ~ U(0, 0.5), the same
trials for HyperMixer and the Transformer; the expected best validation
accuracy after n trials (Dodge et al. 2019) is computed from the empirical
distribution of the trials: with accuracies v_(1) <= ... <= v_(T),

    E[max of n] = sum_i v_(i) [ (i/T)^n - ((i-1)/T)^n ].

The paper (20 trials) finds HyperMixer's curve above the Transformer's: it
needs fewer trials for the same expected accuracy.

  --scale=paper  20 trials of the ~11M models on a GLUE task from TFDS.
  --scale=small  6 trials per model of width-32 two-layer GLUE models on the
                 real SST-2 files in ``--shared``, 150 steps of batch 64 each.

  python experiments/tuning_cost.py --scale=small --out=experiments/results/tuning_cost

Writes ``results.json``, ``table.md`` and ``tuning_cost.png``.
"""
from __future__ import annotations

import pathlib

import numpy as np

import glue_from_scratch as glue
from hypermixer_jax import experiment

MODELS = ("hypermixer", "attention")


def expected_max(values, n: int) -> float:
  """Expected maximum of ``n`` draws (with replacement) from ``values``."""
  v = np.sort(np.asarray(values, np.float64))
  t = len(v)
  i = np.arange(1, t + 1)
  return float(np.sum(v * ((i / t) ** n - ((i - 1) / t) ** n)))


def trials(count: int, seed: int = 0) -> list[tuple[float, float]]:
  """(learning rate, dropout) pairs of the paper's search space."""
  rng = np.random.default_rng(seed)
  return [(float(10 ** rng.uniform(-8, -1)), float(rng.uniform(0, 0.5)))
          for _ in range(count)]


def run_trial(config, workdir: str) -> dict:
  """One trial; a run stopped by the loop's NaN guard scores 0."""
  out = dict(lr=config.learning_rate, dropout=config.model.dropout_rate)
  try:
    out.update(experiment.train(config, workdir))
  except FloatingPointError as e:  # the loop refuses to go on with NaN
    out.update(eval={"accuracy": 0.0}, diverged=str(e).splitlines()[0])
  return out


def main() -> None:
  p = experiment.parser("tuning_cost", __doc__)
  p.add_argument("--data_dir", default="")
  p.add_argument("--task", default="sst2")
  args = experiment.parse(p)
  exp = experiment.Experiment(args.out, args)
  shared = pathlib.Path(args.shared)
  small = args.scale == "small"
  count = 6 if small else 20
  space = trials(count)
  acc = {m: [] for m in MODELS}
  for mixer in MODELS:
    for t, (lr, dropout) in enumerate(space):
      key = f"{args.task}/{mixer}/trial{t}"
      cfg = glue.glue_config(args.task if not small else "sst2", mixer,
                             args.scale, lr, shared, args.data_dir,
                             steps=150 if small else None, dropout=dropout,
                             width=32)
      result = exp.run(key, lambda c=cfg, k=key: run_trial(c, exp.workdir(k)))
      accuracy = result["eval"].get("accuracy", float("nan"))
      acc[mixer].append(accuracy if accuracy == accuracy else 0.0)
  ns = list(range(1, count + 1))
  curves = {m: [expected_max(acc[m], n) for n in ns] for m in MODELS}
  exp.save(expected_max=curves)
  rows = [[n] + [f"{100 * curves[m][n - 1]:.1f}" for m in MODELS]
          for n in sorted({1, 2, 3, 5, 8, count} & set(ns))]
  exp.write_table(
      f"Tuning cost: expected best {args.task} dev accuracy after n trials "
      f"({args.scale} scale)",
      experiment.markdown_table(["trials"] + [glue.LABELS[m] for m in MODELS],
                                rows),
      f"{count} random-search trials per model, log10(lr) ~ U(-8, -1), "
      "dropout ~ U(0, 0.5), the same draws for both models"
      + (", width-32 2-layer models, 150 steps of batch 64" if small else "")
      + ". A diverged trial counts as accuracy 0.")
  fig, axes = experiment.figure()
  ax = axes[0, 0]
  for mixer in MODELS:
    ax.plot(ns, [100 * v for v in curves[mixer]], marker="o",
            label=glue.LABELS[mixer])
  experiment.style_axes(ax, "random-search trials",
                        "expected best dev accuracy (%)", legend=10)
  exp.save_figure(fig, "tuning_cost")


if __name__ == "__main__":
  main()
