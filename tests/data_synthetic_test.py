"""The §4.7 shape-pairs task: values checked against a per-example decoding."""
import numpy as np
import pytest

from hypermixer_jax import data
from hypermixer_jax.data import synthetic
from hypermixer_jax.data import tasks


def _config(**synthetic_options):
  cfg = data.default_data_config()
  cfg.synthetic.update(synthetic_options)
  return cfg


def _runs(x):
  """[(start, stop)] of the maximal runs of non-zero values of x."""
  nz = np.concatenate([[0], (x != 0).astype(int), [0]])
  edges = np.flatnonzero(np.diff(nz))
  return list(zip(edges[::2], edges[1::2]))


def test_targets_are_pair_means_of_same_shape():
  cfg = _config(noise=0.0, num_eval_examples=53)
  batch = synthetic.split_arrays(cfg.synthetic, "validation")
  assert batch["inputs"].shape == (53, 64, 1)
  assert batch["inputs"].dtype == batch["targets"].dtype == np.float32
  np.testing.assert_array_equal(batch["weights"], np.ones((53, 64)))
  for x, y in zip(batch["inputs"][..., 0], batch["targets"][..., 0]):
    runs = _runs(x)
    assert len(runs) == 4  # 2 triangles + 2 boxes, never touching
    assert _runs(y) == runs
    flat, peaked = [], []
    for s, e in runs:
      ratio = y[s:e] / x[s:e]  # height scaling: mean / own height
      np.testing.assert_allclose(ratio, ratio[0], rtol=1e-5)
      (flat if np.ptp(x[s:e]) < 1e-6 else peaked).append(ratio[0])
    assert len(flat) == len(peaked) == 2
    for r1, r2 in (flat, peaked):
      # mean = h1 r1 = h2 r2 and mean = (h1 + h2) / 2  =>  1/r1 + 1/r2 = 2
      np.testing.assert_allclose(1 / r1 + 1 / r2, 2.0, rtol=1e-5)


def test_examples_do_not_depend_on_batching_or_order():
  opts = _config().synthetic
  idx = np.array([5000, 3, 1030, 17])
  one = synthetic.generate(opts, "train", idx)
  for i, j in enumerate(idx):
    single = synthetic.generate(opts, "train", [j])
    np.testing.assert_array_equal(single["inputs"][0], one["inputs"][i])
  other = synthetic.generate(_config(data_seed=1).synthetic, "train", idx)
  assert not np.allclose(other["inputs"], one["inputs"])
  val = synthetic.generate(opts, "validation", idx)
  assert not np.allclose(val["inputs"], one["inputs"])


def test_pipeline_batches_epochs_and_shards():
  cfg = _config(num_examples=100)
  kw = dict(batch_size=16, seed=3, repeat=True, shuffle=True)
  shards = [data.build_pipeline(cfg, "train", shard_index=i, num_shards=2, **kw)
            for i in range(2)]
  seen = []
  for p in shards:
    it = iter(p)
    batches = [next(it) for _ in range(3)]  # one epoch is 50 // 16 = 3
    assert all(b["inputs"].shape == (16, 64, 1) for b in batches)
    seen.append(np.concatenate([b["inputs"] for b in batches]))
    assert p.get_state()["epoch"] == 0
    next(it)
    assert p.get_state()["epoch"] == 1
  everything = synthetic.split_arrays(cfg.synthetic, "train")["inputs"]
  rows = {x.tobytes() for x in everything}
  a, b = ({x.tobytes() for x in s} for s in seen)
  assert a <= rows and b <= rows and not a & b  # disjoint shards
  # Within an epoch no row repeats: each shard's 3 batches are 48 of its 50.
  assert len(a) == len(b) == 48


def test_seqio_task_matches_numpy_path():
  cfg = _config(num_eval_examples=7)
  task = tasks.get_task(cfg)
  ds = task.get_dataset(None, split="validation", shuffle=False, seed=0)
  tf_examples = list(ds.as_numpy_iterator())
  batch = next(iter(data.build_pipeline(cfg, "validation", batch_size=7,
                                        seed=0, repeat=False, shuffle=False)))
  assert len(tf_examples) == 7
  for i, ex in enumerate(tf_examples):
    for k in ("inputs", "targets", "weights"):
      np.testing.assert_array_equal(ex[k], batch[k][i])


def test_endless_stream():
  cfg = _config(num_examples=0)
  p = data.build_pipeline(cfg, "train", batch_size=4, seed=0, repeat=True,
                          shuffle=True)
  it = iter(p)
  first = [next(it)["inputs"] for _ in range(3)]
  np.testing.assert_array_equal(
      first[1], synthetic.generate(cfg.synthetic, "train", np.arange(4, 8))
      ["inputs"])


def test_sequence_too_short():
  with pytest.raises(ValueError, match="below the minimum"):
    data.build_pipeline(_config(seq_len=20), "train", batch_size=2, seed=0,
                        repeat=False, shuffle=False)


def test_synthetic_runs_import_no_tensorflow():
  """The synthetic task reads no tf.data pipeline: its runs, the config files
  and the command line's config checks never import TensorFlow or seqio
  (about 3 s of CPU per process). Checked in a fresh interpreter."""
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = (
      "import sys, runpy\n"
      "from hypermixer_jax import data\n"
      "from hypermixer_jax.train import loop, artifacts, workdir\n"
      "config = runpy.run_path('configs/default.py')['get_config']()\n"
      "data.check_fits_model(config.data, config.model)\n"
      "p = data.build_pipeline(config.data, 'train', batch_size=2, seed=0,\n"
      "                        repeat=True, shuffle=True)\n"
      "p.set_state(p.get_state())\n"
      "assert next(iter(p))['inputs'].shape[0] == 2\n"
      "assert issubclass(data.DataError, workdir.user_errors())\n"
      "print(sorted(m for m in ('tensorflow', 'seqio') if m in sys.modules))\n")
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.splitlines()[-1] == "[]", out.stdout


def test_validation_carved_from_the_training_set():
  # validation_every = 10: validation is training sequences 0, 10, 20, 30,
  # train the other 31 in order, test its own draw; together the two are
  # exactly the training set without the carve.
  whole = synthetic.split_arrays(_config(num_examples=35).synthetic,
                                 "train")["inputs"]
  cfg = _config(num_examples=35, validation_every=10, num_eval_examples=8)
  batches = {split: list(data.build_pipeline(
      cfg, split, batch_size=1, seed=0, repeat=False, shuffle=False))
             for split in ("train", "validation", "test")}
  got = {s: np.concatenate([b["inputs"] for b in bs])
         for s, bs in batches.items()}
  assert [len(got[s]) for s in ("train", "validation", "test")] == [31, 4, 8]
  np.testing.assert_array_equal(got["validation"], whole[::10])
  np.testing.assert_array_equal(
      got["train"], whole[[i for i in range(35) if i % 10]])
  rows = {x.tobytes() for x in whole}
  assert not {x.tobytes() for x in got["test"]} & rows
  # Without the carve, validation is a draw of its own.
  own = synthetic.split_arrays(_config(num_examples=35,
                                       num_eval_examples=4).synthetic,
                               "validation")["inputs"]
  assert not {x.tobytes() for x in own} & rows


@pytest.mark.parametrize("every,examples", [(1, 100), (10, 0), (10, 5)])
def test_a_carve_the_training_set_cannot_give_is_refused(every, examples):
  cfg = _config(num_examples=examples, validation_every=every)
  with pytest.raises(ValueError, match=r"^data.synthetic.validation_every="
                     f"{every} carves .* num_examples={examples}\\); set it "
                     "to 0"):
    data.build_pipeline(cfg, "train", batch_size=2, seed=0, repeat=False,
                        shuffle=False)
