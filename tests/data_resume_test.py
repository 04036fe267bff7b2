"""A pipeline restored from a saved position continues the uninterrupted stream."""
import json

import numpy as np
import pytest

from hypermixer_jax import data
from hypermixer_jax.data import testing


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """A tiny vocabulary, an MNLI-style TSV and a C4-style corpus of 10
  documents: 5-6 packed MLM batches of 4 an epoch, so a stream of 7 batches
  crosses an epoch while the shorter streams stay in the first one (each new
  epoch builds a tf.data graph, the slow part of these tests)."""
  root = tmp_path_factory.mktemp("resume")
  pairs = str(root / "pairs.tsv")
  testing.write_pairs_tsv(pairs, 26)
  return {"vocab": testing.tiny_vocab(str(root / "vocab")),
          "corpus": testing.write_corpus(str(root / "c4"), num_files=2,
                                         docs_per_file=5),
          "pairs": pairs}


def _configs(files):
  mlm = data.default_data_config()
  mlm.update(task="c4_mlm", vocab_path=files["vocab"], seq_len=64,
             packing=True, shuffle_buffer_size=64)
  mlm.local_files = {"train": files["corpus"]}
  glue = data.default_data_config()
  glue.update(task="glue_mnli", vocab_path=files["vocab"], seq_len=24,
              shuffle_buffer_size=64)
  glue.local_files = {"train": files["pairs"]}
  synth = data.default_data_config()
  synth.synthetic.num_examples = 20
  return {"c4_mlm": mlm, "glue_mnli": glue, "synthetic_pairs": synth}


def _take(pipeline, n):
  it = iter(pipeline)
  return [next(it) for _ in range(n)]


KW = dict(batch_size=4, seed=11, repeat=True, shuffle=True)


def _read_stream(cfg):
  """An uninterrupted shuffled stream (``KW``) that the resume tests compare
  against: ``full``, its first 10 batches (across the first epoch's end on
  these files); ``states``, ``get_state()`` after 2 and after 7 batches (as
  JSON, as a checkpoint holds it); ``tf_save``, TF's own eager ``_save`` of
  the live tf.data iterator after 2 batches; ``epoch_end``, the number of
  batches of the first epoch."""
  pipeline = data.build_pipeline(cfg, "train", **KW)
  it = iter(pipeline)
  full, states, tf_save, epoch_end = [], {}, None, None
  while len(full) < 10:
    if len(full) in (2, 7):
      states[len(full)] = json.dumps(pipeline.get_state())
    if len(full) == 2 and pipeline._iterator is not None:  # pylint: disable=protected-access
      tf_save = pipeline._iterator._save().numpy().decode()  # pylint: disable=protected-access
    full.append(next(it))
    if epoch_end is None and pipeline._epoch == 1:  # pylint: disable=protected-access
      epoch_end = len(full) - 1
  return {"full": full, "states": states, "tf_save": tf_save,
          "epoch_end": epoch_end}


@pytest.fixture(scope="module")
def c4_stream(files):
  """The C4 MLM stream of ``_read_stream``, read once for the module: its
  tests resume it from the same saved positions (each epoch's tf.data graph
  is the slow part of these tests; the stream's two are built once)."""
  return _read_stream(_configs(files)["c4_mlm"])


def _state(stream, batch):
  """A fresh copy of the stream's state after ``batch`` batches."""
  return json.loads(stream["states"][batch])


@pytest.mark.parametrize("task", ["c4_mlm", "glue_mnli", "synthetic_pairs"])
def test_resume_reproduces_stream(files, c4_stream, task):
  cfg = _configs(files)[task]
  stream = c4_stream if task == "c4_mlm" else _read_stream(cfg)
  full, state = stream["full"], _state(stream, 7)
  assert state["epoch"] >= 1 and state["batch"] < 7  # the cut crosses epochs
  resumed = data.build_pipeline(cfg, "train", **KW)
  resumed.set_state(state)
  for a, b in zip(full[7:], _take(resumed, 3)):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=f"{task} {k}")
  # Another seed gives another order.
  other = _take(data.build_pipeline(cfg, "train", **{**KW, "seed": 12}), 1)
  assert not np.array_equal(full[0]["targets" if "targets" in other[0]
                                   else "inputs"],
                            other[0]["targets" if "targets" in other[0]
                                     else "inputs"])


def test_state_mismatch_is_refused(files):
  cfg = _configs(files)["synthetic_pairs"]
  p = data.build_pipeline(cfg, "train", batch_size=4, seed=0, repeat=True,
                          shuffle=True)
  q = data.build_pipeline(cfg, "train", batch_size=8, seed=0, repeat=True,
                          shuffle=True)
  with pytest.raises(data.DataError, match=(
      r"^the checkpoint's input position is for batch_size=4 \(per host\), "
      r"this run's "
      r"input pipeline has batch_size=8 \(resume with the batch_size the run "
      r"was trained with\), or start another --workdir from its parameters "
      r"with --config.init_checkpoint.$")):
    q.set_state(p.get_state())


def test_hosts_read_disjoint_shards(files):
  cfg = _configs(files)["c4_mlm"]
  cfg.packing = False
  rows = []
  for i in range(2):
    p = data.build_pipeline(cfg, "train", batch_size=4, shard_index=i,
                            num_shards=2, seed=0, repeat=False, shuffle=False)
    rows.append({r.tobytes() for b in p for r in b["targets"]})
  whole = data.build_pipeline(cfg, "train", batch_size=4, seed=0,
                              repeat=False, shuffle=False)
  everything = {r.tobytes() for b in whole for r in b["targets"]}
  assert rows[0] and rows[1] and not rows[0] & rows[1]
  assert rows[0] | rows[1] == everything


def test_hosts_draw_their_own_masks(files):
  """seqio seeds an example's masking by its place in the host's stream and
  the pipeline's seed, which every host shares: the k-th rows of two hosts
  would be masked at the same positions. Each host folds in its index."""
  cfg = _configs(files)["c4_mlm"]
  cfg.packing = False
  hosts = [[(int(np.sum(t > 0)), m) for b in data.build_pipeline(
      cfg, "train", batch_size=4, shard_index=i, num_shards=2, seed=0,
      repeat=False, shuffle=False)
              for t, m in zip(b["targets"], b["masked_positions"])]
           for i in range(2)]
  # Rows of one length (full chunks) at the same place: seqio's seeds alone
  # mask them alike.
  pairs = [(a[1], b[1]) for a, b in zip(*hosts) if a[0] == b[0]]
  assert len(pairs) >= 3
  same = sum(np.array_equal(a, b) for a, b in pairs)
  assert same <= 1, (same, len(pairs))


def test_eval_pipeline_ends(files):
  cfg = _configs(files)["glue_mnli"]
  p = data.build_pipeline(cfg, "train", batch_size=8, seed=0, repeat=False,
                          shuffle=False)
  sizes = [len(b["label"]) for b in p]
  assert sizes == [8, 8, 8, 2] and p.get_state()["done"]
  assert list(p) == []


def _assert_same_batches(a, b):
  assert len(a) == len(b) > 0
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("task", ["c4_mlm", "glue_mnli"])
def test_restarted_eval_pipeline_reuses_its_dataset(files, task):
  """An evaluation's pipeline, restarted, yields what a newly built one
  yields (the MLM masking is seeded), from the same tf.data dataset."""
  cfg = _configs(files)[task]
  kw = dict(batch_size=4, seed=3, repeat=False, shuffle=False)
  split = "train"
  p = data.build_pipeline(cfg, split, **kw)
  once = list(p)
  again = p.restarted()
  _assert_same_batches(list(again), once)
  _assert_same_batches(list(data.build_pipeline(cfg, split, **kw)), once)
  assert p.restarted()._make_epoch(0) is again._make_epoch(0)  # pylint: disable=protected-access
  assert list(p) == []               # the original stays at its end
  # A shuffled pipeline is rebuilt for each copy: still the same stream.
  shuffled = data.build_pipeline(cfg, split, **{**kw, "shuffle": True})
  once = list(shuffled)
  _assert_same_batches(list(shuffled.restarted()), once)


def test_iterator_state_of_another_graph_resumes_by_skipping(files,
                                                             c4_stream):
  """A saved tf.data iterator that does not fit this pipeline's graph (e.g.
  saved before a change of tf.data options) falls back to skipping."""
  cfgs = _configs(files)
  full, state = c4_stream["full"][:4], _state(c4_stream, 2)
  other = data.build_pipeline(cfgs["glue_mnli"], "train", **KW)
  other_it = iter(other)
  next(other_it)
  state["iterator"] = other.get_state()["iterator"]  # another graph's state
  resumed = data.build_pipeline(cfgs["c4_mlm"], "train", **KW)
  resumed.set_state(state)
  got = _take(resumed, 2)
  assert resumed.batches_replayed == state["batch"] == 2
  for a, b in zip(full[2:], got):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_iterator_state_is_tf_datas_own_format(files, c4_stream):
  """The graph-mode save writes TF's own format: a state from TF's eager
  ``OwnedIterator._save`` restores here, and ours restores with TF's eager
  ``_restore``; both continue the stream exactly (checkpoints written before
  the change load). The two saves of one live iterator may differ in what
  its background prefetch held, so the stream is compared, not the bytes."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  cfg = _configs(files)["c4_mlm"]
  full = c4_stream["full"]
  ours, tfs = _state(c4_stream, 2), c4_stream["tf_save"]
  # Several slices (the join and split of the format are exercised); how
  # many depends on what the buffers held at the save (10 on a busy machine).
  assert len(ours["iterator"].split(",")) > 1
  resumed = data.build_pipeline(cfg, "train", **KW)
  resumed.set_state({**ours, "iterator": tfs})
  _assert_same_batches(_take(resumed, 2), full[2:4])
  assert resumed.batches_replayed == 0
  fresh = data.build_pipeline(cfg, "train", **KW)
  tf_iterator = iter(fresh._make_epoch(ours["epoch"]))  # pylint: disable=protected-access
  tf_iterator._restore(tf.constant(ours["iterator"]))  # pylint: disable=protected-access
  rest_of_epoch = [{k: v.numpy() for k, v in b.items()} for b in tf_iterator]
  assert len(rest_of_epoch) == c4_stream["epoch_end"] - 2
  _assert_same_batches(rest_of_epoch, full[2:2 + len(rest_of_epoch)])


def test_position_restores_under_another_threadpool_size(files):
  """``data.threadpool_size`` changes only speed: a position saved with one
  pool size restores the tf.data iterator (no replay) under another, and the
  stream continues exactly."""
  cfg = _configs(files)["c4_mlm"]
  saved_cfg = cfg.copy_and_resolve_references()
  saved_cfg.threadpool_size = 3
  pipeline = data.build_pipeline(saved_cfg, "train", **KW)
  it = iter(pipeline)
  full = [next(it) for _ in range(2)]
  state = json.loads(json.dumps(pipeline.get_state()))
  full += [next(it) for _ in range(3)]
  assert "iterator" in state
  resumed_cfg = cfg.copy_and_resolve_references()
  resumed_cfg.threadpool_size = 0      # the default: another size here
  resumed = data.build_pipeline(resumed_cfg, "train", **KW)
  resumed.set_state(state)
  got = _take(resumed, 3)
  assert resumed.batches_replayed == 0   # restored, not skipped
  for a, b in zip(full[2:], got):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("size,pool", [(0, None), (5, 5)])
def test_threadpool_size_sets_the_private_pool(files, size, pool):
  from hypermixer_jax.data import config as config_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data import seqio_pipeline  # pylint: disable=g-import-not-at-top
  cfg = _configs(files)["glue_mnli"]
  cfg.threadpool_size = size
  make_epoch = seqio_pipeline.epoch_fn(
      cfg, "train", batch_size=4, shard_index=0, num_shards=1, seed=0,
      repeat=True, shuffle=True)
  want = pool or config_lib.default_threadpool_size()
  assert make_epoch(0).options().threading.private_threadpool_size == want


def test_default_threadpool_size_follows_the_cores(monkeypatch):
  from hypermixer_jax.data import config as config_lib  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(config_lib.os, "sched_getaffinity",
                      lambda pid: set(range(2)), raising=False)
  assert config_lib.default_threadpool_size() == 8
  monkeypatch.setattr(config_lib.os, "sched_getaffinity",
                      lambda pid: set(range(96)), raising=False)
  assert config_lib.default_threadpool_size() == 96


@pytest.mark.parametrize("bad", [-1, 2.5, "8"])
def test_bad_threadpool_size_names_the_field(files, bad):
  cfg = _configs(files)["glue_mnli"]
  with cfg.ignore_type():
    cfg.threadpool_size = bad
  with pytest.raises(ValueError, match=r"data\.threadpool_size=.* must be an "
                     r"integer >= 0 .*--config\.data\.threadpool_size=0"):
    data.build_pipeline(cfg, "train", batch_size=4, seed=0, repeat=True,
                        shuffle=True)
