"""Probes of models trained on the synthetic pairs task (``data.task=
synthetic_pairs``): the test sequence a pseudo-attention map is drawn on, the
map of a trained model, and the test MSE of two trivial predictors."""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from hypermixer_jax import experiment
from hypermixer_jax import models
from hypermixer_jax.data import synthetic
from hypermixer_jax.experiment import selection
from hypermixer_jax.train import pseudo_attention as pa


def map_example(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """The first test sequence of ``config``'s data (inputs, targets [N, 1])."""
  ex = synthetic.generate(config.data.synthetic, "test", np.arange(1))
  return {k: ex[k][0] for k in ("inputs", "targets")}


def pseudo_attention_map(config: ml_collections.ConfigDict, params,
                         x: np.ndarray) -> np.ndarray:
  """``[N, N]`` pseudo-attention of the trained model on one sequence."""
  model = models.build_model(config.model)
  apply = jax.jit(lambda x: model.apply({"params": params}, x[None])[0])
  return np.asarray(pa.pseudo_attention(apply, jnp.asarray(x)))


def trivial_baselines(config: ml_collections.ConfigDict,
                      train_examples: int = 4096) -> dict[str, float]:
  """Test MSE of copying the input and of the training set's mean target
  (over its first ``train_examples`` sequences) on ``config``'s test set."""
  opts = config.data.synthetic
  test = synthetic.generate(
      opts, "test", np.arange(opts.num_eval_examples))
  train = synthetic.generate(opts, "train", np.arange(
      min(train_examples, opts.num_examples or train_examples)))
  mean = float(train["targets"].mean())
  return {"copy_input": float(np.mean((test["inputs"] - test["targets"]) ** 2)),
          "train_mean": float(np.mean((mean - test["targets"]) ** 2))}


# ---------------------------------------------------------------------------
# Equal tuning (``--tune``).
# ---------------------------------------------------------------------------
def carved_split(config: ml_collections.ConfigDict) -> dict:
  """The split a selection run of ``config`` (a search run's config before
  carving) trains and is scored on: for its train and validation parts the
  sequences and the sha256 of their inputs and targets (float32, in order).
  The draw is a function of the config alone, so the digests name the
  split wherever it is generated again."""
  opts = ml_collections.ConfigDict(config.data.synthetic.to_dict())
  opts.validation_every = selection.VALIDATION_EVERY
  out = {}
  for split in ("train", "validation"):
    arrays = synthetic.split_arrays(opts, split)
    digest = hashlib.sha256()
    for key in ("inputs", "targets"):
      digest.update(np.ascontiguousarray(arrays[key], np.float32).tobytes())
    out[split] = {"sequences": len(arrays["inputs"]),
                  "sha256": digest.hexdigest()}
  return out


def tune(exp, config, mixers, setting: dict, lrs=None,
         reverse: bool = False) -> dict:
  """Every model's search at each training-set size of ``setting``
  (``sizes``, ``seeds``, ``steps``), then its seeds at its choice:
  ``{size: (searched, chosen, runs)}`` (``selection.tune``).

  A search run draws its own training set of the size (seed
  ``selection.SEED``) and holds out every ``selection.VALIDATION_EVERY``-th
  sequence of it (``data.synthetic.validation_every``), scored once, at the
  end, by MSE; the test draw is never read. The seeds then train on their
  full draws of the size and are scored on the test draw, as the untuned
  runs. ``config(mixer, size, seed)``: the untuned run config."""
  out, steps = {}, setting["steps"]
  splits = {f"n{size}": carved_split(config(mixers[0], size, selection.SEED))
            for size in setting["sizes"]}
  exp.save(synthetic_splits=splits)
  for size in setting["sizes"]:
    def one(mixer, seed, setting, key, select, size=size):
      c = selection.at(config(mixer, size, seed), setting)
      if select:
        c.data.synthetic.validation_every = selection.VALIDATION_EVERY
        c.eval_split = "validation"
        c.eval_every = c.num_train_steps
      r = experiment.train(c, exp.workdir(key))
      return dict(selection.lean(r), mse=float(r["eval"]["mse"]))
    out[size] = selection.tune(
        exp, mixers, setting["seeds"], selection.settings(steps, lrs),
        f"s{steps}/n{size}/", one, lambda r: r["mse"], higher=False,
        reverse=reverse, tag=selection.split_tag(splits[f"n{size}"]))
  return out


def mse_verdict(hyper, attention, size: int, equal: tuple[int, float],
                untuned: bool = False) -> str:
  """Welch's test of HyperMixer's test MSEs against attention's at ``size``
  training sequences: the paper's "lower" below ``equal[0]`` sequences,
  "equal" (within the share ``equal[1]`` of attention's mean) from it;
  '' without runs on both sides."""
  if not hyper or not attention:
    return ""
  return experiment.verdict(
      hyper, attention, "equal" if size >= equal[0] else "lower",
      margin=equal[1] * float(np.mean(attention)),
      untuned=untuned).text(spec="+.1e")


def split_note(splits: dict, sizes) -> str:
  """The notes' line naming each size's held-out sequences by digest."""
  parts = [f"n={n:,}: {s['validation']['sequences']:,} (sha256 "
           f"{s['validation']['sha256'][:12]}...)" for n in sizes
           if (s := splits.get(f"n{n}"))]
  return ("Held-out sequences: " + "; ".join(parts) + ". ") if parts else ""


def report_tuned(exp, tuned: dict, mixers, labels: dict, setting: dict,
                 lrs=None, *, equal: tuple[int, float], claim: str) -> None:
  """``table_tuned.md``: each model's test MSE at its choice per size (mean
  ± sd over ``setting``'s seeds), HyperMixer against attention by Welch's
  test ("lower" below ``equal[0]`` sequences, equal within the share
  ``equal[1]`` of attention's mean from it), the trivial baselines, and
  every search."""
  sizes, steps, equal_from = sorted(tuned), setting["steps"], equal[0]
  seeds = ",".join(map(str, setting["seeds"]))
  n_seeds = len(setting["seeds"])
  mse = {(m, n): [r["mse"] for r in tuned[n][2].get(m, [])]
         for m in mixers for n in sizes}

  def cell(m, n):
    s = tuned[n][1].get(m)
    if not s:
      return "search not complete"
    return (experiment.fmt_seed_summary(experiment.seed_summary(mse[m, n]),
                                        n_seeds)
            + f" (lr {s['lr']:g}, {s['warmup_share']:.0%})")
  rows = [[labels[m]] + [cell(m, n) for n in sizes] for m in mixers]
  if {"hypermixer", "attention"} <= set(mixers):
    row = [f"HyperMixer - Attention (paper: lower below {equal_from:,}, "
           "equal from it)"]
    for n in sizes:
      row.append(mse_verdict(mse["hypermixer", n], mse["attention", n], n,
                             equal))
    rows.append(row)
  base = exp.data.get("baselines", {})
  if base:
    rows += [["copy the input"] + [f"{base['copy_input']:.2e}"] * len(sizes),
             ["train-set mean target"]
             + [f"{base['train_mean']:.2e}"] * len(sizes)]
  text = experiment.markdown_table(
      ["model"] + [f"n={n:,}" for n in sizes], rows)
  for n in sizes:
    searched, chosen, _ = tuned[n]
    text += "\n\n" + selection.search_section(
        searched, chosen, labels, lrs, what=f"MSE at n={n:,}",
        cell=lambda r: f"{r['mse']:.2e}")
  where = experiment.where_ran({f"n={n:,}": [
      r for runs in (*tuned[n][0].values(), *tuned[n][2].values())
      for r in runs] for n in sizes}, end=" ")
  notes = (
      f"Equal tuning: at each size every model trained {steps} steps at "
      f"each of the {len(selection.settings(steps, lrs))} settings on a "
      f"training set of that size drawn with seed {selection.SEED}, every "
      f"{selection.VALIDATION_EVERY}th sequence of it held out and scored "
      "(MSE at the last step); the chosen setting then trained with seeds "
      f"{seeds} on their own full training sets of the size, scored on the "
      "test draw (never read in the choice). "
      + split_note(exp.data.get("synthetic_splits", {}), sizes)
      + "Cells: test MSE, mean ± sd. "
      f"{where}{claim} {experiment.VERDICT_NOTE}")
  exp.write_table("Synthetic task, every model tuned alike: test MSE "
                  "against training-set size", text, notes,
                  name="table_tuned")
