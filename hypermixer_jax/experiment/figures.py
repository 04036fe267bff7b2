"""Figures of an experiment's report: learning curves beside the trivial
baselines, on matplotlib figures that need no pyplot backend."""
from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence


def figure(ncols: int = 1, nrows: int = 1, size=(5.0, 3.6)):
  """``(fig, axes)`` of a matplotlib ``Figure`` that needs no pyplot backend
  (nothing global changes in a notebook); save with ``fig.savefig(path)``."""
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
  axes = fig.subplots(nrows, ncols, squeeze=False)
  return fig, axes


def curve(run: dict[str, Any], metric: str, scale: float = 1.0
          ) -> tuple[list[int], list[float]]:
  """``(steps, scale * metric)`` of a run's evaluation curve (its steps are
  ints in a fresh result, strings once read back from ``results.json``)."""
  points = run["eval_curve"]
  steps = sorted(points, key=int)
  return [int(s) for s in steps], [scale * points[s][metric] for s in steps]


def mean_curve(runs: Sequence[dict[str, Any]], metric: str,
               scale: float = 1.0):
  """``(steps, values [runs, steps])``: the evaluation curves of ``runs``
  (e.g. the seeds of one model) at the steps all of them evaluated."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  curves = [dict(zip(*curve(r, metric, scale))) for r in runs]
  steps = sorted(set.intersection(*[set(c) for c in curves]))
  return steps, np.array([[c[s] for s in steps] for c in curves])


def plot_curves(ax, runs: dict[str, Sequence[dict[str, Any]]], metric: str,
                label: Callable[[str], str], scale: float = 1.0) -> None:
  """Every run's evaluation curve of ``metric`` against step on ``ax``:
  ``runs`` is ``{name: [run of each seed]}``, one colour and one legend
  entry (``label(name)``) per name."""
  for i, (name, seed_runs) in enumerate(runs.items()):
    for j, run in enumerate(seed_runs):
      ax.plot(*curve(run, metric, scale), marker="o", ms=3, color=f"C{i}",
              alpha=0.8, label=label(name) if j == 0 else None)


def baseline_lines(ax, lines: dict[str, float]) -> None:
  """The trivial baselines as horizontal lines on ``ax`` (``{label: y}``;
  black dashed, then grey dotted)."""
  styles = itertools.cycle((("k", "--"), ("grey", ":")))
  for (name, y), (color, ls) in zip(lines.items(), styles):
    ax.axhline(y, color=color, ls=ls, lw=0.8, label=name)


def style_axes(ax, xlabel: str, ylabel: str, *, xscale: str = "",
               yscale: str = "", title: str = "", legend: float = 7,
               legend_outside: bool = False) -> None:
  """A figure's axis labels, scales (``'log'``, or ``'log2'`` for base 2),
  title and legend (font size ``legend``; 0: no legend; ``legend_outside``:
  right of the axes, for plots whose curves fill them)."""
  for scale, set_scale in ((xscale, ax.set_xscale), (yscale, ax.set_yscale)):
    if scale:
      set_scale("log", **({"base": 2} if scale == "log2" else {}))
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  if legend and legend_outside:
    ax.legend(fontsize=legend, loc="upper left", bbox_to_anchor=(1.02, 1.0),
              borderaxespad=0.0)
  elif legend:
    ax.legend(fontsize=legend)
