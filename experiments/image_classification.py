r"""Image classification: gMLP-Ti against a Mixer and a ViT-style Transformer.

The gMLP paper's image claim (Liu et al. 2021, Table 2; ``PAPERS.md`` §2):
with a DeiT-style recipe, gMLP matches a ViT/DeiT Transformer of similar size
and beats MLP-Mixer at fewer parameters. Three models of similar size, one
recipe, the image task's seqio pipeline (JPEG decode, crop/flip, patches):

  --scale=paper  ImageNet-1k from TFDS ``imagenet2012`` (``--data_dir``):
                 ``configs/imagenet.py`` with ``gmlp_ti`` (5.87M), ``vit_ti16``
                 (the DeiT-Ti layout, 5.72M) and ``mixer_s16`` (18.5M, the
                 smallest Mixer of its paper), the paper's recipe (300 epochs,
                 batch 4096); meant for a pod.
  --scale=small  CIFAR-10 from the JPEGs in ``--shared``
                 (``cifar10/cifar10_jpeg_train_test.tar.gz``, extracted once
                 into ``--cifar_dir`` by ``hypermixer_jax.data.prepare_images``)
                 through the same task, ``configs/cifar10.py`` (the ImageNet
                 configs one flag away) with the three layouts shrunk to
                 width 64 and about 0.25M parameters each (see ``SMALL``) so
                 that each trains in ~5 minutes on one CPU core:
                 ``SMALL_STEPS`` steps of batch 128 on the 50,000 training
                 images; curves on a fixed 2,000-image test subset, final
                 accuracy on all 10,000 test images. Same recipe for all
                 three.

  python experiments/image_classification.py --scale=small --out=experiments/results/image_classification \
      --cifar_dir=CIFAR_DIR

Writes ``results.json``, ``table.md`` and ``image_curves.png`` (test accuracy
against step) into ``--out``.
"""
from __future__ import annotations

import os
import pathlib

import ml_collections

from hypermixer_jax import experiment

# ImageNet-1k top-1 of the gMLP paper's table as digested in PAPERS.md §2
# (its Ti-size rows are not in the digest): the nearest rows to our models.
PAPER = {
    "gmlp": "gMLP-S 79.6 (20M); gMLP-B 81.6 (73M)",
    "vit": "DeiT-B 81.8 (86M)",
    "mixer": "Mixer-B/16 76.4 (59M)",
}
LABELS = {"gmlp": "gMLP", "vit": "ViT-style Transformer", "mixer": "MLP-Mixer"}
# Zoo model of each family: the paper-scale runs (ImageNet) and the layout the
# small runs shrink (CIFAR-10).
PAPER_MODELS = {"gmlp": "gmlp_ti", "vit": "vit_ti16", "mixer": "mixer_s16"}
CIFAR_MODELS = {"gmlp": "gmlp_ti", "vit": "vit_cifar", "mixer": "mixer_cifar"}
# Small scale: width 64, depth per family for about 0.25M parameters and
# 16-19M multiply-adds per image each; the layers keep their families'
# proportions (gMLP d_ffn = 6 d as gMLP-Ti; ViT d_ffn = 4 d, heads of 32;
# Mixer D_S = S = 64 as mixer_cifar, D_C = 4 C).
SMALL = {
    "gmlp": dict(num_layers=6, d_model=64, d_ffn=384),
    "vit": dict(num_layers=5, d_model=64, d_ffn=256,
                mixer_kwargs=dict(num_heads=2)),
    "mixer": dict(num_layers=6, d_model=64, d_ffn=256,
                  mixer_kwargs=dict(token_mlp_dim=64)),
}
# 300 steps of 128 = 0.77 epoch: what one CPU core affords in ~5 min a model.
SMALL_STEPS, SMALL_BATCH, SMALL_EVALS = 300, 128, 5
# The curves' test subset: the first 200 test images of each class (file
# names sorted), the images of the shared cifar10_test_2000.npz.
SUBSET_PER_CLASS = 200


def cifar_tsvs(shared: pathlib.Path, cifar_dir: str) -> dict[str, str]:
  """``{'train', 'test', 'test_subset'}`` TSVs of CIFAR-10 in ``cifar_dir``,
  extracted from the shared archive on first use."""
  paths = {s: os.path.join(cifar_dir, f"{s}.tsv") for s in ("train", "test")}
  if not all(os.path.exists(p) for p in paths.values()):
    from hypermixer_jax.data import prepare_images  # pylint: disable=g-import-not-at-top
    archive = experiment.require(
        shared / "cifar10/cifar10_jpeg_train_test.tar.gz", "CIFAR-10 archive")
    paths = prepare_images.prepare(archive, cifar_dir)
  subset = os.path.join(cifar_dir, f"test_{SUBSET_PER_CLASS}_per_class.tsv")
  with open(paths["test"], encoding="utf-8") as f:
    header, *rows = f.read().splitlines()
  by_class: dict[str, list[str]] = {}
  for row in rows:
    by_class.setdefault(row.rsplit("\t", 1)[1], []).append(row)
  chosen = {r for names in by_class.values()
            for r in sorted(names)[:SUBSET_PER_CLASS]}
  keep = [r for r in rows if r in chosen]  # the TSV's (random) order
  with open(subset, "w", encoding="utf-8") as f:
    f.write("\n".join([header, *keep]) + "\n")
  return {**paths, "test_subset": subset}


def image_config(family: str, scale: str, *, tsvs: dict[str, str] | None
                 = None, data_dir: str = "", steps: int | None = None,
                 batch_size: int = SMALL_BATCH, seed: int = 0
                 ) -> ml_collections.ConfigDict:
  """The training config of one run."""
  if scale == "paper":
    c = experiment.load_config("imagenet.py", PAPER_MODELS[family])
    c.data.data_dir = data_dir or None
    if steps:
      c.num_train_steps = steps
    c.seed = seed
    return c
  c = experiment.load_config("cifar10.py", CIFAR_MODELS[family])
  sizes = dict(SMALL[family])
  c.model.mixer_kwargs.update(sizes.pop("mixer_kwargs", {}))
  c.model.update(sizes)
  c.model.dtype = "float32"  # CPU: bf16 matmuls are emulated
  c.data.local_files.train = tsvs["train"]
  # Curves on the fixed 2,000-image test subset; at the end all 10,000.
  c.data.local_files.validation = tsvs["test_subset"]
  c.data.local_files.test = tsvs["test"]
  c.data.shuffle_buffer_size = 10_000
  c.sharding.rules = "data_parallel"
  c.batch_size = batch_size
  c.num_train_steps = steps or SMALL_STEPS
  c.warmup_steps = max(1, c.num_train_steps // 10)
  c.eval_every = max(1, c.num_train_steps // SMALL_EVALS)
  c.eval_steps = -1
  c.evals.test = ml_collections.ConfigDict(dict(
      type="task", every=0, split="test", steps=-1))
  c.log_every = 50
  c.checkpoint_every = 0
  c.seed = seed
  return c


def _params(config) -> int:
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  return models.count_params(config.model)


def _run(exp, config, key: str) -> dict:
  """One training run: final metrics, curves, the whole-test-set accuracy
  (the ``test`` evaluator, small scale), parameters and layout."""
  from hypermixer_jax.train import metrics  # pylint: disable=g-import-not-at-top
  workdir = exp.workdir(key)
  out = dict(experiment.train(config, workdir), params=_params(config),
             model=config.model.to_dict())
  test = metrics.read_metrics(workdir, "test")
  if test:
    out["test"] = test[max(test, key=int)]
  return out


def final_accuracy(r: dict) -> float:
  """Accuracy on the whole test split (small) or the eval split (paper)."""
  return (r.get("test") or r["eval"])["accuracy"]


def main() -> None:
  p = experiment.parser("image_classification", __doc__, report_only=True,
                        data_dir="", families=tuple(LABELS), steps=0)
  p.add_argument("--cifar_dir", default="",
                 help="where CIFAR-10 is (or gets) extracted, with its "
                 "train.tsv/test.tsv (default OUT/cifar10_data)")
  p.add_argument("--batch_size", type=int, default=SMALL_BATCH,
                 help="small scale: training batch")
  args = experiment.parse(p)
  exp = experiment.Experiment(args.out, args)
  families = experiment.split(args.families)
  tsvs = None
  if args.scale == "small" and not args.report_only:
    tsvs = cifar_tsvs(pathlib.Path(args.shared),
                      args.cifar_dir or os.path.join(args.out, "cifar10_data"))
  steps = args.steps or (SMALL_STEPS if args.scale == "small" else None)
  prefix = f"{args.scale}/s{steps or 'paper'}/"
  if args.scale == "small" and args.batch_size != SMALL_BATCH:
    prefix = f"{args.scale}/s{steps}b{args.batch_size}/"

  runs = {}
  for family in families:
    result = exp.cell(prefix + family, lambda f=family: _run(exp, image_config(
        f, args.scale, tsvs=tsvs, data_dir=args.data_dir,
        steps=args.steps or None, batch_size=args.batch_size), prefix + f))
    if result is not None:
      runs[family] = result

  dataset = "CIFAR-10 test" if args.scale == "small" else "ImageNet-1k val"
  rows = []
  for family in families:
    r = runs.get(family)
    if r is None:
      rows.append([LABELS[family], "not run", "", "", "", "",
                   PAPER[family]])
      continue
    m = r["model"]
    rows.append([
        LABELS[family],
        f"{m['num_layers']}L d={m['d_model']} d_ffn={m['d_ffn']}",
        f"{r['params'] / 1e6:.2f}M",
        f"{100 * final_accuracy(r):.1f}",
        f"{experiment.flops_per_step(r) / 1e9:.2f}",
        f"{r['wall_s'] / 60:.1f}",
        PAPER[family]])
  headers = ["model", "layout", "params", f"{dataset} accuracy (ours, %)",
             "GFLOP / train step", "wall (min)",
             "paper: ImageNet-1k top-1 (%)"]
  notes = ("Paper: ImageNet-1k top-1 of the gMLP paper (PAPERS.md §2), "
           "at 224x224 and 300 epochs.")
  if args.scale == "small":
    notes += (
        f" Ours: CIFAR-10 (the shared JPEG copy, quality 75), "
        f"{steps} steps of batch {args.batch_size} ("
        f"{steps * args.batch_size / 50000:.2f} epochs of the 50,000 training "
        "images), AdamW lr 1e-3, weight decay 0.05, 10% warm-up then cosine, "
        "random-resized crop (area >= 0.35) and flip, accuracy on all 10,000 "
        "test images at the last step (the figure's curves: the fixed "
        f"subset of the first {SUBSET_PER_CLASS} test images per class); "
        "float32 on one CPU core; GFLOP / train step: XLA's count of the "
        "compiled step (wall time moves with the host's load). "
        "Small-scale CIFAR-10 is not ImageNet: the columns are not "
        "comparable, only the ordering of the models is the claim to check.")
  exp.write_table(f"Image classification ({args.scale} scale)",
                  experiment.markdown_table(headers, rows), notes)
  _plot(exp, runs)


def _plot(exp, runs) -> None:
  fig, axes = experiment.figure()
  ax = axes[0, 0]
  experiment.plot_curves(
      ax, {f: [r] for f, r in runs.items()}, "accuracy",
      lambda f: f"{LABELS[f]} ({runs[f]['params'] / 1e6:.2f}M)", scale=100)
  experiment.baseline_lines(ax, {"chance": 10})
  experiment.style_axes(
      ax, "step", f"test accuracy (%), {10 * SUBSET_PER_CLASS} images")
  exp.save_figure(fig, "image_curves")


if __name__ == "__main__":
  main()
