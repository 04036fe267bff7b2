"""The claims table: each paper claim beside what the committed records say.

    python -m hypermixer_jax.experiment.claims [--results=experiments/results]

writes ``<results>/claims.md`` from the ``results.json`` of each experiment
(and, with ``--insert=FILE``, puts the table between FILE's
``<!-- claims -->`` and ``<!-- /claims -->`` lines). A claim is data
(``Claim``): the runs of each side, selected by a pattern of their keys in a
record (one run per seed), the number the paper gives, the trivial baseline,
the direction the paper claims, and the regime the runs were made in. Its
verdict is ``stats.verdict``: Welch's test on the seeds, the evaluation
set's noise included for accuracies, equality only by TOST.
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import pathlib
import re
from typing import Any, Callable, Sequence

from hypermixer_jax.experiment import glue
from hypermixer_jax.experiment import images as images_lib
from hypermixer_jax.experiment import mlm
from hypermixer_jax.experiment import nli
from hypermixer_jax.experiment import records as records_lib
from hypermixer_jax.experiment import selection
from hypermixer_jax.experiment import sparse_lm
from hypermixer_jax.experiment import stats
from hypermixer_jax.experiment import tables


@dataclasses.dataclass(frozen=True)
class Arm:
  """One side of a claim: the runs of ``experiment`` whose keys match
  ``pattern`` (``fnmatch``; one per seed), each read at ``metric`` (the
  keys down to it in the run's record), or ``record``: the keys of numbers
  kept once in the record (e.g. ``('best_draws', 'hypermixer',
  'accuracy')``)."""
  label: str
  pattern: str = ""
  metric: tuple[str, ...] = ("eval", "accuracy")
  record: tuple[str, ...] = ()

  def values(self, data: dict[str, Any]) -> list[float]:
    if self.record:
      value = _path(data, self.record)
      return [float(v) for v in (value if isinstance(value, list)
                                 else [value])]
    keys = sorted(k for k in data["runs"] if fnmatch.fnmatchcase(
        k, self.pattern))
    return [float(_path(data["runs"][k], self.metric)) for k in keys]


@dataclasses.dataclass(frozen=True)
class Claim:
  """A paper's claim that ``ours`` is ``direction`` than each of
  ``others`` (every pair must agree), with the paper's number, the trivial
  baseline of the task (a label and its keys in the record; a pattern
  among them averages what matches), the evaluation
  set's size for accuracies (its keys; none for perplexities and MSE), the
  margin of a claim of equality, and the regime of the runs (text, or a
  function of the record that writes it from what the runs recorded)."""
  paper: str
  experiment: str
  text: str
  paper_number: str
  ours: Arm
  others: tuple[Arm, ...]
  direction: str
  baseline: tuple[str, tuple[str, ...]] = ("", ())
  n_eval: tuple[str, ...] = ()
  margin: float | None = None
  # The margin as a share of the others' mean (e.g. 0.1: within 10%).
  relative_margin: bool = False
  scale: float = 100.0         # accuracies in points
  spec: str = "+.1f"           # how a difference is written
  regime: str | Callable[[dict[str, Any]], str] = ""
  at_scale: str | Callable[[dict[str, Any]], str] = ""
  # A row only once its runs are recorded (a study's --tune, run later).
  when_recorded: bool = False
  # Every model at one shared setting, none searched: the difference and p
  # are shown, but an unequal tuning decides nothing (NO_VERDICT).
  untuned: bool = False
  # The baseline's own setting was searched (the ridge penalty of the
  # linear classifier, the bigram's add-k): against untuned models it
  # decides nothing either.
  baseline_tuned: bool = False

  def row(self, data: dict[str, Any]) -> list[str]:
    return judge(self, data)

  def recorded(self, data: dict[str, Any]) -> bool:
    """Every arm has runs (a comparison with an arm not run is no row)."""
    try:
      return all(a.values(data) for a in (self.ours, *self.others))
    except KeyError:   # a record key (``Arm.record``) not written yet
      return False

  def regime_text(self, data: dict[str, Any]) -> str:
    return self.regime if isinstance(self.regime, str) else self.regime(data)

  def at_scale_text(self, data: dict[str, Any]) -> str:
    return (self.at_scale if isinstance(self.at_scale, str)
            else self.at_scale(data))


@dataclasses.dataclass(frozen=True)
class Measured:
  """A claim about a deterministic measurement (one run a side: a cost, an
  exponent), compared as measured, without a test: ``ours`` and each of
  ``others`` are (label, keys in the record); ``direction`` 'lower' or
  'higher'."""
  paper: str
  experiment: str
  text: str
  paper_number: str
  ours: tuple[str, tuple[str, ...]]
  others: tuple[tuple[str, tuple[str, ...]], ...]
  direction: str
  regime: str = ""
  at_scale: str = ""

  def row(self, data: dict[str, Any]) -> list[str]:
    value = float(_path(data, self.ours[1]))
    theirs = [(label, float(_path(data, keys))) for label, keys in self.others]
    holds = all((value < v) == (self.direction == "lower") for _, v in theirs)
    return [self.paper, self.text, self.paper_number,
            f"{self.ours[0]} {value:.2f} (one run)",
            "; ".join(f"{label} {v:.2f}" for label, v in theirs), "",
            f"{'agrees' if holds else 'disagrees'} as measured (one run a "
            "side, no test)", self.regime, self.at_scale]


def _path(data: Any, keys: Sequence[str]) -> Any:
  for key in keys:
    data = data[key]
  return data


def _values_at(data: Any, keys: Sequence[str]) -> list[float]:
  """The number at ``keys``, or the numbers where a key is a pattern
  (``fnmatch``), e.g. a baseline scored on each seed's masks."""
  if not keys:
    return [float(data)]
  matches = sorted(fnmatch.filter(data, keys[0]))
  if not matches:
    raise KeyError(f"claims: nothing at {keys[0]!r} (keys: {sorted(data)}).")
  return [v for k in matches for v in _values_at(data[k], keys[1:])]


NO_VERDICT = stats.NO_VERDICT


PPL = ("eval", "perplexity")
HM = "HyperMixer (Mai et al. 2023)"
GMLP = "gMLP (Liu et al. 2021)"
SMLP = "sMLP (Yu et al. 2022)"
SST2 = "w128_s1000_n64/task=sst2/model={}/lr=0.001/seed=*"


def _untuned(lr: float, warmup: str) -> str:
  """How a study without a search set its models' hyperparameters."""
  return (f"no search: every model at lr {lr:g}, warm-up {warmup} (none "
          "tuned; an equal search might reorder close models)")


GLUE_UNTUNED = _untuned(glue.SMALL["lr"], "10% of the steps")
SST2_REGIME = ("SST-2, 100% of train (67k phrases), 1,000 steps x 64 "
               "(0.95 epoch, <= 4.1M tokens; budget set on dev), ~1.3M "
               "params; " + GLUE_UNTUNED)
SST2_SCALE = ("the paper's models have 11M params (~8x these) and a "
              "tuned lr; here no model is "
              "distinguishable from a bag of words, so none yet shows what "
              "its token mixing adds")
NLI = "w128_s1000_n128_g/task={}/model={}/seed=*"
# The train sets the paper trains on (pairs; GLUE's MNLI and QNLI, SNLI).
FULL_TRAIN = {"mnli": 392_702, "snli": 550_152, "qnli": 104_743}


def _millions(counts) -> str:
  """Parameter counts in millions: one number, or the smallest and the
  largest ("0.81-0.94M"); "" for none."""
  sizes = sorted({f"{c / 1e6:.2f}" for c in counts}, key=float)
  return "-".join(dict.fromkeys(sizes[:1] + sizes[-1:])) + "M" if sizes else ""


def _nli_params(data: dict[str, Any], pattern: str,
                models: Sequence[str]) -> str:
  """The parameter counts of ``models``' runs (``pattern.format(model)``)."""
  sizes = _millions(r["params"] for m in models
                    for k, r in data["runs"].items()
                    if fnmatch.fnmatchcase(k, pattern.format(m)))
  return sizes and sizes + " params"


def _nli_regime(task: str, models: Sequence[str]
                ) -> Callable[[dict[str, Any]], str]:
  """The untuned pair-task runs' regime: the train part's pairs (its share
  of the full train set), steps and the models' sizes, from the record."""
  def regime(data: dict[str, Any]) -> str:
    if task not in data.get("splits", {}):
      return "not run"
    rows = data["splits"][task]["rows"]["train"]
    return (f"{task.upper()}: 80% of the dev file ({rows:,} pairs, "
            f"{100 * rows / FULL_TRAIN[task]:.1f}% of the full train set), "
            "1,000 steps x 64 (<= 8.2M tokens), "
            f"{_nli_params(data, NLI.format(task, '{}'), models)}; "
            + _untuned(nli.SMALL["lr"], "10% of the steps"))
  return regime


def _nli_scale(task: str, tuned: bool) -> Callable[[dict[str, Any]], str]:
  """How much more data the paper's run of ``task`` has than these."""
  def scale(data: dict[str, Any]) -> str:
    split = (data.get(f"{task}_split", {}).get("train", {}) if tuned
             else data.get("splits", {}).get(task, {}).get("rows", {}))
    rows = split.get("documents" if tuned else "train")
    if not rows:
      return "the paper trains on the full train set"
    return (f"the paper trains on the full train set "
            f"({FULL_TRAIN[task] / rows:.0f}x these pairs); here the "
            "models overfit a few thousand pairs")
  return scale
SYN = "{}/n{}/seed*"
SYN_REGIME = ("{:,} training sequences, 1,500 steps x 64, 3 seeds; "
              + _untuned(3e-3, "100 steps").replace("{", "{{"))
SYN_SCALE = ("the paper's figure spans training sets up to 100k "
             "sequences (its steps and seeds are not given); single seeds "
             "spread widely here (the sds)")
IMG = "small/s300/{}/seed=*"
IMG_TUNED = "small/s300/tuned/model={}/seed=*"
PIXELS = ("linear on pixels", ("baselines", "small", "linear_pixels"))
PIXELS_CARVED = ("linear on pixels",
                 ("baselines", "small/s300/carved", "linear_pixels"))
IMG_N = ("baselines", "small", "test_images")
IMG_SCALE = ("ImageNet at 224x224 with 20-86M params; short runs of "
             "small models may favour the inductive biases of the spatial "
             "and token-mixing MLPs")


def _search_text(data: dict[str, Any], models: Sequence[str],
                 tuned: str, carved_from: str) -> str:
  """How the tuned runs of ``models`` (keys ``tuned.format(model)``, each
  recording its ``setting``) were chosen: the size of each model's search
  (its runs under the same prefix with ``/tune/`` and ``setting=``), and
  which choices sit at the search's largest or smallest learning rate,
  where a wider grid might move them."""
  search = tuned.replace("/tuned/", "/tune/").replace("seed=", "setting=")
  lrs = {m: [r["setting"]["lr"] for k, r in data["runs"].items()
             if fnmatch.fnmatchcase(k, search.format(m))] for m in models}
  counts = sorted({len(v) for v in lrs.values()})
  text = (f"each model's lr and warm-up chosen from "
          f"{'/'.join(map(str, counts))} settings on the validation "
          f"{carved_from} carved from train")
  edges = []
  for word, end in (("largest", max), ("smallest", min)):
    at = sorted({m for m in models for k, r in data["runs"].items()
                 if fnmatch.fnmatchcase(k, tuned.format(m))
                 and len(set(lrs[m])) > 1
                 and r["setting"]["lr"] == end(lrs[m])})
    if at:
      edges.append(f"{', '.join(at)} at the grid's {word} lr, "
                   f"{end(end(lrs[m]) for m in at):g}")
  return text + (f" ({'; '.join(edges)})" if edges else "")


def _image_regime(models: Sequence[str], base: str, tuned: bool
                  ) -> Callable[[dict[str, Any]], str]:
  """The regime of the image runs of ``models``, from their records:
  training images (the baseline's count), steps x batch, the models'
  sizes, and how their settings were chosen (``tuned``: each model's
  search, on the validation images carved from train)."""
  pattern = IMG_TUNED if tuned else IMG
  def regime(data: dict[str, Any]) -> str:
    runs = [r for m in models for k, r in data["runs"].items()
            if fnmatch.fnmatchcase(k, pattern.format(m))]
    if not runs:
      return "not run"
    # Older runs keep no arguments of their own; a key without 'b<batch>'
    # after the steps was run at the default batch (``images_lib.run_prefix``).
    steps = runs[0]["step"]
    batch = runs[0].get("args", {}).get("batch_size", images_lib.SMALL_BATCH)
    images = data["baselines"][base]["train_images"]
    sizes = _millions(r["params"] for r in runs)
    epochs = f"{steps * batch / images:.2f} epochs"
    if not tuned:
      return (f"CIFAR-10 32x32, {images:,} training images, {steps} steps x "
              f"{batch} ({epochs}), {sizes} params; each model at its "
              "config's lr and warm-up (not tuned)")
    checked = (images_lib.run_prefix("small", steps, batch), steps, models)
    same = selection.length_confirmed(data, *checked)
    return (f"CIFAR-10 32x32, {images:,} training images, {steps} steps x "
            f"{batch} ({epochs}; the length set by compute"
            + (_picked_on_carve(data, checked[0]) if same else "")
            + f"), {sizes} params" + ("" if same else _unconfirmed(
                data, checked)) + "; "
            + _search_text(data, models, pattern, "images"))
  return regime


MLM = "small/s2000/vocab=small/model={}/seed=*"
MLM_REGIME = ("C4 sample (0.5M train tokens, 8k vocabulary), 2,000 steps "
              "x 32 x 128 (8.2M tokens; length set on the held-out set), "
              "~1.5M params, perplexity on WikiText-2 valid; no search: "
              "every model at lr 1e-3, 20 warm-up steps (none tuned; the "
              "'both tuned alike' rows search all)")
# The MLM baselines are scored on each seed's masks: their mean.
MLM_BIGRAM = ("bigram", ("baselines", "small/s2000/vocab=small/seed=*",
                         "bigram"))
MLM_SCALE = ("the paper's 100M models on 1e9+ tokens; no model tuned "
             "here (with each pair tuned alike the verdict stays: the "
             "'both tuned alike' rows)")
MLM_TUNED = "small/s2000/vocab=small/tuned/model={}/seed=*"
MLM_GMLP_PAPER = "C4 ppl 4.35 (36 layers) vs 4.26 (12 layers)"
MLM_BIGRAM_CARVED = ("bigram", ("baselines",
                                "small/s2000/vocab=small/carved/seed=*",
                                "bigram"))
MLM_TUNED_SCALE = ("the paper's 100M models on 1e9+ tokens; the order of "
                   "two well-tuned small models may not hold at 100x the "
                   "width and depth")


def _picked_on_carve(data: dict[str, Any], prefix: str) -> str:
  """A regime's words for a length its rule also picks on the carved split
  (``selection.length_confirmed``), naming the lengths it was tried
  among."""
  tried = [f"{n:,}" for n in data["length_checks"][prefix]["lengths"]]
  return ("; the same rule picks it among " + ", ".join(tried[:-1])
          + " and " * (len(tried) > 1) + tried[-1]
          + " steps on the carved split")


def _mlm_tuned_regime(models: Sequence[str]
                      ) -> Callable[[dict[str, Any]], str]:
  """The tuned MLM runs' regime, from their records (steps, sizes, the
  carved split and each model's search)."""
  def regime(data: dict[str, Any]) -> str:
    runs = [r for m in models for k, r in data["runs"].items()
            if fnmatch.fnmatchcase(k, MLM_TUNED.format(m))]
    if not runs:
      return "not run"
    sizes = _millions(r["params"]["total"] for r in runs)
    train = data["c4_split"]["train"]["documents"]
    prefix = "small/s2000/vocab=small/"
    checked = selection.length_confirmed(data, prefix, runs[0]["step"],
                                         models)
    length = ("length set on the held-out set"
              + (_picked_on_carve(data, prefix) if checked else ""))
    return (f"{train} C4 documents (8k vocabulary), {runs[0]['step']:,} "
            f"steps x 32 x 128 ({length}), {sizes} "
            "params; "
            + _search_text(data, models, MLM_TUNED, "documents"))
  return regime
MOE = "small8k/s1000/runs/{}/seed=*"
MOE_BIGRAM = ("bigram", ("baselines", "small8k", "all", "bigram"))
MOE_REGIME = ("C4 sample train (8k vocabulary), WikiText-2 valid, 1,000 "
              "steps x 16 x 128 (2.0M tokens; length set on the held-out "
              "set), {params}, 4 experts, "
              "depths matched on FLOPs that count the MoE dispatch's one-hot "
              "einsums (on the arithmetic alone four depths move by one "
              "block); " + _untuned(sparse_lm.SCALES["small"]["lr"],
                         f"{sparse_lm.SMALL_VOCAB['warmup']} steps"))
MOE_SCALE = ("the paper's models run ~0.8 TFLOPs a step (d = 1024) with "
             "one expert per device; routing balance and capacity matter "
             "more with many experts")


def _unconfirmed(data: dict[str, Any],
                 checked: tuple[str, int, Sequence[str]] | None) -> str:
  """Why a tuned regime's length is not confirmed: the carved split's
  check picked another length (named), or it was not run."""
  r = data.get("length_checks", {}).get(checked[0], {}) if checked else {}
  if (r.get("picked") and r["picked"] != checked[1]
      and set(checked[2]) <= set(r.get("chosen", {}))):
    return (f" (on the carved split the same rule picks {r['picked']:,} "
            "steps: the length not confirmed)")
  return " (the length not confirmed on the carved split)"


def _tuned_regime(split: str, what: str, models: Sequence[str],
                  pattern: str, head: str,
                  checked: tuple[str, int, Sequence[str]] | None = None, *,
                  fixed: bool = False) -> Callable[[dict[str, Any]], str]:
  """The regime of a study's tuned runs: ``head`` (``{train}``: the carved
  train part's size from the record's ``split``; ``{checked}``: whether the
  length rule, under ``checked``'s (prefix, steps, models), picks the length
  on the carved split; where it was not asked, or does not, the regime says
  so, unless ``fixed``: a length the study holds fixed by design, which
  ``head`` says), then each model's search (``_search_text``)."""
  def regime(data: dict[str, Any]) -> str:
    train = data.get(split, {}).get("train", {}).get("documents", 0)
    same = checked and selection.length_confirmed(data, *checked)
    text = head.format(train=f"{train:,}", checked=(
        _picked_on_carve(data, checked[0]) if same else ""))
    if not same and not fixed:
      text += _unconfirmed(data, checked)
    return text + "; " + _search_text(data, models, pattern, what)
  return regime


SST2_TUNED = "w128_s1000_n64/tuned/model={}/seed=*"
TUNED = ", all tuned alike"


def _sst2(other: str, label: str, number: str, tuned: bool = False
          ) -> Claim:
  runs = SST2_TUNED if tuned else SST2
  base = "w128_s1000_n64/carved" if tuned else "w128_s1000_n64"
  return Claim(HM, "glue_from_scratch", f"SST-2: HyperMixer above {label}"
               + (TUNED if tuned else ""), number,
               Arm("HyperMixer", runs.format("hypermixer")),
               (Arm(label, runs.format(other)),), "higher",
               ("Naive Bayes", ("baselines", base, "naive_bayes")),
               ("baselines", base, "dev_rows"),
               regime=_tuned_regime(
                   "sst2_split", "sentences", ("hypermixer", other), runs,
                   "SST-2, {train} train phrases (a tenth of the sentences "
                   "carved out), "
                   "1,000 steps x 64 (budget set on dev{checked}), "
                   "~1.3M params",
                   checked=("w128_s1000_n64/", 1000, glue.MIXERS))
               if tuned else
               SST2_REGIME, at_scale=SST2_SCALE, when_recorded=tuned,
               untuned=not tuned)


# The models of the pair tasks' tuned runs, all judged by the length rule.
NLI_MODELS = ("hypermixer", "attention", "mlp_mixer")


def _nli(task: str, number: str, tuned: bool = False,
         other: tuple[str, str] = ("attention", "Transformer")) -> Claim:
  name, label = other
  budget = "w128_s1000_n128_g"
  runs = (f"{budget}/task={task}/tuned/model={{}}/seed=*" if tuned
          else NLI.format(task, "{}"))
  base = ("baselines", f"{budget}/task={task}/carved" if tuned
          else f"{task}/{budget}")
  return Claim(HM, "nli_splits",
               f"{task.upper()}: HyperMixer above "
               f"{'the ' if name == 'attention' else ''}{label}"
               + (TUNED if tuned else ""), number,
               Arm("HyperMixer", runs.format("hypermixer")),
               (Arm(label, runs.format(name)),),
               "higher", ("Naive Bayes", (*base, "naive_bayes")),
               (*base, "dev_rows"), regime=(lambda data: _tuned_regime(
                   f"{task}_split", f"{nli.GROUP_BY[task]}s",
                   ("hypermixer", name), runs,
                   f"{task.upper()}: {{train}} pairs of the dev file's "
                   f"train part (a tenth of the {nli.GROUP_BY[task]}s "
                   "carved out), 1,000 steps x 64 (SST-2's small budget"
                   "{checked}), "
                   + _nli_params(data, runs, ("hypermixer", name)),
                   checked=(f"{budget}/task={task}/", 1000, NLI_MODELS)
               )(data))
               if tuned
               else _nli_regime(task, ("hypermixer", name)),
               at_scale=_nli_scale(task, tuned), when_recorded=tuned,
               untuned=not tuned)


def _low_resource(tuned: bool = False) -> Claim:
  runs = ("w128_s1000/fraction=0.1/tuned/model={}/seed=*" if tuned else
          "w128_s1000/fraction=0.1/model={}/seed=*")
  base = "w128_s1000/fraction=0.1/carved" if tuned else "0.1"
  return Claim(HM, "low_resource", "SST-2 at 10% of the labels: HyperMixer "
               "above the Transformer" + (TUNED if tuned else ""),
               "SNLI/MNLI: +12-14% relative at 10%",
               Arm("HyperMixer", runs.format("hypermixer")),
               (Arm("Transformer", runs.format("attention")),),
               "higher", ("Naive Bayes", ("baselines", base, "naive_bayes")),
               ("baselines", base, "dev_rows"), regime=_tuned_regime(
                   "sst2_10pct_split", "sentences", ("hypermixer", "attention"),
                   runs, "SST-2, 10% of train less a tenth of the sentences "
                   "({train} phrases), 1,000 steps x 64 (the budget at 100%"
                   "{checked})", checked=("w128_s1000/fraction=0.1/", 1000,
                                          ("hypermixer", "attention")))
               if tuned else
               "SST-2, 10% of train (6.7k phrases), 1,000 steps x 64; "
               + GLUE_UNTUNED, at_scale="the paper measures SNLI/MNLI, not "
               "SST-2, at 11M params", when_recorded=tuned,
               untuned=not tuned)


def _tuning_cost() -> Claim:
  """The best random-search draws against each other, chosen on phrases
  carved from train (``tuning_cost --carve``; those chosen on dev, the set
  they are scored on, get no verdict)."""
  base = "w128_s1000_n64_carved"
  return Claim(
      HM, "tuning_cost", "tuning: HyperMixer's best random-search draw above "
      "the Transformer's, chosen on carved phrases",
      "expected-max curve above (§4.6)",
      Arm("HyperMixer", record=("best_draws_carved", "hypermixer",
                                "accuracy")),
      (Arm("Transformer", record=("best_draws_carved", "attention",
                                  "accuracy")),),
      "higher", ("Naive Bayes", ("baselines", base, "naive_bayes")),
      ("baselines", base, "dev_rows"),
      regime=("SST-2 less a carved tenth, 20 draws of (lr, dropout) per "
              "model scored on that tenth, 1,000 steps; the best draw's 3 "
              "seeds scored on dev"),
      at_scale="11M models may rank the draws otherwise", when_recorded=True)


def _synthetic(size: int, tuned: bool = False) -> Claim:
  runs = (f"s1500/n{size}/tuned/model={{}}/seed=*" if tuned
          else SYN.format("{}", size))
  arms = (Arm("HyperMixer", runs.format("hypermixer"), ("mse",)),
          Arm("attention", runs.format("attention"), ("mse",)))
  return Claim(HM, "synthetic_data_efficiency",
               f"synthetic, {size:,} sequences: HyperMixer's test MSE below "
               "attention's (more data-efficient below 100k)"
               + (TUNED if tuned else ""),
               "a figure, no numbers", arms[0], arms[1:],
               "lower", ("copy the input", ("baselines", "copy_input")),
               scale=1.0, spec="+.1e", regime=(lambda data: _ran_on(
                   data, _tuned_regime(
                       "", "sequences", ("hypermixer", "attention"), runs,
                       f"{size:,} training sequences, 1,500 steps x 64 (one "
                       "length at every size, so that the sizes differ only "
                       "in data: held fixed, not chosen)", fixed=True
                   )(data), *arms, search=tuple(
                       f"s1500/n{size}/tune/model={m}/setting=*"
                       for m in ("hypermixer", "attention"))))
               if tuned else SYN_REGIME.format(size),
               at_scale=SYN_SCALE, when_recorded=tuned, untuned=not tuned)


SYN_PAPER = "synthetic_data_efficiency_paper"
SYN_PAPER_REGIME = ("{:,} training sequences (the paper's sizes), 5,000 "
                    "steps x 64; "
                    + _untuned(3e-3, "100 steps").replace("{", "{{"))
SYN_PAPER_SCALE = ("the paper's sizes, but untuned: the tuned runs at 1,500 "
                   "steps chose other rates, which differ by size and model")


def _ran_on(data: dict[str, Any], regime: str, *arms: Arm,
            search: tuple[str, ...] = ()) -> str:
  """``regime`` and where the arms' runs ran (records before ``ran_on``
  ran on CPUs): per side where the sides differ, and where the search runs
  (``search``: their key patterns) ran if that differs from the reported
  runs."""
  def where(patterns) -> list[str]:
    found = {r.get("ran_on", records_lib.CPU) for k, r in data["runs"].items()
             if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
    return sorted("CPU" if w == records_lib.CPU else w for w in found)

  sides = [(a.label, where([a.pattern])) for a in arms]
  every = where([a.pattern for a in arms])
  if not every:
    return regime
  if len({tuple(w) for _, w in sides}) > 1:
    text = (f"{regime}; the sides ran on different devices: "
            + "; ".join(f"{label}'s runs on {' and '.join(w)}"
                        for label, w in sides))
  else:
    text = f"{regime}; ran on {' and '.join(every)}"
  searched = where(search) if search else []
  if searched and searched != every:
    text += f"; the search on {' and '.join(searched)}"
  return text


def _synthetic_paper(size: int, other: str = "attention") -> Claim:
  """A claim at the paper's scale: HyperMixer below attention below 100k
  sequences and equal to it (within 10%) from 100k; MLP-Mixer above
  HyperMixer (``other='mlp_mixer'``)."""
  mixer = other == "mlp_mixer"
  equal = size >= 100_000 and not mixer
  text = (f"synthetic at the paper's scale, {size:,} sequences: "
          + ("MLP-Mixer's test MSE above HyperMixer's" if mixer else
             "HyperMixer's test MSE equal to attention's (within 10%)"
             if equal else "HyperMixer's test MSE below attention's"))
  arm = lambda m, label: Arm(label, SYN.format(m, size), ("mse",))  # noqa: E731
  ours, theirs = arm("hypermixer", "HyperMixer"), arm("attention", "attention")
  if mixer:
    ours, theirs = arm("mlp_mixer", "MLP-Mixer"), ours
  return Claim(HM, SYN_PAPER, text,
               "5-10x the data for the same MSE (Fig. 5b)" if mixer else
               "a figure, no numbers", ours, (theirs,),
               "higher" if mixer else "equal" if equal else "lower",
               ("copy the input", ("baselines", "copy_input")), scale=1.0,
               spec="+.1e", margin=0.1 if equal else None,
               relative_margin=equal, regime=lambda data: _ran_on(
                   data, SYN_PAPER_REGIME.format(size), ours, theirs),
               at_scale=SYN_PAPER_SCALE, untuned=True)


def _exponent(kind: str, what: str) -> Measured:
  return Measured(
      HM, "token_mixing_cost", f"token mixing's {what} linear in N for "
      "HyperMixer, quadratic for attention (log-log exponent)",
      "a figure, no numbers (§4.4, Fig. 2)",
      ("HyperMixer", ("exponents", "hypermixer", kind)),
      (("attention", ("exponents", "attention", kind)),), "lower",
      regime="one example, d = 256, N = 32-8,192 on one CPU core (time: "
      "median of 5 rounds interleaved with a matmul ceiling, in the "
      "ceiling's units); slope over the upper half of N",
      at_scale="on accelerators attention's quadratic term shows later "
      "(fused, memory-bound kernels), so the crossover N moves up")


def _mlm_vs_bert(model: str, claim: str, paper: str, direction: str, *,
                 tuned: bool) -> Claim:
  """An MLM claim of ``model`` against BERT: at the shared untuned setting,
  or with both tuned alike (their searches on carved C4 documents)."""
  label = {"gmlp": "gMLP", "amlp": "aMLP"}[model]
  runs = MLM_TUNED if tuned else MLM
  return Claim(GMLP, "mlm_perplexity",
               claim + (", both tuned alike" if tuned else ""), paper,
               Arm(label, runs.format(model), PPL),
               (Arm("BERT", runs.format("attention"), PPL),), direction,
               MLM_BIGRAM_CARVED if tuned else MLM_BIGRAM, scale=1.0,
               regime=(_mlm_tuned_regime((model, "attention")) if tuned
                       else MLM_REGIME),
               at_scale=MLM_TUNED_SCALE if tuned else MLM_SCALE,
               untuned=not tuned,
               baseline_tuned=True)


MOE_TUNED = "small8k/s1000/tuned/model={}/seed=*"


def _moe_params(data: dict[str, Any], models: Sequence[str]) -> str:
  """The planned sizes of ``models`` (the record's ``plan``), in millions:
  one number, or the smallest and the largest."""
  return _millions(data["plan"][m]["params"] for m in models) + " params"


def _moe_regime(tuned: bool, models: Sequence[str]
                ) -> Callable[[dict[str, Any]], str]:
  """The MoE runs' regime: the shared setting, the compared models' sizes
  and (``tuned``) the carved split and each model's search."""
  def regime(data: dict[str, Any]) -> str:
    params = _moe_params(data, models)
    if not tuned:
      return MOE_REGIME.replace("{params}", params)
    return _tuned_regime(
        "c4_split", "documents", models, MOE_TUNED, "C4 sample train less a "
        "carved tenth ({train} documents, 8k vocabulary), WikiText-2 valid, "
        "1,000 steps x 16 x 128 (length set on the held-out set{checked}), "
        f"{params}, 4 experts", checked=("small8k/s1000/", 1000, models))(data)
  return regime


def _moe_pair(other: str, label: str, tuned: bool = False) -> Claim:
  runs = MOE_TUNED if tuned else MOE
  return Claim(SMLP, "smlp_vs_moe",
               f"sMLP (deterministic): lower perplexity than {label}"
               + (TUNED if tuned else ""),
               "best valid ppl of all (§4.3, Table 4)",
               Arm("sMLP", runs.format("smlp_deterministic"),
                   PPL),
               (Arm(label, runs.format(other), PPL),), "lower",
               ("bigram", ("baselines", "small8k/s1000/carved", "all",
                           "bigram")) if tuned else MOE_BIGRAM, scale=1.0,
               regime=_moe_regime(tuned, ("smlp_deterministic", other)),
               at_scale=MOE_SCALE, when_recorded=tuned, untuned=not tuned,
               baseline_tuned=True)


def _hash_lowest(tuned: bool = False) -> Claim:
  runs = MOE_TUNED if tuned else MOE
  others = (("switch", "Switch"), ("gshard", "GShard"),
            ("base_layers", "Base Layers"))
  return Claim(SMLP, "smlp_vs_moe", "HASH Layers the lowest perplexity of "
               "the Transformer MoEs" + (TUNED if tuned else ""),
               "best of the Transformer MoEs (Table 4)",
               Arm("HASH", runs.format("hash"), PPL),
               tuple(Arm(label, runs.format(name), PPL)
                     for name, label in others),
               "lower", ("bigram", ("baselines", "small8k/s1000/carved",
                                    "all", "bigram")) if tuned else MOE_BIGRAM,
               scale=1.0, regime=_moe_regime(
                   tuned, ("hash",) + tuple(n for n, _ in others)),
               at_scale=MOE_SCALE, when_recorded=tuned, untuned=not tuned,
               baseline_tuned=True)


SST2_PAIRS = (("attention", "the Transformer", "81.4 vs 79.4 (test)"),
              ("gmlp", "gMLP", "81.4 vs 79.5 (test)"),
              ("mlp_mixer", "MLP-Mixer", "81.4 vs 81.2 (test)"),
              ("fnet", "FNet", "81.4 vs 80.0 (test)"),
              ("linear_attention", "the Linear Transformer",
               "81.4 vs 80.8 (test)"))
NLI_PAPER = (("mnli", "66.1 vs 65.8 (test)"), ("snli", "81.7 vs 80.7 (test)"),
             ("qnli", "77.1 vs 73.2 (test)"))
NLI_MIXER = (("mnli", "66.1 vs 62.9 (test)"), ("snli", "81.7 vs 80.1 (test)"),
             ("qnli", "77.1 vs 70.5 (test)"))
MIXER = ("mlp_mixer", "MLP-Mixer")
MOE_PAIRS = (("switch", "Switch Transformer"), ("gshard", "GShard"),
             ("base_layers", "Base Layers"), ("hash", "HASH Layers"),
             ("transformer", "the dense Transformer"), ("gmlp", "dense gMLP"))


CLAIMS: tuple[Claim | Measured, ...] = (
    *(_sst2(*pair) for pair in SST2_PAIRS),
    *(_sst2(*pair, tuned=True) for pair in SST2_PAIRS),
    *(_nli(*pair) for pair in NLI_PAPER),
    *(_nli(*pair, tuned=True) for pair in NLI_PAPER),
    *(_nli(*pair, other=MIXER) for pair in NLI_MIXER),
    *(_nli(*pair, tuned=True, other=MIXER) for pair in NLI_MIXER),
    _low_resource(),
    _low_resource(tuned=True),
    _tuning_cost(),
    _exponent("time", "wall time"),
    _exponent("flops", "FLOPs"),
    *(_synthetic(n) for n in (500, 5_000, 50_000)),
    *(_synthetic(n, tuned=True) for n in (500, 5_000, 50_000)),
    Claim(HM, "synthetic_data_efficiency", "synthetic, 50,000 sequences: "
          "MLP-Mixer's test MSE above HyperMixer's", "5-10x the data for "
          "the same MSE (Fig. 5b)",
          Arm("MLP-Mixer", SYN.format("mlp_mixer", 50_000), ("mse",)),
          (Arm("HyperMixer", SYN.format("hypermixer", 50_000), ("mse",)),),
          "higher", ("copy the input", ("baselines", "copy_input")), scale=1.0,
          spec="+.1e", regime=SYN_REGIME.format(50_000),
          at_scale=SYN_SCALE, untuned=True),
    *(_synthetic_paper(n) for n in (1_000, 10_000, 100_000)),
    _synthetic_paper(100_000, "mlp_mixer"),
    Claim(GMLP, "image_classification", "CIFAR-10: gMLP above MLP-Mixer",
          "ImageNet top-1: gMLP-S 79.6 (20M), Mixer-B/16 76.4 (59M)",
          Arm("gMLP", IMG.format("gmlp"), ("test", "accuracy")),
          (Arm("MLP-Mixer", IMG.format("mixer"), ("test", "accuracy")),),
          "higher", PIXELS,
          IMG_N, regime=_image_regime(("gmlp", "mixer"), "small", tuned=False),
          at_scale=IMG_SCALE, untuned=True, baseline_tuned=True),
    Claim(GMLP, "image_classification", "CIFAR-10: gMLP above MLP-Mixer, "
          "both tuned alike",
          "ImageNet top-1: gMLP-S 79.6 (20M), Mixer-B/16 76.4 (59M)",
          Arm("gMLP", IMG_TUNED.format("gmlp"), ("test", "accuracy")),
          (Arm("MLP-Mixer", IMG_TUNED.format("mixer"), ("test", "accuracy")),),
          "higher", PIXELS_CARVED,
          IMG_N, regime=_image_regime(("gmlp", "mixer"), "small/s300/carved",
                                      tuned=True),
          at_scale=IMG_SCALE),
    Claim(GMLP, "image_classification", "CIFAR-10: gMLP level with a ViT "
          "(equal within 1 point), both tuned alike",
          "ImageNet top-1: gMLP-B 81.6, DeiT-B 81.8",
          Arm("gMLP", IMG_TUNED.format("gmlp"), ("test", "accuracy")),
          (Arm("ViT", IMG_TUNED.format("vit"), ("test", "accuracy")),),
          "equal", PIXELS_CARVED,
          IMG_N, margin=0.01,
          regime=_image_regime(("gmlp", "vit"), "small/s300/carved",
                                tuned=True),
          at_scale=IMG_SCALE),
    _mlm_vs_bert("gmlp", "MLM: gMLP's perplexity slightly above BERT's",
                 MLM_GMLP_PAPER, "higher", tuned=False),
    _mlm_vs_bert("gmlp", "MLM: gMLP's perplexity slightly above BERT's",
                 MLM_GMLP_PAPER, "higher", tuned=True),
    _mlm_vs_bert("amlp", "MLM: aMLP's perplexity at most BERT's",
                 "not in PAPERS.md", "lower", tuned=False),
    _mlm_vs_bert("amlp", "MLM: aMLP's perplexity at most BERT's",
                 "not in PAPERS.md", "lower", tuned=True),
    *(_moe_pair(*pair) for pair in MOE_PAIRS),
    _hash_lowest(),
    *(_moe_pair(*pair, tuned=True) for pair in MOE_PAIRS),
    _hash_lowest(tuned=True),
)

HEADERS = ("paper", "claim", "paper's number", "ours (mean ± sd, 95% CI)",
           "against (mean ± sd)", "trivial baseline", "verdict (difference "
           "[95% CI], p)", "regime", "why it may change at scale")


def _mean_sd_ci(values: Sequence[float], c: Claim, ci: bool = True,
                n_eval: int | None = None) -> str:
  """``'80.7 ± 0.9 (n=3), 95% CI [78.4, 83.0]'`` in the claim's units (for
  accuracies, the interval carries the evaluation set's noise)."""
  if not values:
    return "not run"
  f = c.spec.lstrip("+")
  mean, sd = stats.mean_sd(values)
  text = f"{c.scale * mean:{f}} ± {c.scale * sd:{f}} (n={len(values)})"
  if ci and len(values) > 1:
    _, low, high = stats.mean_ci(values, n_eval=n_eval)
    text += f", 95% CI [{c.scale * low:{f}}, {c.scale * high:{f}}]"
  return text


def _joint_word(verdicts: Sequence[stats.Verdict]) -> str:
  """A claim against k models: 'agrees' where every pair agrees (each test
  at alpha keeps the claim's error at alpha), 'disagrees' where a pair
  disagrees at alpha / k (Bonferroni: any of k pairs could disagree by
  chance), else 'not decided'."""
  if all(v.word == "agrees" for v in verdicts):
    return "agrees"
  k = len(verdicts)
  for v in verdicts:
    if v.word != "disagrees":
      continue
    p = (v.test.p if v.test.p < stats.ALPHA or v.p_equal is None
         else v.p_equal)
    if k == 1 or p < stats.ALPHA / k:
      return "disagrees"
  return "not decided"


def judge(c: Claim, data: dict[str, Any]) -> list[str]:
  """The claim's row of the table from its experiment's record ``data``."""
  ours = c.ours.values(data)
  n_eval = int(_path(data, c.n_eval)) if c.n_eval else None
  verdicts = []
  for other in c.others:
    theirs = other.values(data)
    if not ours or not theirs:
      return [c.paper, c.text, c.paper_number,
              _mean_sd_ci(ours, c, n_eval=n_eval),
              "not run", "", "not run", c.regime_text(data), c.at_scale_text(data)]
    margin = (c.margin * sum(theirs) / len(theirs) if c.relative_margin
              else c.margin)
    verdicts.append(stats.verdict(ours, theirs, c.direction, n_eval=n_eval,
                                  margin=margin))
  if c.untuned:
    word = NO_VERDICT
    cells = [v.detail(c.scale, spec=c.spec) for v in verdicts]
  else:
    word = _joint_word(verdicts)
    cells = [v.text(c.scale, spec=c.spec) for v in verdicts]
  verdict = (f"{NO_VERDICT}: {cells[0]}" if c.untuned and len(cells) == 1
             else cells[0] if len(cells) == 1 else f"{word}: " + "; ".join(
                 f"vs {o.label}: {t}" for o, t in zip(c.others, cells)))
  label, path = c.baseline
  base = ""
  if path:
    # A baseline scored once is a number; one scored on each seed's masks
    # has a spread of its own, and is tested as a model is (Welch).
    values = _values_at(data, path)
    baseline = values[0] if len(values) == 1 else values
    base = f"{label} " + (_mean_sd_ci(values, c, ci=False)
                          if len(values) > 1
                          else f"{c.scale * values[0]:{c.spec.lstrip('+')}}")
    if len(ours) >= stats.MIN_SEEDS:
      base += ": ours " + stats.against_baseline(
          ours, baseline, n_eval=n_eval,
          untuned=c.untuned and c.baseline_tuned).text(c.scale, spec=c.spec)
  against = "; ".join(f"{o.label} {_mean_sd_ci(o.values(data), c, False)}"
                      for o in c.others)
  return [c.paper, c.text, c.paper_number,
          _mean_sd_ci(ours, c, n_eval=n_eval), against,
          base, verdict, c.regime_text(data), c.at_scale_text(data)]


def table(results: pathlib.Path,
          claims: Sequence[Claim | Measured] = CLAIMS) -> str:
  """The claims table (Markdown) from the records under ``results``."""
  records: dict[str, dict[str, Any]] = {}
  for c in claims:
    if c.experiment not in records:
      path = results / c.experiment / "results.json"
      if not path.exists():
        raise FileNotFoundError(
            f"claims: no record {path} for the claim '{c.text}'; run its "
            "experiment, or pass --results=DIR (the experiments' results).")
      records[c.experiment] = json.loads(path.read_text(encoding="utf-8"))
  rows = [c.row(records[c.experiment]) for c in claims
          if not getattr(c, "when_recorded", False)
          or c.recorded(records[c.experiment])]
  return (tables.markdown_table(HEADERS, rows) + "\n\n"
          + stats.VERDICT_NOTE + f" '{NO_VERDICT}': every model ran at "
          "one shared setting, none searched, so the difference and p are "
          "shown but decide nothing (an equal search may reorder close "
          "models; the rows tuned alike decide); so does a test against a "
          "trivial baseline whose own setting was searched (the pixels' "
          "ridge penalty, the bigram's add-k) in those rows. The 95% CI of "
          "'ours' is the seeds' t "
          "interval; for accuracies it carries the evaluation set's binomial "
          "noise too. Accuracies in points; perplexities and "
          "MSE as recorded; a claim against k models agrees only "
          "where every pair does, and disagrees where a pair does at alpha "
          "/ k (Bonferroni). The papers' numbers are from their own "
          "settings (PAPERS.md, and the papers' text where it names a section "
          "or table) and are not comparable in absolute value.")


def insert(text: str, file: pathlib.Path) -> None:
  """Replaces what lies between ``file``'s ``<!-- claims -->`` and
  ``<!-- /claims -->`` lines with ``text``."""
  doc = file.read_text(encoding="utf-8")
  pattern = re.compile(r"(<!-- claims -->\n).*?(<!-- /claims -->)", re.S)
  if not pattern.search(doc):
    raise ValueError(f"{file}: no '<!-- claims -->' ... '<!-- /claims -->' "
                     "lines to put the claims table between; add them.")
  file.write_text(pattern.sub(lambda m: m[1] + text + "\n" + m[2], doc),
                  encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> str:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--results", default="experiments/results",
                 help="the folder of the experiments' records")
  p.add_argument("--out", default="",
                 help="the table's file (default RESULTS/claims.md)")
  p.add_argument("--insert", default="",
                 help="a Markdown file to put the table into, between its "
                 "'<!-- claims -->' and '<!-- /claims -->' lines")
  args = p.parse_args(argv)
  results = pathlib.Path(args.results)
  text = ("## Claims of the papers against the committed records\n\n"
          "Generated by `python -m hypermixer_jax.experiment.claims` from "
          "each experiment's `results.json`.\n\n" + table(results) + "\n")
  out = pathlib.Path(args.out) if args.out else results / "claims.md"
  out.write_text(text, encoding="utf-8")
  if args.insert:
    insert(text, pathlib.Path(args.insert))
  print(text)
  return text


if __name__ == "__main__":
  main()
