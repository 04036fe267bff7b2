r"""Turns an image-folder archive into the image task's labels TSVs.

The image task (``imagenet_patches``) reads local images through a
``filename<TAB>class_index`` TSV per split, file names relative to the TSV.
This extracts an archive laid out as ``<split>/<class>/<file>`` (the layout
of CIFAR-10 in ``shared/data/cifar10/cifar10_jpeg_train_test.tar.gz``, and of
most image-folder datasets; JPEG files only, what the pipeline decodes) and writes ``OUT/<split>.tsv`` for each split,
with class indices in the order given (CIFAR-10's standard order by default):

    python -m hypermixer_jax.data.prepare_images \
        --archive=../shared/data/cifar10/cifar10_jpeg_train_test.tar.gz \
        --out=/data/cifar10

    python -m hypermixer_jax.main --config=configs/cifar10.py:gmlp_ti \
        --workdir=/ckpt/cifar_gmlp \
        --config.data.local_files.train=/data/cifar10/train.tsv \
        --config.data.local_files.validation=/data/cifar10/test.tsv

Rows are in a fixed random order (``--seed``): the pipeline shuffles
through a buffer of ``data.shuffle_buffer_size`` examples, and a file sorted
by class would fill that buffer with one or two classes at a time (training
on CIFAR-10's class-sorted listing reaches 65% batch accuracy and 28% test
accuracy). An
archive member outside ``<split>/<class>/<file>``, a class folder not in the
class list, or a class without images in a split stops with an error naming
it. Extraction refuses links and absolute or ``..`` paths (``tarfile``'s
``data`` filter). Running it again over the same ``--out`` overwrites.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tarfile
from typing import Sequence

import tqdm

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog",
                   "frog", "horse", "ship", "truck")
# The pipeline decodes JPEG only (``images.check_jpeg``): other formats stop
# here, before any TSV is written, rather than at their first training row.
IMAGE_EXTENSIONS = (".jpg", ".jpeg")


def _image_members(tar: tarfile.TarFile, archive: str, splits: Sequence[str],
                   classes: Sequence[str]) -> dict[str, dict[str, list[str]]]:
  """split -> class -> sorted member names; refuses any unexpected member."""
  found = {s: {c: [] for c in classes} for s in splits}
  for member in tar.getmembers():
    name = member.name.lstrip("./")
    if member.isdir() or not name:
      continue
    parts = name.split("/")
    if (len(parts) != 3 or not member.isfile()
        or not parts[2].lower().endswith(IMAGE_EXTENSIONS)):
      raise ValueError(
          f"{archive}: member {member.name!r} is not <split>/<class>/<image> "
          f"(image = {', '.join(IMAGE_EXTENSIONS)}: the pipeline decodes "
          "JPEG only); the archive must hold only image-folder JPEG files "
          "(convert others first).")
    split, cls, _ = parts
    if split not in found:
      raise ValueError(f"{archive}: member {member.name!r} is in split "
                       f"folder {split!r}, expected one of {list(splits)}.")
    if cls not in found[split]:
      raise ValueError(f"{archive}: member {member.name!r} has class folder "
                       f"{cls!r}, not one of the {len(classes)} classes "
                       f"({', '.join(classes)}); pass --classes.")
    found[split][cls].append(name)
  for split, by_class in found.items():
    empty = [c for c, names in by_class.items() if not names]
    if empty:
      raise ValueError(f"{archive}: split {split!r} has no images of class "
                       f"{', '.join(map(repr, empty))}.")
  return {s: {c: sorted(n) for c, n in by_class.items()}
          for s, by_class in found.items()}


def prepare(archive: str, out: str, classes: Sequence[str] = CIFAR10_CLASSES,
            splits: Sequence[str] = ("train", "test"), seed: int = 0, *,
            extract: bool = True) -> dict[str, str]:
  """Extracts ``archive`` into ``out`` and writes ``out/<split>.tsv``.

  Returns ``{split: path of its TSV}``; each TSV has the header
  ``filename<TAB>class_index`` and one row per image (path relative to the
  TSV), class index = position of its folder in ``classes``, rows in the
  random order of ``seed`` (the same archive and seed give the same files).
  ``extract=False`` writes the same TSVs from the archive's listing alone
  (what a report reads: the rows and their digests, no image).
  """
  if len(set(classes)) != len(classes):
    raise ValueError(f"classes {list(classes)} has duplicates.")
  os.makedirs(out, exist_ok=True)
  with tarfile.open(archive) as tar:
    members = _image_members(tar, archive, splits, classes)
    if extract:
      # Tens of thousands of files: a bar on a terminal, a line a minute in
      # a log file.
      terminal = sys.stderr.isatty()
      tar.extractall(out, members=tqdm.tqdm(
          tar.getmembers(), desc=f"extracting {os.path.basename(archive)}",
          unit=" files", mininterval=0.1 if terminal else 60.0,
          ascii=not terminal), filter="data")
  paths = {}
  for split, by_class in members.items():
    path = os.path.join(out, f"{split}.tsv")
    rows = [f"{name}\t{index}\n" for index, cls in enumerate(classes)
            for name in by_class[cls]]
    random.Random(f"{seed}/{split}").shuffle(rows)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.write("filename\tclass_index\n")
      f.writelines(rows)
    os.replace(path + ".tmp", path)
    paths[split] = path
  return paths


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--archive", required=True,
                 help="tar(.gz) of <split>/<class>/<image> files")
  p.add_argument("--out", required=True, help="folder to extract into")
  p.add_argument("--classes", default=",".join(CIFAR10_CLASSES),
                 help="class folder names in class-index order "
                 "(default: CIFAR-10's)")
  p.add_argument("--splits", default="train,test")
  p.add_argument("--seed", type=int, default=0, help="seed of the row order")
  args = p.parse_args(argv)
  paths = prepare(args.archive, args.out, args.classes.split(","),
                  args.splits.split(","), args.seed)
  for split, path in paths.items():
    with open(path, encoding="utf-8") as f:
      rows = sum(1 for _ in f) - 1
    print(f"{split}: {rows} images -> {path}")


if __name__ == "__main__":
  main()
