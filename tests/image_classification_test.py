"""CIFAR-10 through the image task: TSV preparation, patches, configs, the
experiment at toy size.

The patches are compared with a NumPy patchify of the decoded JPEG (and, on
the real data, of the shared ``cifar10_test_2000.npz``, decoded by Pillow);
the CIFAR config must differ from the ImageNet one only in data and length.
"""
import io
import json
import os
import pathlib
import sys
import tarfile

import numpy as np
import pytest
import tensorflow as tf

from hypermixer_jax import baselines
from hypermixer_jax import data
from hypermixer_jax import experiment
from hypermixer_jax import models
from hypermixer_jax.data import images
from hypermixer_jax.data import prepare_images
from hypermixer_jax.experiment import images as ic

import script_modules

script = script_modules.load("experiments/image_classification.py")

MEAN = np.array(images.MEAN_RGB, np.float32)
STD = np.array(images.STDDEV_RGB, np.float32)


def _jpeg(seed: int, size: int = 32) -> bytes:
  # Smooth, so that JPEG keeps it close to the original.
  rng = np.random.default_rng(seed)
  y, x = np.mgrid[:size, :size]
  image = np.stack([(x * rng.uniform(2, 7) + y * rng.uniform(0, 3)
                     + rng.uniform(0, 60)) % 256 for _ in range(3)], -1)
  return tf.io.encode_jpeg(image.astype(np.uint8), quality=95).numpy()


def _tar(path, files: dict[str, bytes]) -> str:
  with tarfile.open(path, "w:gz") as tar:
    for name, blob in files.items():
      info = tarfile.TarInfo(name)
      info.size = len(blob)
      tar.addfile(info, io.BytesIO(blob))
  return str(path)


def _patchify(image: np.ndarray, p: int) -> np.ndarray:
  """Independent reference: loops over patches, row-major, (row, col, ch)."""
  h, w, _ = image.shape
  return np.stack([image[i:i + p, j:j + p].reshape(-1)
                   for i in range(0, h, p) for j in range(0, w, p)])


def _expected(blob: bytes, p: int = 4) -> np.ndarray:
  decoded = tf.io.decode_jpeg(blob, channels=3).numpy().astype(np.float32)
  return _patchify((decoded / 255.0 - MEAN) / STD, p)


CLASSES = ("airplane", "automobile", "bird")


def _synthetic_archive(tmp_path, per_class=(3, 2)) -> tuple[str, dict]:
  files = {}
  for split, n in zip(("train", "test"), per_class):
    for c, cls in enumerate(CLASSES):
      for i in range(n):
        files[f"{split}/{cls}/{i:04d}.jpg"] = _jpeg(100 * c + 10 * i
                                                    + (split == "test"))
  return _tar(tmp_path / "cifar.tar.gz", files), files


def test_prepare_writes_tsvs_and_extracts(tmp_path):
  archive, files = _synthetic_archive(tmp_path)
  out = tmp_path / "out"
  paths = prepare_images.prepare(archive, str(out), CLASSES)
  assert paths == {"train": str(out / "train.tsv"),
                   "test": str(out / "test.tsv")}
  header, *rows = (out / "test.tsv").read_text().splitlines()
  assert header == "filename\tclass_index"
  assert sorted(rows) == [
      "test/airplane/0000.jpg\t0", "test/airplane/0001.jpg\t0",
      "test/automobile/0000.jpg\t1", "test/automobile/0001.jpg\t1",
      "test/bird/0000.jpg\t2", "test/bird/0001.jpg\t2"]
  header, *rows = (out / "train.tsv").read_text().splitlines()
  assert len(rows) == 9 and rows != sorted(rows)  # a fixed random order
  prepare_images.prepare(archive, str(tmp_path / "again"), CLASSES)
  assert (tmp_path / "again/train.tsv").read_text() == (
      out / "train.tsv").read_text()
  for name, blob in files.items():
    assert (out / name).read_bytes() == blob


def test_a_report_writes_the_tsvs_without_the_images(tmp_path, monkeypatch):
  # extract=False (a --report_only report): the same TSVs, no image; a
  # training run over that folder then extracts the images.
  files = {f"{split}/{cls}/{i:04d}.jpg": _jpeg(10 * c + i)
           for split in ("train", "test")
           for c, cls in enumerate(prepare_images.CIFAR10_CLASSES)
           for i in range(2)}
  archive = _tar(tmp_path / "cifar.tar.gz", files)
  prepare_images.prepare(archive, str(tmp_path / "full"))
  listed = tmp_path / "listed"
  prepare_images.prepare(archive, str(listed), extract=False)
  for split in ("train", "test"):
    assert (listed / f"{split}.tsv").read_text() == (
        tmp_path / "full" / f"{split}.tsv").read_text()
  assert sorted(p.name for p in listed.iterdir()) == ["test.tsv",
                                                       "train.tsv"]
  shared = tmp_path / "shared"
  (shared / "cifar10").mkdir(parents=True)
  os.replace(archive, shared / ic.ARCHIVE)
  monkeypatch.setattr(ic, "SUBSET_PER_CLASS", 1)
  ic.cifar_tsvs(shared, str(listed), extract=False)
  assert not (listed / "train").exists()
  ic.cifar_tsvs(shared, str(listed))
  for name, blob in files.items():
    assert (listed / name).read_bytes() == blob


def test_prepare_reports_its_progress(tmp_path, capsys):
  """The extraction of a large archive says how far it is (a line at the
  end here; a line a minute in a log file, a bar on a terminal)."""
  archive, _ = _synthetic_archive(tmp_path)
  prepare_images.prepare(archive, str(tmp_path / "out"), CLASSES)
  last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
  with tarfile.open(archive) as tar:
    n = len(tar.getmembers())
  assert last.startswith("extracting cifar.tar.gz: 100%|")
  assert f"| {n}/{n} [" in last


@pytest.mark.parametrize("extra,message", [
    ({"test/horse/0000.jpg": b"x"}, "has class folder 'horse', not one of"),
    ({"val/bird/0000.jpg": b"x"}, "is in split folder 'val'"),
    ({"train/readme.txt": b"x"}, "is not <split>/<class>/<image>"),
    ({"../evil.jpg": b"x"}, "is not <split>/<class>/<image>"),
    ({"train/bird/0009.png": b"x"}, "decodes JPEG only"),
])
def test_prepare_refuses_unexpected_members(tmp_path, extra, message):
  _, files = _synthetic_archive(tmp_path)
  archive = _tar(tmp_path / "bad.tar.gz", {**files, **extra})
  with pytest.raises(ValueError, match=message):
    prepare_images.prepare(archive, str(tmp_path / "out"), CLASSES)


def test_prepare_refuses_a_missing_class(tmp_path):
  _, files = _synthetic_archive(tmp_path)
  files = {k: v for k, v in files.items() if not k.startswith("test/bird/")}
  archive = _tar(tmp_path / "bad.tar.gz", files)
  with pytest.raises(ValueError, match="split 'test' has no images of class "
                     "'bird'"):
    prepare_images.prepare(archive, str(tmp_path / "out"), CLASSES)


def test_pixel_arrays_follow_the_tsv(tmp_path):
  archive, files = _synthetic_archive(tmp_path)
  paths = prepare_images.prepare(archive, str(tmp_path / "out"), CLASSES)
  x, y = ic.pixel_arrays(paths["train"])
  _, *rows = pathlib.Path(paths["train"]).read_text().splitlines()
  assert x.shape == (9, 32, 32, 3) and x.dtype == np.uint8
  for image, label, row in zip(x, y, rows):
    name, cls = row.split("\t")
    np.testing.assert_array_equal(
        image, tf.io.decode_jpeg(files[name], channels=3).numpy())
    assert label == int(cls) == CLASSES.index(name.split("/")[1])


def test_pixel_arrays_refuse_mixed_sizes(tmp_path):
  _, files = _synthetic_archive(tmp_path)
  files["train/bird/0009.jpg"] = _jpeg(5, size=16)
  archive = _tar(tmp_path / "mixed.tar.gz", files)
  paths = prepare_images.prepare(archive, str(tmp_path / "out"), CLASSES)
  with pytest.raises(ValueError, match="images of 2 sizes"):
    ic.pixel_arrays(paths["train"])


@pytest.mark.parametrize("gmlp,other,family,want", [
    ([0.47, 0.48, 0.46], [0.39, 0.40, 0.41], "mixer", "agrees: +7.0"),
    ([0.39, 0.40, 0.41], [0.47, 0.48, 0.46], "mixer", "disagrees: -7.0"),
    # 'level': the equivalence test leads, then the difference.
    ([0.47, 0.48, 0.46], [0.39, 0.40, 0.41], "vit",
     "disagrees: TOST within ±1.0: p = 0.999; difference +7.0"),
    # Level only where the equivalence test puts the gap inside 1 point.
    ([0.410, 0.412, 0.411], [0.411, 0.410, 0.412], "vit",
     "agrees: TOST within ±1.0: p < 0.001; difference +0.0"),
    ([0.40, 0.42, 0.41], [0.41, 0.40, 0.42], "vit",
     "not decided: TOST within ±1.0: p = 0.144; difference +0.0"),
    ([0.40, 0.42], [0.41, 0.40, 0.42], "vit", "not decided (2 < 3 seeds)"),
    ([0.47, 0.48, 0.46], [0.47, 0.48, 0.46], "gmlp", ""),
])
def test_claim_verdicts(gmlp, other, family, want):
  assert ic.claim_verdict(family, gmlp, other).startswith(want)


def _cifar_cfg(tsv: str, **kw):
  cfg = data.default_data_config()
  cfg.update(task="imagenet_patches", image_size=32, patch_size=4,
             num_classes=10, crop_fraction=1.0, **kw)
  cfg.local_files.train = cfg.local_files.validation = tsv
  return cfg


def test_pipeline_patches_equal_numpy_patchify(tmp_path):
  archive, files = _synthetic_archive(tmp_path)
  paths = prepare_images.prepare(archive, str(tmp_path / "out"), CLASSES)
  rows = [l.split("\t") for l in
          pathlib.Path(paths["test"]).read_text().splitlines()[1:]]
  names = [n for n, _ in rows]
  want = np.stack([_expected(files[n]) for n in names])
  # Evaluation: the whole image (crop_fraction 1, no resize).
  batch = next(iter(data.build_pipeline(
      _cifar_cfg(paths["test"]), "validation", batch_size=6, seed=0,
      repeat=False, shuffle=False)))
  assert batch["inputs"].shape == (6, 64, 48)
  np.testing.assert_array_equal(batch["label"], [int(l) for _, l in rows])
  np.testing.assert_allclose(batch["inputs"], want, atol=1e-5)
  # The train split read as an evaluation reads it (once, in order): the
  # whole images, as the validation split, whatever the seed.
  for seed in (0, 3):
    again = next(iter(data.build_pipeline(
        _cifar_cfg(paths["test"], min_crop_area=0.35), "train", batch_size=6,
        seed=seed, repeat=False, shuffle=False)))
    np.testing.assert_array_equal(again["inputs"], batch["inputs"])
  # Training with min_crop_area=1: the whole image, flipped or not.
  batch = next(iter(data.build_pipeline(
      _cifar_cfg(paths["test"], min_crop_area=1.0), "train", batch_size=6,
      seed=3, repeat=True, shuffle=False)))
  flipped = np.stack([
      _patchify(np.flip(np.asarray(
          tf.io.decode_jpeg(files[n], channels=3), np.float32) / 255.0
                        - MEAN, 1) / STD, 4) for n in names])
  same = [np.allclose(b, w, atol=1e-4) for b, w in zip(batch["inputs"], want)]
  flip = [np.allclose(b, f, atol=1e-4)
          for b, f in zip(batch["inputs"], flipped)]
  assert all(s or f for s, f in zip(same, flip)), (same, flip)
  assert any(flip) and any(same)  # 6 fair coins: both seen at this seed


def test_real_cifar_patches_equal_the_shared_npz(shared_data, tmp_path):
  # One test image per class from the shared archive, through the pipeline,
  # against the npz of the same files decoded by Pillow (200 per class).
  archive = shared_data / "cifar10/cifar10_jpeg_train_test.tar.gz"
  npz = np.load(shared_data / "cifar10/cifar10_test_2000.npz")
  names = [f"test/{c}/0000.jpg" for c in prepare_images.CIFAR10_CLASSES]
  with tarfile.open(archive) as tar:
    for n in names:
      tar.extract(n, tmp_path, filter="data")
  tsv = tmp_path / "test.tsv"
  tsv.write_text("filename\tclass_index\n" + "".join(
      f"{n}\t{i}\n" for i, n in enumerate(names)))
  batch = next(iter(data.build_pipeline(
      _cifar_cfg(str(tsv)), "validation", batch_size=10, seed=0,
      repeat=False, shuffle=False)))
  x = npz["x"][::200].astype(np.float32)
  np.testing.assert_array_equal(npz["y"][::200], np.arange(10))
  np.testing.assert_array_equal(batch["label"], np.arange(10))
  want = np.stack([_patchify((im / 255.0 - MEAN) / STD, 4) for im in x])
  # Pillow and TensorFlow decode JPEG with different IDCT / chroma
  # upsampling choices (TF's default DCT is the fast integer one): measured
  # 4 grey levels at most, 1 on average. A wrong patch order is off by tens.
  scale = np.tile(STD, 16) * 255  # one patch's (row, col, channel) entries
  diff = np.abs(batch["inputs"] - want) * scale
  assert diff.max() <= 8 and diff.mean() < 1.5, (diff.max(), diff.mean())
  wrong = np.abs(batch["inputs"] - want[:, ::-1]) * scale
  assert wrong.mean() > 10 * diff.mean()


def test_real_archive_layout(shared_data):
  archive = str(shared_data / "cifar10/cifar10_jpeg_train_test.tar.gz")
  with tarfile.open(archive) as tar:
    members = prepare_images._image_members(  # pylint: disable=protected-access
        tar, archive, ("train", "test"), prepare_images.CIFAR10_CLASSES)
  for split, n in (("train", 5000), ("test", 1000)):
    assert {c: len(v) for c, v in members[split].items()} == {
        c: n for c in prepare_images.CIFAR10_CLASSES}


def _flat(cfg, prefix=""):
  out = {}
  for k, v in cfg.items():
    if hasattr(v, "items"):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


# What may differ between configs/cifar10.py:M and configs/imagenet.py:M.
DATA_AND_LENGTH = {
    "data.image_size", "data.patch_size", "data.num_classes",
    "data.min_crop_area", "data.crop_fraction", "model.max_len",
    "model.input_dim", "model.num_classes", "batch_size", "eval_batch_size",
    "num_train_steps", "warmup_steps", "eval_every", "checkpoint_every"}


@pytest.mark.parametrize("model", ["gmlp_ti", "vit_ti16", "mixer_s16"])
def test_cifar_config_is_one_flag_from_imagenet(model):
  cifar = experiment.load_config("cifar10.py", model)
  imagenet = experiment.load_config("imagenet.py", model)
  a, b = _flat(cifar), _flat(imagenet)
  assert set(a) == set(b)
  changed = {k for k in a if a[k] != b[k]}
  assert changed <= DATA_AND_LENGTH, changed - DATA_AND_LENGTH
  assert (imagenet.data.image_size, imagenet.data.patch_size,
          imagenet.model.num_classes, imagenet.data.num_classes) == (
              224, 16, 1000, 1000)
  assert (cifar.data.image_size, cifar.data.patch_size, cifar.model.max_len,
          cifar.model.input_dim, cifar.model.num_classes) == (32, 4, 64, 48, 10)
  data.check_fits_model(cifar.data, cifar.model)
  data.check_fits_model(imagenet.data, imagenet.model)
  # The paper's gMLP-Ti on ImageNet: 5.87M (paper 5.9M).
  if model == "gmlp_ti":
    assert abs(models.count_params(imagenet.model) - 5.9e6) < 0.02 * 5.9e6


def test_small_models_are_of_similar_size():
  tsvs = {"train": "t.tsv", "test": "v.tsv", "test_subset": "s.tsv"}
  sizes = {f: models.count_params(ic.image_config(f, "small", tsvs=tsvs).model)
           for f in ic.SMALL}
  assert max(sizes.values()) / min(sizes.values()) < 1.15, sizes
  for f in ic.SMALL:
    cfg = ic.image_config(f, "small", tsvs=tsvs)
    data.check_fits_model(cfg.data, cfg.model)


# The ViT-style family at toy size: one layer of width 16 (the layout's
# kinds of layers, a fraction of their compile and step time).
TINY_VIT = dict(num_layers=1, d_model=16, d_ffn=32,
                mixer_kwargs=dict(num_heads=2))


def _run_script(mp, argv, cache):
  """The script's ``main`` on ``argv`` (with ``cache`` as its compilation
  cache); experiment.parse raises the cache's threshold for the process,
  which the later tests get back."""
  import jax  # pylint: disable=g-import-not-at-top
  threshold = jax.config.jax_persistent_cache_min_compile_time_secs
  mp.setattr(sys, "argv", ["image_classification.py", *argv,
                           f"--compilation_cache={cache}"])
  try:
    script.main()
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      threshold)


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
  """The script's ``main`` once for the tests that read what it wrote: a
  10-class archive (CIFAR-10's class names, 6 train and 4 test images per
  class: the whole test split is one evaluation batch, which the 8 test
  devices divide), the ViT-style family at ``TINY_VIT``, two seeds of 2
  steps of batch 16. Returns ``(out, results)``."""
  tmp = tmp_path_factory.mktemp("toy_run")
  shared = tmp / "shared" / "cifar10"
  shared.mkdir(parents=True)
  files = {}
  for split, n in (("train", 6), ("test", 4)):
    for c, cls in enumerate(prepare_images.CIFAR10_CLASSES):
      for i in range(n):
        files[f"{split}/{cls}/{i:04d}.jpg"] = _jpeg(7 * c + i)
  _tar(shared / "cifar10_jpeg_train_test.tar.gz", files)
  out = tmp / "exp"
  # The run shares the session's compilation cache.
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", str(tmp / "cache"))
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(ic.SMALL, "vit", TINY_VIT)
    _run_script(mp, ["--scale=small", f"--out={out}",
                     f"--shared={tmp / 'shared'}", "--families=vit",
                     "--steps=2", "--batch_size=16", "--seeds=0,1"], cache)
  return out, json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_toy_run_records_each_seed(toy_run):
  out, results = toy_run
  assert sorted(results["runs"]) == [
      "small/s2b16/vit/seed=0", "small/s2b16/vit/seed=1"]
  for r in results["runs"].values():
    assert r["step"] == 2 and 0.0 <= r["eval"]["accuracy"] <= 1.0
    assert sorted(map(int, r["eval_curve"])) == [1, 2]
    assert (r["model"]["num_layers"], r["model"]["d_model"]) == (1, 16)
    # The "task" evaluator on all 40 test images (batches of 200), at the
    # end.
    assert abs(r["test"]["accuracy"] * 40
               - round(r["test"]["accuracy"] * 40)) < 1e-4, r["test"]
  assert (out / "cifar10_data/test_200_per_class.tsv").exists()
  assert (out / "cifar10_data/train.tsv").exists()


@pytest.mark.slow
def test_toy_run_baselines_on_the_same_images(toy_run):
  out, results = toy_run
  # 60 train, 40 test, 4 per class.
  base = results["baselines"]["small"]
  assert (base["train_images"], base["test_images"]) == (60, 40)
  assert base["chance"] == 0.1 and base["majority"] == 0.1
  x, y = ic.pixel_arrays(str(out / "cifar10_data/train.tsv"))
  tx, ty = ic.pixel_arrays(str(out / "cifar10_data/test.tsv"))
  pred, _ = baselines.ridge_classifier(x, y, tx)
  assert base["linear_pixels"] == np.mean(pred == ty)


@pytest.mark.slow
def test_toy_run_table_and_figure(toy_run):
  out, _ = toy_run
  table = (out / "table.md").read_text()
  assert "ViT-style Transformer" in table and "DeiT-B 81.8" in table
  assert "not ImageNet" in table
  assert "linear classifier on the pixels" in table
  assert "(n=2)" in table  # two seeds: a mean, and no verdict
  assert "not decided" in table
  assert (out / "image_curves.png").stat().st_size > 1000


@pytest.mark.slow
def test_tune_chooses_on_carved_images_and_reports_the_test_split(
    tmp_path, monkeypatch):
  from hypermixer_jax.experiment import selection  # pylint: disable=g-import-not-at-top
  # 8 train images a class: every 10th of the 80 is 8 carved images, which
  # the 8 test devices divide; 4 test images a class.
  (tmp_path / "shared" / "cifar10").mkdir(parents=True)
  _tar(tmp_path / "shared" / "cifar10" / "cifar10_jpeg_train_test.tar.gz",
       {f"{split}/{cls}/{i:04d}.jpg": _jpeg(11 * c + i)
        for split, n in (("train", 8), ("test", 4))
        for c, cls in enumerate(prepare_images.CIFAR10_CLASSES)
        for i in range(n)})
  out = tmp_path / "tuned"
  # Two settings: two learning rates (--lrs), one warm-up share (the
  # module's).
  monkeypatch.setattr(selection, "WARMUP_SHARES", (0.5,))
  monkeypatch.setitem(ic.SMALL, "vit", TINY_VIT)
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "c"))
  argv = ["--scale=small", f"--out={out}", f"--shared={tmp_path / 'shared'}",
          "--families=vit", "--steps=2", "--batch_size=16", "--seeds=0",
          "--tune", "--lrs=0.001,0.03"]
  _run_script(monkeypatch, argv, cache)
  results = json.loads((out / "results.json").read_text())
  split = results["cifar_split"]
  # Every 10th of the 80 training images; digests, no machine paths.
  assert (split["validation"]["documents"], split["train"]["documents"]) == (
      8, 72)
  assert "path" not in json.dumps(split)
  runs = results["runs"]
  searched = [runs[f"small/s2b16/tune/model=vit/setting={i}"]
              for i in (0, 1)]
  for r, lr in zip(searched, (1e-3, 3e-2)):
    assert r["setting"]["lr"] == lr and r["setting"]["warmup"] == 1
    # Scored on the 8 carved images only; the test split is never read.
    assert "test" not in r
    assert abs(r["eval"]["accuracy"] * 8
               - round(r["eval"]["accuracy"] * 8)) < 1e-4
  best = max(searched, key=lambda r: r["eval"]["accuracy"])  # first on ties
  final = runs["small/s2b16/tuned/model=vit/seed=0"]
  assert final["setting"] == best["setting"]
  assert abs(final["test"]["accuracy"] * 40
             - round(final["test"]["accuracy"] * 40)) < 1e-4
  # The pixel baseline is fitted on the carved training images.
  assert results["baselines"]["small/s2b16/carved"]["train_images"] == 72
  # Every search and seed run and the baseline record the carve they used
  # (another carve's are retired, not reused).
  digest = split["validation"]["sha256"]
  assert all(r["carved_validation_sha256"] == digest
             for r in [*searched, final,
                       results["baselines"]["small/s2b16/carved"]])
  table = (out / "table_tuned.md").read_text()
  assert "lr 0.001, warm-up 50%" in table and "lr 0.03, warm-up 50%" in table
  assert " *" in table and "45,000 carved" in table
  assert split["validation"]["sha256"][:12] in table
  # A second process from the grids' last cells finds every cell recorded:
  # it trains nothing and reports the same choice.
  _run_script(monkeypatch, argv + ["--order=reverse"], cache)
  again = json.loads((out / "results.json").read_text())
  assert again["runs"] == runs
  assert (out / "table_tuned.md").read_text() == table
  # --budget_check=1: the choice trained 1 step on the carved training
  # images (its warm-up share of 1 step: 1), scored on the 8 carved ones,
  # beside the pixels' linear classifier fitted on the carved training
  # images and scored on the carved ones; the rule's pick is recorded.
  _run_script(monkeypatch, argv + ["--budget_check=1"], cache)
  results = json.loads((out / "results.json").read_text())
  short = results["runs"]["small/s2b16/budget/steps=1/model=vit"]
  assert short["setting"] == {"lr": best["setting"]["lr"], "warmup": 1,
                              "warmup_share": 0.5}
  assert short["step"] == 1 and "test" not in short
  assert short["carved_validation_sha256"] == digest
  pixels = results["baselines"]["small/s2b16/carved_validation/seed=100"]
  assert (pixels["train_images"], pixels["test_images"]) == (72, 8)
  check = results["length_checks"]["small/s2b16/"]
  want = selection.shortest_length(
      {1: {"vit": short["eval"]["accuracy"]},
       2: {"vit": best["eval"]["accuracy"]}},
      pixels["linear_pixels"], ["vit"], best_above=True)
  assert (check["picked"], check["lengths"]) == (want, [1, 2])
  table = (out / "table_tuned.md").read_text()
  assert (f"| bar: the pixels' linear classifier on these images | "
          f"{100 * pixels['linear_pixels']:.2f} |") in table
