"""The pretrain-then-fine-tune study (``experiments/pretrain_finetune.py``):
its configs (masked-LM pretraining of the classifier's encoder, fine-tuning
from it or from scratch), the linear probe of a pretrained encoder against a
fresh one, and the report (table and figure) of the recorded cells."""
from __future__ import annotations

import pathlib

import ml_collections
import numpy as np

from hypermixer_jax import experiment
from hypermixer_jax.experiment import glue
from hypermixer_jax.experiment import mlm
from hypermixer_jax.experiment import nli
from hypermixer_jax.experiment import selection

# The two arms of every setting, each with its own search.
ARMS = ("scratch", "pretrained")
TASK_LABELS = {"sst2": "SST-2", "mnli": "MNLI-m", "snli": "SNLI",
               "qnli": "QNLI"}
SMALL = dict(width=128, seq_len=64, batch_size=64, pretrain_steps=3000,
             pretrain_lr=1e-3, finetune_steps=1000, lrs="3e-4,1e-3,3e-3,1e-2",
             warmup_shares="0.02,0.1", fractions="0.1,1.0")
C4_TRAIN_ALL = ("c4/c4_en_tfds_minimal_train_1000.jsonl,"
                "c4/c4_en_train_00000_first1000.jsonl")
# The bar: pretrained beats scratch by this many points at 10% of the labels,
# read for every model alike (no model picked on dev first).
TARGET_GAIN = 2.0
# The linear probe's L2 weight on standardised features (fixed, not tuned on
# dev).
PROBE_L2 = 1e-2


# The fine-tuning configs' own warm-up share (``glue.glue_config``'s).
WARMUP = 0.1


def warmup_key(share: float) -> dict:
  """The warm-up share in a cell's key: none for the configs' own."""
  return {} if share == WARMUP else {"warmup": share}


def finetune_config(mixer: str, shared: pathlib.Path, vocab: dict, *,
                    lr: float, seed: int, fraction: float, out: pathlib.Path,
                    steps: int, init: str = "", task: str = "sst2",
                    warmup: float = WARMUP) -> ml_collections.ConfigDict:
  """The classifier run of ``task``: from scratch (``init=''``) or
  fine-tuned from the pretraining workdir ``init`` (encoder loaded,
  classifier new), warm-up ``warmup`` of the steps. SST-2 trains on
  ``fraction`` of its train phrases and is scored on its dev file; a pair
  task on the train part of ``nli_splits``'s cut of its dev file (written
  under ``out``), scored on the test part."""
  if task == "sst2":
    train = experiment.require(shared / "glue/SST-2/train.tsv", "SST-2 train")
    file = train if fraction >= 1 else glue.subset_tsv(
        train, fraction, out)
    c = glue.glue_config("sst2", mixer, "small", lr, shared, train_file=file,
                         seed=seed, vocab=vocab, width=SMALL["width"],
                         seq_len=SMALL["seq_len"], steps=steps)
  elif task in nli.FILES:
    if fraction < 1:
      raise ValueError(f"pretrain_finetune: fraction={fraction:g} applies to "
                       f"sst2 only; the {task} train part (about 8k pairs) "
                       "is used whole (fraction=1).")
    file = nli.FILES[task][0]
    split = nli.split_file(
        experiment.require(shared / file, f"{task} dev file"), out, task)
    c = nli.task_config(task, mixer, split, vocab, shared, seed=seed,
                               width=SMALL["width"], steps=steps,
                               seq_len=SMALL["seq_len"])
    c.learning_rate = lr
  else:
    raise ValueError(f"pretrain_finetune: unknown task {task!r}; tasks: "
                     f"sst2, {', '.join(nli.FILES)}.")
  if init:
    c.init_checkpoint = init
    c.init_reinit = "(?!encoder/)"     # configs/glue.py's finetune setting
  if warmup != WARMUP:   # (else the config's own, unchanged)
    c.warmup_steps = max(1, round(warmup * c.num_train_steps))
  return c


def carve_setting(config: ml_collections.ConfigDict, out: pathlib.Path,
                  task: str, sentences=None) -> dict:
  """The validation split that chooses the setting's learning rate, carved
  from its train file (``config``'s) into ``out/splits``
  (``selection.carve_lines``): every ``VALIDATION_EVERY``-th SST-2 sentence
  with all its phrases (``sentences``: ``glue.sentence_groups`` of the
  whole train file), every ``VALIDATION_EVERY``-th premise (or question)
  of a pair task with all of its pairs, as in ``nli_splits``' cut."""
  train = pathlib.Path(config.data.local_files.train)
  tsv = train.suffix == ".tsv"
  if task == "sst2" and sentences is None:
    raise ValueError("carve_setting: SST-2 is carved by sentence; pass "
                     "sentences=glue.sentence_groups(<SST-2 train.tsv>).")
  group = nli.carve_groups(str(train), task) if task != "sst2" else sentences
  names = tuple(f"{train.stem}_carved_{part}{train.suffix}"
                for part in ("train", "validation"))
  return selection.carve_lines(train, out / "splits", names=names,
                               header=tsv, group=group)


def carved_alike(record: dict, split: dict) -> bool:
  """Whether a selection run's ``record`` was scored on ``split``'s carved
  validation part (the sha256 it recorded)."""
  recorded = record.get("split", {}).get("validation", {})
  return recorded.get("sha256") == split["validation"]["sha256"]


def retire_other_carve(exp, key: str, split: dict) -> None:
  """Retires (``Experiment.supersede``) the selection run recorded as
  ``key`` when it was scored on another carved validation split than
  ``split``, so that it runs again instead of choosing from other data."""
  if key in exp.runs and not carved_alike(exp.runs[key], split):
    exp.supersede(key, "carved from another validation split")


def carved_search_run(exp, key: str, split: dict, run, train: bool
                      ) -> str | None:
  """``key`` of a selection run scored on ``split``: run it (``exp.cell``)
  where ``train``, after retiring a record of it from another carved split;
  else None where such a record stands (no choice is made from it: the
  process that trains its arm retires and reruns it)."""
  if train:
    retire_other_carve(exp, key, split)
    exp.cell(key, run)
  elif key in exp.runs and not carved_alike(exp.runs[key], split):
    return None
  return key


def retire_other_decay(exp, mixer: str, shared: pathlib.Path, vocab: dict,
                       tasks) -> list[str]:
  """Retires ``mixer``'s records (pretraining, probes, both arms, every
  task) trained under the earlier weight-decay rule where it decays other
  leaves of the study's models (``experiment.retire_other_decay_rule``):
  they train again, never mixed with runs of the current rule."""
  models = [pretrain_config(mixer, shared, vocab, seed=0, steps=1).model] + [
      finetune_config(mixer, shared, vocab, lr=1.0, seed=0, fraction=1.0,
                      out=exp.out, steps=1, task=task).model
      for task in dict.fromkeys(("sst2", *tasks))]
  return experiment.retire_other_decay_rule(
      exp, [k for k in exp.runs if f"model={mixer}/" in k], models)


def select_key(tag: str, mixer: str, task: str, fraction: float, arm: str,
               lr: float, share: float) -> str:
  """The key of a search's selection run (seed ``selection.SEED``)."""
  return experiment.cell_key(f"select/{tag}", dict(
      task=task, model=mixer, fraction=fraction, arm=arm, lr=lr,
      **warmup_key(share), seed=selection.SEED))


def choose_carved(runs: dict, search: dict, grid: list) -> tuple | None:
  """The setting of ``grid`` ((lr, warm-up share)) whose selection run
  (``search``: {setting: its key in ``runs``}) scored the best accuracy on
  its carved validation split; ties go to the earlier setting; None where
  every run diverged or scored NaN (never chosen: ``selection.choose``)."""
  pick = selection.choose({"arm": [
      dict(runs[search[g]], setting={"i": i}) for i, g in enumerate(grid)]},
                          lambda r: r["eval"]["accuracy"], higher=True)
  return grid[pick["arm"]["i"]] if pick else None


def selection_config(config: ml_collections.ConfigDict, split: dict
                     ) -> ml_collections.ConfigDict:
  """``config`` as a learning-rate selection run: trained on ``split``'s
  carved train part, evaluated once at the end on its carved validation
  part (the reported dev or test file never read)."""
  return selection.carved(config, split, select=True)


def pretrain_config(mixer: str, shared: pathlib.Path, vocab: dict, *,
                    seed: int, steps: int) -> ml_collections.ConfigDict:
  """MLM pretraining of the classifier's own encoder (the same model config
  with the MLM head), ``mlm_perplexity``'s held-out set, trained on both C4
  samples (``C4_TRAIN_ALL``), at the classifier's sequence length."""
  model = finetune_config(mixer, shared, vocab, lr=1.0, seed=seed,
                          fraction=1.0, out=pathlib.Path("."),
                          steps=1).model
  model.head = "mlm"
  c = mlm.train_config(model, "small", shared, steps=steps, seed=seed,
                       vocab=vocab)
  c.data.seq_len = SMALL["seq_len"]
  c.data.local_files.train = ",".join(
      experiment.require(shared / f, "C4 sample")
      for f in C4_TRAIN_ALL.split(","))
  c.batch_size = SMALL["batch_size"]
  c.learning_rate = SMALL["pretrain_lr"]
  c.warmup_steps = max(1, steps // 10)
  c.eval_every = max(1, steps // 5)
  # Periodic checkpoints (an interrupted pretraining resumes); the loop
  # always saves the last step, the one fine-tuning reads.
  c.checkpoint_every = max(1, steps // 5)
  return c


def _tflops(run: dict, steps: int) -> str:
  """TFLOPs of ``steps`` train steps of ``run`` (XLA's count of one step)."""
  return f"{steps * experiment.flops_per_step(run) / 1e12:.3g}"


def _final(runs: dict, keys: list[str]) -> list[float]:
  return [runs[k]["eval"]["accuracy"] for k in keys if k in runs]


def probe_encoders(config: ml_collections.ConfigDict, pretrained: str,
                   seed: int, l2: float = PROBE_L2) -> dict:
  """What pretraining put into the features: dev accuracy of a linear probe
  (``probe.logistic_regression`` on the pooled encoder output, L2 ``l2``)
  trained on ``config``'s train rows, for the encoder of the pretraining
  workdir ``pretrained`` and for a freshly initialised one (seed ``seed``),
  with the same classifier model and rows."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import heads  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import probe  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  train = experiment.pipeline_arrays(config.data, "train")
  dev = experiment.pipeline_arrays(config.data, config.eval_split)
  inputs, kwargs = heads.model_inputs(
      {k: v[:2] for k, v in train.items()}, config.model.head)
  model = models.build_model(config.model)
  fresh = nn.unbox(jax.jit(lambda key, x, kw: model.init(key, x, **kw))(
      jax.random.key(seed), inputs, kwargs)["params"])
  encoders = {"random": fresh, "pretrained": checkpoint.load_pretrained(
      pretrained, fresh, reinit=(config.init_reinit,))}
  out = {"l2": l2, "train_rows": len(train["label"]),
         "dev_rows": len(dev["label"])}
  for name, params in encoders.items():
    pred = probe.logistic_regression(
        probe.pooled_features(config.model, params, train), train["label"],
        probe.pooled_features(config.model, params, dev),
        num_classes=config.model.num_classes, l2=l2)
    out[name] = float(np.mean(pred == dev["label"]))
  return out


def search_grid(args, task: str) -> list[tuple[float, float]]:
  """The (learning rate, warm-up share) pairs each arm of a ``task``
  setting searches: ``--lrs`` x ``--warmup_shares``, or for a pair task
  ``--pair_grid`` ('LRS/SHARES') where given."""
  lrs, shares = args.lrs, args.warmup_shares
  if task != "sst2" and args.pair_grid:
    lrs, _, shares = args.pair_grid.partition("/")
    if not (lrs and shares):
      raise SystemExit(f"pretrain_finetune: --pair_grid={args.pair_grid!r}: "
                       "give LRS/SHARES, e.g. --pair_grid=3e-4,1e-3/0.1.")
  return [(lr, w) for lr in experiment.split(lrs, float)
          for w in experiment.split(shares, float)]


def _grid_note(args) -> str:
  grid = lambda lrs, shares: f"lr {lrs} x warm-up share {shares}"
  pair = args.pair_grid.partition("/")
  return grid(args.lrs, args.warmup_shares) + (
      f" (a pair task: {grid(pair[0], pair[2])})" if args.pair_grid else "")


def settings_of(tasks: list[str], fractions: list[float]
                ) -> list[tuple[str, float]]:
  """(task, fraction of its labels) pairs: SST-2 at each fraction, a pair
  task at all of its train part."""
  return [(t, f) for t in tasks for f in (fractions if t == "sst2" else [1.0])]


def nb_key(task: str, fraction: float) -> str:
  return (f"nb/{fraction:g}" if task == "sst2" else
          f"nb/{task}_by_{nli.GROUP_BY[task]}")


def setting_label(task: str, fraction: float) -> str:
  return (f"SST-2, {fraction:.0%} of the labels" if task == "sst2" else
          f"{TASK_LABELS[task]}, 80% split")


def report(exp, args, models, settings, seeds, chosen, keys) -> None:
  """The table (one row per model and setting) and the figure of the cells
  ``exp`` holds; ``keys``/``chosen``: each (model, setting, arm)'s cell keys
  and chosen learning rate."""
  bases = exp.data.setdefault("baselines", {})
  rows = [_row(exp.runs, bases, args, mixer, setting, seeds, chosen, keys)
          for mixer in models for setting in settings]
  exp.write_table(
      "Pretraining then fine-tuning against scratch (small scale)",
      experiment.markdown_table(
          ["model", "task, labels", "scratch", "pretrained", "gain (points)",
           "pretraining helps", "lr scratch / pretrained", "Naive Bayes",
           "MLM ppl reached", "linear probe: random / pretrained encoder",
           "TFLOPs pretrain / fine-tune"], rows),
      _notes(args, seeds, bases) + "\n\n" + _search_sections(
          exp.runs, args, models, settings, chosen) + _rule_section(exp.data))
  _plot(exp, models, settings, keys)


def _rule_section(data: dict) -> str:
  """The cells run again under the current weight-decay rule beside their
  retired records (``experiment.decay_rule_pairs``): what the rule
  changed, on the same setting and seed."""
  acc = [100 * (b - a) for _, a, b in experiment.decay_rule_pairs(
      data, "accuracy")]
  ppl = [100 * (b / a - 1) for _, a, b in experiment.decay_rule_pairs(
      data, "perplexity")]
  if not acc and not ppl:
    return ""
  out = ("\n\n**Weight-decay rule.** Cells run again under the current rule "
         "beside their retired records of the earlier one (the same setting "
         "and seed):")
  for name, diffs, unit in (("accuracy", acc, "points"),
                            ("MLM held-out perplexity", ppl, "%")):
    if diffs:
      out += (f" {name}, {len(diffs)} cell(s): current - earlier "
              f"{np.mean(diffs):+.3g} {unit} on average (sd "
              f"{np.std(diffs, ddof=1) if len(diffs) > 1 else 0:.3g}, largest "
              f"|difference| {max(abs(d) for d in diffs):.3g});")
  return out[:-1] + "."


def _search_sections(runs, args, models, settings, chosen) -> str:
  """Each setting's searches: every arm's carved-validation accuracy at
  each (lr, warm-up share) of its grid, the choice marked, and the arms
  chosen at the edge of the searched rates."""
  tag = f"p{args.pretrain_steps}_f{args.finetune_steps}"
  out = []
  for task, fraction in settings:
    grid = search_grid(args, task)
    searched, picks, labels = {}, {}, {}
    for mixer, arm in ((m, a) for m in models for a in ARMS):
      name = f"{mixer}/{arm}"
      labels[name] = f"{glue.LABELS[mixer]}, {arm}"
      searched[name] = [dict(runs[k], setting=dict(lr=lr, warmup_share=w))
                        for (lr, w), k in (((lr, w), select_key(
                            tag, mixer, task, fraction, arm, lr, w))
                                            for lr, w in grid) if k in runs]
      lr, w, how = chosen[mixer, (task, fraction), arm]
      picks[name] = (dict(lr=lr, warmup_share=w) if how == "validation"
                     else None)
    out.append(f"**{setting_label(task, fraction)}**, selection runs "
               f"(seed {selection.SEED}) on the carved split. "
               + selection.search_section(
                   searched, picks, labels,
                   list(dict.fromkeys(lr for lr, _ in grid)),
                   shares=list(dict.fromkeys(w for _, w in grid))))
  return "\n\n".join(out)


def _row(runs, bases, args, mixer, setting, seeds, chosen, keys) -> list:
  pre = [runs.get(f"pretrain/s{args.pretrain_steps}/model={mixer}/seed={s}")
         for s in seeds]
  pre = [r for r in pre if r]
  ppl = [r["eval"]["perplexity"] for r in pre]
  uni = np.mean([bases[f"mlm/seed={s}"]["unigram"] for s in seeds
                 if f"mlm/seed={s}" in bases] or [np.nan])
  scratch = _final(runs, keys[mixer, setting, "scratch"])
  tuned = _final(runs, keys[mixer, setting, "pretrained"])
  gain = (100 * (np.mean(tuned) - np.mean(scratch))
          if scratch and tuned else None)
  ft = next((runs[k] for k in keys[mixer, setting, "scratch"]
             if k in runs), None)
  cost = (f"{_tflops(pre[0], args.pretrain_steps)} / "
          f"{_tflops(ft, args.finetune_steps)}" if pre and ft else "")
  # The probes read SST-2 (a pair task's row has none).
  probes = [runs[k] for k in (
      f"probe/s{args.pretrain_steps}/model={mixer}/"
      f"fraction={setting[1]:g}/seed={s}" for s in seeds)
            if k in runs and setting[0] == "sst2"]
  probed = " / ".join(
      experiment.fmt_mean_sd([r[e] for r in probes], 100)
      for e in ("random", "pretrained")) + ": " + experiment.verdict(
          [r["pretrained"] for r in probes], [r["random"] for r in probes],
          "higher", n_eval=probes[0]["dev_rows"]).text(100) if probes else ""
  return [
      glue.LABELS[mixer], setting_label(*setting),
      experiment.fmt_mean_sd(scratch, 100) or "not run",
      experiment.fmt_mean_sd(tuned, 100) or "not run",
      f"{gain:+.1f}" if gain is not None else "",
      experiment.verdict(tuned, scratch, "higher", n_eval=bases.get(
          nb_key(*setting), {}).get("dev_rows")).text(100)
      if gain is not None else "",
      " / ".join(_lr_cell(*chosen[mixer, setting, a])
                 for a in ("scratch", "pretrained")),
      f"{100 * bases[nb_key(*setting)]['naive_bayes']:.1f}"
      if nb_key(*setting) in bases else "",
      (f"{experiment.fmt_mean_sd(ppl)} ({np.mean(ppl) / uni:.2f} x "
       "unigram)") if ppl else "not run", probed, cost]


def _lr_cell(lr: float | None, warmup: float, how: str) -> str:
  """A chosen learning rate (and warm-up share, where not the configs'
  own); 'searching' while its arm's validation search is incomplete,
  'diverged' where every setting of it diverged."""
  if lr is None:
    return how if how in ("searching", "diverged") else "-"
  return f"{lr:g}" + (f", warm-up {warmup:.0%}" if warmup != WARMUP else "")


def _notes(args, seeds, bases) -> str:
  # The reported seeds' masks (not the selection runs' seed).
  base = [bases[f"mlm/seed={s}"] for s in seeds if f"mlm/seed={s}" in bases]
  notes = (
      f"Accuracy at the last fine-tuning step, mean ± sd over seeds {seeds}: "
      "SST-2 on its dev file (872 sentences), a pair task on the 20% test "
      "part of nli_splits' fixed cut of its dev file (trained on the 80% "
      "part). Both arms: the same model, vocabulary, "
      f"batches of 64 and {args.finetune_steps} steps in each setting. "
      f"Learning rate: each arm's best of {_grid_note(args)} on a "
      "validation split "
      f"carved from the setting's train file (every "
      f"{selection.VALIDATION_EVERY}th SST-2 sentence with all its "
      f"phrases, every "
      f"{selection.VALIDATION_EVERY}th premise of a pair task with its "
      f"pairs; digests in the record), run with seed {selection.SEED} (a "
      f"pretrained arm from its own pretraining of seed {selection.SEED}) on "
      "the rest; every seed then trains at that rate on the whole train "
      "file; an arm whose search is not whole ('searching') reports "
      "nothing. Pretrained: the encoder of an MLM run of "
      f"{args.pretrain_steps} steps of batch 64 x 64 tokens on {C4_TRAIN_ALL} "
      "(same seed), classifier new. 'pretraining helps': Welch's test of "
      "pretrained against scratch (see Verdicts below). TFLOPs of "
      "pretraining / "
      "of one fine-tuning run: XLA's count of one train step times the steps. "
      f"Target: +{TARGET_GAIN:g} points at 10% of the labels, read for every "
      "model alike: met where the gain is decided (p < 0.05) and its mean is "
      f"at least +{TARGET_GAIN:g}. Linear probe: dev accuracy of a logistic regression (L2 "
      f"{PROBE_L2:g} on standardised features, not tuned) on the pooled "
      "output of the encoder, frozen: freshly initialised, or pretrained; "
      "trained on the same train rows as the classifier; after the colon, "
      "Welch's test of pretrained against random.")
  if base:
    notes += (f" MLM held out: the first {base[0]['held_out']['rows']} rows "
              "of WikiText-2 validation; unigram "
              f"{np.mean([b['unigram'] for b in base]):.1f}, bigram "
              f"{np.mean([b['bigram'] for b in base]):.1f} on the same "
              "selected positions.")
  return notes + " " + experiment.VERDICT_NOTE


def _plot(exp, models, settings, keys) -> None:
  fig, axes = experiment.figure(ncols=len(settings))
  for ax, setting in zip(axes[0], settings):
    for i, mixer in enumerate(models):
      for arm, style in (("scratch", "--"), ("pretrained", "-")):
        runs = [exp.runs[k] for k in keys[mixer, setting, arm]
                if k in exp.runs]
        if runs:
          steps, acc = experiment.mean_curve(runs, "accuracy", 100)
          ax.plot(steps, acc.mean(0), style, marker="o", ms=3, color=f"C{i}",
                  label=f"{glue.LABELS[mixer]} {arm} (n={len(runs)})")
    experiment.style_axes(ax, "fine-tuning step", "accuracy (%)",
                          title=setting_label(*setting), legend=6)
  exp.save_figure(fig, "pretrain_finetune")
