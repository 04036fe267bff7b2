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
                 width 64 and about 0.25M parameters each (``SMALL`` of
                 ``hypermixer_jax.experiment.images``, the study's module) so
                 that each trains in ~5 minutes on one CPU core:
                 ``SMALL_STEPS`` steps of batch 128 on the 50,000 training
                 images; curves on a fixed 2,000-image test subset, final
                 accuracy on all 10,000 test images. Same recipe for all
                 three; seeds ``--seeds`` (initialisation and data order).
                 Beside them, fitted on the same train images and scored on
                 the same test images: a linear classifier on the raw pixels
                 (``baselines.ridge_classifier``), the majority class and
                 chance.

  python experiments/image_classification.py --scale=small \
      --out=experiments/results/image_classification --cifar_dir=CIFAR_DIR

``--tune`` (small scale): every family tuned alike, its learning rate and
warm-up chosen among ``selection.settings`` on every 10th training image
(carved beside the TSVs, digests under ``cifar_split`` in ``results.json``,
seed 100), then the seeds at each family's choice, trained on the other
training images: ``table_tuned.md``; ``--budget_check=150,600`` also trains
each family's choice for those lengths on the carved images and records the
length the rule (the best family above the pixels' linear classifier on the
carved validation images) picks.

Writes ``results.json``, ``table.md`` (mean ± sd over seeds; the paper's
claims, gMLP above MLP-Mixer and level with the Transformer, judged by
Welch's and equivalence tests) and ``image_curves.png`` (test accuracy
against step) into ``--out``.
"""
from __future__ import annotations

import os
import pathlib

from hypermixer_jax import experiment
from hypermixer_jax.experiment import images


def _tune(exp, args, families, seeds, tsvs, steps: int, prefix: str) -> None:
  """``--tune``: the search and the seeds at each family's choice
  (``images.tune``), ``--budget_check``'s lengths (``images.budget_check``),
  then ``table_tuned.md``."""
  lrs = experiment.split(args.lrs, float) or None
  archive = pathlib.Path(args.shared) / images.ARCHIVE

  def config(family, seed, n=None):
    return images.image_config(family, "small", tsvs=tsvs,
                               steps=n or args.steps or None,
                               batch_size=args.batch_size, seed=seed)
  tuned = images.tune(exp, families, seeds, tsvs, config, steps, prefix,
                      archive, args.order == "reverse", lrs)
  lengths = experiment.split(args.budget_check, int)
  check = images.budget_check(exp, prefix, tuned, families, lengths, steps,
                              config, tsvs, archive) if lengths else None
  images.report_tuned(exp, families, args.seeds, steps, args.batch_size,
                      tuned, lrs, check=check)


def main() -> None:
  p = experiment.parser("image_classification", __doc__, report_only=True,
                        data_dir="", families=tuple(images.LABELS), steps=0,
                        seeds="0,1,2")
  p.add_argument("--cifar_dir", default="",
                 help="where CIFAR-10 is (or gets) extracted, with its "
                 "train.tsv/test.tsv (default OUT/cifar10_data)")
  p.add_argument("--batch_size", type=int, default=images.SMALL_BATCH,
                 help="small scale: training batch")
  experiment.tune_flags(p, "images", budget_check=True)
  args = experiment.parse(p)
  experiment.check_tune(args, "CIFAR-10's training images")
  experiment.check_budget(args)
  exp = experiment.Experiment(args.out, args)
  families = experiment.split(args.families)
  seeds = experiment.split(args.seeds, int)
  shared = pathlib.Path(args.shared)
  small = args.scale == "small"
  tsvs = None
  if small and (args.tune or not args.report_only):
    tsvs = images.cifar_tsvs(
        shared, args.cifar_dir or os.path.join(args.out, "cifar10_data"),
        extract=not args.report_only)
  steps = args.steps or (images.SMALL_STEPS if small else None)
  prefix = images.run_prefix(args.scale, steps, args.batch_size)
  base = None
  if small:
    base = (exp.data.get("baselines", {}).get("small") if args.report_only
            else exp.baseline("small", lambda: images.pixel_baselines(
                tsvs, shared / images.ARCHIVE)))

  if args.tune:
    _tune(exp, args, families, seeds, tsvs, steps, prefix)
    return

  runs = {}
  for family in families:
    for seed in seeds:
      key = f"{prefix}{family}/seed={seed}"
      result = exp.cell(key, lambda f=family, k=key, s=seed: images.run(
          exp, images.image_config(
              f, args.scale, tsvs=tsvs, data_dir=args.data_dir,
              steps=args.steps or None, batch_size=args.batch_size, seed=s),
          k))
      if result is not None:
        runs.setdefault(family, []).append(result)

  images.report(exp, args.scale, families, seeds, steps, args.batch_size,
                runs, base)


if __name__ == "__main__":
  main()
