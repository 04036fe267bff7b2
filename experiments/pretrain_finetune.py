r"""Does masked-LM pretraining pay off? Pretrain, fine-tune, compare to scratch.

The HyperMixer paper trains its GLUE models from scratch only; the gMLP paper
(Liu et al. 2021, §4) pretrains and claims gMLP closes the gap to BERT on
fine-tuning. This experiment follows the user's path through the codebase:
a masked-LM run (``configs/c4_mlm.py``'s setting) leaves an Orbax checkpoint,
and the classifier (``configs/glue.py:sst2,MIXER,finetune``: encoder loaded,
classifier re-initialised, ``init_reinit='(?!encoder/)'``) fine-tunes from it,
against the same model trained from scratch with the same fine-tuning budget.

  --scale=small  the GLUE layout at width 128 (``glue_from_scratch
                 .small_model``: 2 layers, sequence length 64) on the 8k
                 SentencePiece vocabulary of ``mlm_perplexity`` (trained on
                 the C4 train sample; shared by pretraining and fine-tuning,
                 and by both arms); pretraining: MLM on both local C4 train
                 samples (2,000 documents), ``--pretrain_steps`` of batch 64,
                 held-out MLM perplexity on WikiText-2 validation beside the
                 unigram and bigram baselines of the same positions;
                 fine-tuning: SST-2 with ``--fractions`` of the 67,349 train
                 phrases (``experiment.glue.subset_tsv``), ``--finetune_steps``
                 of batch 64, both arms; learning rate: each (model, arm,
                 fraction) takes the best of ``--lrs`` by seed 0's final dev
                 accuracy, then the other seeds run at that rate; seeds
                 ``--seeds`` (pretraining and fine-tuning seeds equal, so the
                 spread covers both); Naive Bayes on the same tokens and
                 subset beside them; the pair task (``--tasks``, SNLI by
                 default): the 80% train part of ``nli_splits``'s fixed cut
                 of its dev file, tested on the 20% part, all of its labels,
                 at the same length 64 (about 1% of SNLI's pairs are longer
                 in the 8k vocabulary), fine-tuned from the same pretrained
                 encoders; a linear probe (``hypermixer_jax.probe``) of
                 each pretrained encoder, frozen, against a freshly
                 initialised one, on the SST-2 rows of each fraction: what
                 pretraining put into the features before fine-tuning.

  python experiments/pretrain_finetune.py --scale=small \
      --out=experiments/results/pretrain_finetune

Each arm chooses its own learning rate, so two processes on the same
``--out`` can split the work with ``--arms=scratch`` and ``--arms=pretrained``
(two processes with the same arms would wait on each other's cells).

Writes ``results.json``, ``table.md`` and ``pretrain_finetune.png`` (dev
accuracy against fine-tuning step, both arms) into ``--out``. Only the small
scale exists: at paper scale the same pair of commands is the README's
fine-tuning recipe (``configs/c4_mlm.py`` then
``configs/glue.py:TASK,MIXER,finetune``).
"""
from __future__ import annotations

import pathlib

import ml_collections
import numpy as np

from hypermixer_jax import experiment
from hypermixer_jax.experiment import glue
from hypermixer_jax.experiment import mlm
from hypermixer_jax.experiment import nli

MODELS = ("hypermixer", "attention", "gmlp")
# SST-2 at --fractions of its labels, then a pair task at all of its own.
TASKS = ("sst2", "snli")
ARMS = ("scratch", "pretrained")
TASK_LABELS = {"sst2": "SST-2", "mnli": "MNLI-m", "snli": "SNLI",
               "qnli": "QNLI"}
SMALL = dict(width=128, seq_len=64, batch_size=64, pretrain_steps=3000,
             pretrain_lr=1e-3, finetune_steps=1000, lrs="3e-4,1e-3",
             fractions="0.1,1.0")
C4_TRAIN_ALL = ("c4/c4_en_tfds_minimal_train_1000.jsonl,"
                "c4/c4_en_train_00000_first1000.jsonl")
# The bar: pretrained beats scratch by this many points at 10% of
# the labels for the best model.
TARGET_GAIN = 2.0
# The linear probe's L2 weight on standardised features (fixed, not tuned on
# dev).
PROBE_L2 = 1e-2


def finetune_config(mixer: str, shared: pathlib.Path, vocab: dict, *,
                    lr: float, seed: int, fraction: float, out: pathlib.Path,
                    steps: int, init: str = "",
                    task: str = "sst2") -> ml_collections.ConfigDict:
  """The classifier run of ``task``: from scratch (``init=''``) or
  fine-tuned from the pretraining workdir ``init`` (encoder loaded,
  classifier new). SST-2 trains on ``fraction`` of its train phrases and is
  scored on its dev file; a pair task on the train part of ``nli_splits``'s
  cut of its dev file (written under ``out``), scored on the test part."""
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
  return c


def pretrain_config(mixer: str, shared: pathlib.Path, vocab: dict, *,
                    seed: int, steps: int) -> ml_collections.ConfigDict:
  """MLM pretraining of the classifier's own encoder (the same model config
  with the MLM head), ``mlm_perplexity``'s training and held-out set at the
  classifier's sequence length."""
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
  fresh = nn.unbox(models.build_model(config.model).init(
      jax.random.key(seed), inputs, **kwargs)["params"])
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


def main() -> None:
  p = experiment.parser("pretrain_finetune", __doc__, report_only=True,
                        models=MODELS, seeds="0,1,2")
  p.add_argument("--tasks", default=",".join(TASKS),
                 help="sst2 and/or a pair task of nli_splits (mnli, snli, "
                 "qnli)")
  p.add_argument("--fractions", default=SMALL["fractions"],
                 help="fractions of SST-2's train phrases (a pair task "
                 "always uses its whole train part)")
  p.add_argument("--lrs", default=SMALL["lrs"],
                 help="fine-tuning learning rates tried on seed 0")
  p.add_argument("--arms", default=",".join(ARMS),
                 help="the arms this process trains (each arm chooses its "
                 "own learning rate, so two processes can take one each); "
                 "the other arm's recorded cells are still reported")
  p.add_argument("--pretrain_steps", type=int, default=SMALL["pretrain_steps"])
  p.add_argument("--finetune_steps", type=int, default=SMALL["finetune_steps"])
  args = experiment.parse(p)
  if args.scale != "small":
    raise SystemExit("pretrain_finetune: only --scale=small exists; at paper "
                     "scale run configs/c4_mlm.py, then configs/glue.py:"
                     "TASK,MIXER,finetune with --config.init_checkpoint.")
  exp = experiment.Experiment(args.out, args)
  shared = pathlib.Path(args.shared)
  vocab = mlm.c4_vocab(exp, shared)
  models, tasks = experiment.split(args.models), experiment.split(args.tasks)
  seeds = experiment.split(args.seeds, int)
  fractions = experiment.split(args.fractions, float)
  lrs = experiment.split(args.lrs, float)
  trained = experiment.split(args.arms)
  if not trained or set(trained) - set(ARMS):
    raise SystemExit(f"pretrain_finetune: --arms={args.arms!r}: give "
                     f"{' and/or '.join(ARMS)}, comma-separated.")
  tag = f"p{args.pretrain_steps}_f{args.finetune_steps}"

  def pretrain(mixer: str, seed: int) -> tuple[str, dict]:
    key = f"pretrain/s{args.pretrain_steps}/model={mixer}/seed={seed}"
    cfg = pretrain_config(mixer, shared, vocab, seed=seed,
                          steps=args.pretrain_steps)
    # The seed fixes the held-out masks.
    exp.baseline(f"mlm/seed={seed}", lambda: mlm.lm_baselines(cfg))
    return exp.workdir(key), exp.cell(key, lambda: experiment.train(
        cfg, exp.workdir(key)))

  def encoder(mixer: str, seed: int) -> tuple[str, dict]:
    """The pretrained encoder's workdir, and (when its checkpoint was not
    kept: runs/ is not committed) the perplexity of pretraining it again
    with the same config and seed, beside the recorded one."""
    workdir, recorded = pretrain(mixer, seed)
    if pathlib.Path(workdir, "checkpoints").is_dir():
      return workdir, {}
    again = experiment.train(pretrain_config(
        mixer, shared, vocab, seed=seed, steps=args.pretrain_steps), workdir)
    return workdir, {
        "pretrain_again_perplexity": again["eval"]["perplexity"],
        "pretrain_recorded_perplexity": recorded["eval"]["perplexity"]}

  def probe(mixer: str, fraction: float, seed: int) -> None:
    key = (f"probe/s{args.pretrain_steps}/model={mixer}/"
           f"fraction={fraction:g}/seed={seed}")

    def run():
      workdir, extra = encoder(mixer, seed)
      cfg = finetune_config(mixer, shared, vocab, lr=1.0, seed=seed,
                            fraction=fraction, out=exp.out, steps=1,
                            init=workdir)
      return dict(probe_encoders(cfg, workdir, seed), **extra)
    exp.cell(key, run)

  def finetune(mixer, task, fraction, arm, lr, seed) -> str:
    """The cell's key, after running it (when ``arm`` is one of
    ``--arms``; else only what is recorded counts)."""
    # SST-2 cells keep keys without the task (the first recorded ones).
    cell = dict(model=mixer, fraction=fraction, arm=arm, lr=lr, seed=seed)
    key = experiment.cell_key(
        tag, cell if task == "sst2" else dict(task=task, **cell))
    init = (exp.workdir(f"pretrain/s{args.pretrain_steps}/model={mixer}/"
                        f"seed={seed}") if arm == "pretrained" else "")
    cfg = finetune_config(mixer, shared, vocab, lr=lr, seed=seed,
                          fraction=fraction, out=exp.out,
                          steps=args.finetune_steps, init=init, task=task)
    exp.baseline(nb_key(task, fraction),
                 lambda: glue.bag_of_words_baselines(cfg))

    def run():
      extra = encoder(mixer, seed)[1] if init else {}
      return dict(experiment.train(cfg, exp.workdir(key)), **extra,
                  init=exp.runs.get(f"pretrain/s{args.pretrain_steps}/model="
                                    f"{mixer}/seed={seed}", {}).get("eval"))
    if arm in trained:
      exp.cell(key, run)
    return key

  chosen, keys, arms = {}, {}, ARMS
  settings = settings_of(tasks, fractions)
  for mixer in models:
    for setting in settings:
      # Seed 0 of both arms first (the learning-rate choice, and the first
      # comparison), then the other seeds at the chosen rates.
      first = {(arm, lr): finetune(mixer, *setting, arm, lr, seeds[0])
               for arm in arms for lr in lrs}
      for arm in arms:
        # (A report may find no recorded rate yet: then nothing is chosen.)
        tried = [x for x in lrs if first[arm, x] in exp.runs]
        lr = max(tried, key=lambda x, a=arm: exp.runs[first[a, x]]["eval"][
            "accuracy"], default=None)
        chosen[mixer, setting, arm] = lr
        keys[mixer, setting, arm] = [first[arm, lr]] + [
            finetune(mixer, *setting, arm, lr, s)
            for s in seeds[1:]] if lr is not None else []
    # Linear probes of the pretrained encoders (the SST-2 settings).
    for seed in (seeds if "pretrained" in trained else []):
      for fraction in (f for t, f in settings if t == "sst2"):
        probe(mixer, fraction, seed)
  _report(exp, args, models, settings, seeds, chosen, keys)


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


def _report(exp, args, models, settings, seeds, chosen, keys) -> None:
  runs, bases = exp.runs, exp.data.setdefault("baselines", {})
  rows = []
  for mixer in models:
    pre = [runs.get(f"pretrain/s{args.pretrain_steps}/model={mixer}/seed={s}")
           for s in seeds]
    pre = [r for r in pre if r]
    ppl = [r["eval"]["perplexity"] for r in pre]
    uni = np.mean([bases[f"mlm/seed={s}"]["unigram"] for s in seeds
                   if f"mlm/seed={s}" in bases] or [np.nan])
    for setting in settings:
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
          for e in ("random", "pretrained")) if probes else ""
      rows.append([
          glue.LABELS[mixer], setting_label(*setting),
          experiment.fmt_mean_sd(scratch, 100) or "not run",
          experiment.fmt_mean_sd(tuned, 100) or "not run",
          f"{gain:+.1f}" if gain is not None else "",
          experiment.verdict(tuned, scratch, "higher", n_eval=bases.get(
              nb_key(*setting), {}).get("dev_rows")).text(100)
          if gain is not None else "",
          " / ".join(f"{chosen[mixer, setting, a]:g}"
                     if chosen[mixer, setting, a] else "-"
                     for a in ("scratch", "pretrained")),
          f"{100 * bases[nb_key(*setting)]['naive_bayes']:.1f}"
          if nb_key(*setting) in bases else "",
          (f"{experiment.fmt_mean_sd(ppl)} ({np.mean(ppl) / uni:.2f} x "
           "unigram)") if ppl else "not run", probed, cost])
  base = [bases[k] for k in bases if k.startswith("mlm/")]
  notes = (
      f"Accuracy at the last fine-tuning step, mean ± sd over seeds {seeds}: "
      "SST-2 on its dev file (872 sentences), a pair task on the 20% test "
      "part of nli_splits' fixed cut of its dev file (trained on the 80% "
      "part). Both arms: the same model, vocabulary, "
      f"batches of 64 and {args.finetune_steps} steps in each setting, lr "
      f"the best of {args.lrs} on seed 0 (selected on dev: optimistic for "
      "both arms alike). Pretrained: the encoder of an MLM run of "
      f"{args.pretrain_steps} steps of batch 64 x 64 tokens on {C4_TRAIN_ALL} "
      "(same seed), classifier new. 'pretraining helps': Welch's test of "
      "pretrained against scratch (see Verdicts below). TFLOPs of "
      "pretraining / "
      "of one fine-tuning run: XLA's count of one train step times the steps. "
      f"Target: +{TARGET_GAIN:g} points at 10% of the labels for the best "
      "model. Linear probe: dev accuracy of a logistic regression (L2 "
      f"{PROBE_L2:g} on standardised features, not tuned) on the pooled "
      "output of the encoder, frozen: freshly initialised, or pretrained; "
      "trained on the same train rows as the classifier.")
  if base:
    notes += (f" MLM held out: the first {base[0]['held_out']['rows']} rows "
              "of WikiText-2 validation; unigram "
              f"{np.mean([b['unigram'] for b in base]):.1f}, bigram "
              f"{np.mean([b['bigram'] for b in base]):.1f} on the same "
              "selected positions.")
  notes += " " + experiment.VERDICT_NOTE
  exp.write_table(
      "Pretraining then fine-tuning against scratch (small scale)",
      experiment.markdown_table(
          ["model", "task, labels", "scratch", "pretrained", "gain (points)",
           "pretraining helps", "lr scratch / pretrained", "Naive Bayes",
           "MLM ppl reached", "linear probe: random / pretrained encoder",
           "TFLOPs pretrain / fine-tune"], rows), notes)
  _plot(exp, models, settings, keys)


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


if __name__ == "__main__":
  main()
