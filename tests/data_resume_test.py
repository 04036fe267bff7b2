"""A pipeline restored from a saved position continues the uninterrupted stream."""
import json

import numpy as np
import pytest

from hypermixer_jax import data
from hypermixer_jax.data import testing


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("resume")
  pairs = str(root / "pairs.tsv")
  testing.write_pairs_tsv(pairs, 30)
  return {"vocab": testing.tiny_vocab(str(root / "vocab")),
          "corpus": testing.write_corpus(str(root / "c4"), num_files=2,
                                         docs_per_file=5),
          "pairs": pairs}


def _configs(files):
  mlm = data.default_data_config()
  mlm.update(task="c4_mlm", vocab_path=files["vocab"], seq_len=32,
             packing=True, shuffle_buffer_size=64)
  mlm.local_files = {"train": files["corpus"]}
  glue = data.default_data_config()
  glue.update(task="glue_mnli", vocab_path=files["vocab"], seq_len=24,
              shuffle_buffer_size=64)
  glue.local_files = {"train": files["pairs"]}
  synth = data.default_data_config()
  synth.synthetic.num_examples = 40
  return {"c4_mlm": mlm, "glue_mnli": glue, "synthetic_pairs": synth}


def _take(pipeline, n):
  it = iter(pipeline)
  return [next(it) for _ in range(n)]


@pytest.mark.parametrize("task", ["c4_mlm", "glue_mnli", "synthetic_pairs"])
def test_resume_reproduces_stream(files, task):
  cfg = _configs(files)[task]
  kw = dict(batch_size=4, seed=11, repeat=True, shuffle=True)
  full = _take(data.build_pipeline(cfg, "train", **kw), 12)
  for cut in (3, 9):  # 9 is past the first epoch for every task here
    first = data.build_pipeline(cfg, "train", **kw)
    _take(first, cut)
    state = json.loads(json.dumps(first.get_state()))
    resumed = data.build_pipeline(cfg, "train", **kw)
    resumed.set_state(state)
    rest = _take(resumed, 12 - cut)
    for a, b in zip(full[cut:], rest):
      assert a.keys() == b.keys()
      for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{task} {k}")
  assert first.get_state()["epoch"] >= 0
  # Another seed gives another order.
  other = _take(data.build_pipeline(cfg, "train", **{**kw, "seed": 12}), 2)
  assert not all(np.array_equal(a["inputs"], b["inputs"])
                 for a, b in zip(full, other))


def test_resume_crosses_epochs(files):
  cfg = _configs(files)["c4_mlm"]
  p = data.build_pipeline(cfg, "train", batch_size=4, seed=0, repeat=True,
                          shuffle=True)
  _take(p, 12)
  assert p.get_state()["epoch"] >= 1  # the test above did cross an epoch


def test_state_mismatch_is_refused(files):
  cfg = _configs(files)["synthetic_pairs"]
  p = data.build_pipeline(cfg, "train", batch_size=4, seed=0, repeat=True,
                          shuffle=True)
  q = data.build_pipeline(cfg, "train", batch_size=8, seed=0, repeat=True,
                          shuffle=True)
  with pytest.raises(ValueError, match="batch_size"):
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


def test_eval_pipeline_ends(files):
  cfg = _configs(files)["glue_mnli"]
  p = data.build_pipeline(cfg, "train", batch_size=8, seed=0, repeat=False,
                          shuffle=False)
  sizes = [len(b["label"]) for b in p]
  assert sizes == [8, 8, 8, 6] and p.get_state()["done"]
  assert list(p) == []
