"""Bookkeeping of the benchmarks (fake clocks; no timed assertion)."""
import os
import sys
import types

import numpy as np
import pytest

from hypermixer_jax.experiment import bench as bc
from hypermixer_jax.experiment import input_rates


class FakeClock:
  """A clock that advances only when a fake workload 'runs'."""

  def __init__(self):
    self.now = 0.0
    self.log = []

  def __call__(self):
    return self.now

  def workload(self, name, durations):
    """A call that takes durations[i] seconds on its i-th call."""
    it = iter(durations)

    def call():
      self.now += next(it)
      self.log.append(name)
      return name
    return call


def test_interleave_order_inner_and_per_call_times():
  clock = FakeClock()
  # Ceiling: warm-up 1.0, sizing 0.25 -> inner = 2 per round of >= 0.5 s.
  ceil = bc.Timed(clock.workload("C", [1.0, 0.25] + [0.25, 0.25,   # round 0
                                                     0.5, 0.5,     # round 1
                                                     0.25, 0.75]),  # round 2
                  min_seconds=0.5, clock=clock, block=lambda x: x)
  # Step: warm-up, sizing 2.0 -> inner = 1.
  step = bc.Timed(clock.workload("S", [9.0, 2.0, 2.0, 4.0]),
                  min_seconds=0.5, clock=clock, block=lambda x: x)
  ceil_times, times = bc.interleave(ceil, {"S": step}, rounds=2)
  assert ceil.inner == 2 and step.inner == 1
  # Warm-ups first, then C S C S C.
  assert clock.log == ["C", "C", "S", "S", "C", "C", "S", "C", "C", "S",
                       "C", "C"]
  assert ceil_times == [0.25, 0.5, 0.5]
  assert times == {"S": [2.0, 4.0]}


def test_summarize_best_median_and_paired_mfu():
  # Ceiling of 100 FLOP: rates 100, 50, 100, 200 FLOP/s.
  ceil_times = [1.0, 2.0, 1.0, 0.5]
  times = [10.0, 20.0, 5.0]
  s = bc.summarize(ceil_times, 100.0, times, flops=400.0)
  assert s.min_s == 5.0 and s.median_s == 10.0
  assert s.ceiling_best == 200.0 and s.ceiling_median == 100.0
  assert s.mfu_best == pytest.approx(400 / 5 / 200)
  # Round r against the mean rate of ceiling rounds r and r + 1.
  expect = [400 / 10 / 75, 400 / 20 / 75, 400 / 5 / 150]
  np.testing.assert_allclose(s.paired, expect)
  assert s.mfu_paired == pytest.approx(np.median(expect))


def test_summarize_refuses_unpaired_rounds():
  with pytest.raises(ValueError, match="3 ceiling rounds for 3 workload"):
    bc.summarize([1.0, 1.0, 1.0], 1.0, [1.0, 1.0, 1.0], 1.0)
  with pytest.raises(ValueError, match="rounds=0 must be at least 1"):
    bc.interleave(bc.Timed(lambda: 0), {}, rounds=0)


def test_profile_self_times_subtract_nested_events():
  from types import SimpleNamespace as E  # pylint: disable=g-import-not-at-top
  names = {1: "Execute", 2: "fusion.1", 3: "sub", 4: "dot.2"}
  # Execute [0, 100) holds fusion.1 [10, 50) (holding sub [20, 30)) and
  # dot.2 [60, 90); a later dot.2 [100, 110) stands alone.
  events = [E(offset_ps=60, duration_ps=30, metadata_id=4),
            E(offset_ps=0, duration_ps=100, metadata_id=1),
            E(offset_ps=20, duration_ps=10, metadata_id=3),
            E(offset_ps=10, duration_ps=40, metadata_id=2),
            E(offset_ps=100, duration_ps=10, metadata_id=4)]
  got = {}
  for name, ps in bc._self_times(events, names):  # pylint: disable=protected-access
    got[name] = got.get(name, 0) + ps
  assert got == {"Execute": 30, "fusion.1": 30, "sub": 10, "dot.2": 40}


def test_sharded_sample_reads_every_row_once_per_shard(tmp_path):
  """``--shards K``: K links whose glob the real local reader reads whole."""
  import collections  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data import sources  # pylint: disable=g-import-not-at-top
  sample = tmp_path / "docs.jsonl"
  texts = [f"document {i} \u00e9" for i in range(5)]
  sample.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts),
                    encoding="utf-8")
  assert input_rates.sharded(sample, 1, "") == str(sample)
  pattern = input_rates.sharded(sample, 3, str(tmp_path / "shards"))
  assert pattern == str(tmp_path / "shards" / "docs-*-of-00003.jsonl")
  # Again: the links are there already.
  again = input_rates.sharded(sample, 3, str(tmp_path / "shards"))
  assert again == pattern and len(os.listdir(tmp_path / "shards")) == 3
  source = sources.local_source(
      {"train": pattern},
      sources.local_reader("jsonl", {"text": ("text",)}))
  rows = [ex["text"].decode() for ex in source.get_dataset(
      "train", shuffle=False).as_numpy_iterator()]
  assert collections.Counter(rows) == {t: 3 for t in texts}
  assert {r.split(":")[0] for r in [ex["source"].decode() for ex in
          source.get_dataset("train", shuffle=False).as_numpy_iterator()]} \
      == {os.path.join(str(tmp_path / "shards"), f"docs-{i:05d}-of-00003.jsonl")
          for i in range(3)}


def test_state_timing_restores_without_replay(mnli):
  """``--state``: the position is saved in TF's own format (checked inside)
  and a restore continues without replaying batches."""
  r = input_rates.state_timing(mnli, "train", batch_size=4, warmup=3)
  assert r["replayed"] == 0 and r["state_mb"] > 0
  assert min(r["save_s"], r["tf_save_s"], r["new_first_batch_s"]) > 0


@pytest.fixture(scope="module")
def mnli(tmp_path_factory):
  """A data config of the MNLI pipeline on a tiny generated TSV."""
  from hypermixer_jax import data  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data import testing  # pylint: disable=g-import-not-at-top
  tmp = tmp_path_factory.mktemp("mnli")
  path = str(tmp / "pairs.tsv")
  testing.write_pairs_tsv(path, 40)
  cfg = data.default_data_config()
  cfg.update(task="glue_mnli", seq_len=64, shuffle_buffer_size=16,
             vocab_path=testing.tiny_vocab(str(tmp / "vocab")))
  cfg.local_files.train = path
  return cfg


def test_pipeline_rates_count_the_timed_batches(mnli):
  """Tokens per example is that of the timed batches (the ones after the
  warm-up, from the same seeded stream), and per core = rate / cores."""
  from hypermixer_jax import data  # pylint: disable=g-import-not-at-top
  r = input_rates.measure_pipeline(mnli, "train", batch_size=4, batches=6,
                                   warmup=3)
  it = iter(data.build_pipeline(mnli, "train", batch_size=4, seed=0,
                                repeat=True, shuffle=True))
  stream = [next(it) for _ in range(9)]
  np.testing.assert_array_equal(r["batch"]["inputs"], stream[2]["inputs"])
  real = sum(int((b["segment_ids"] > 0).sum()) for b in stream[3:])
  assert 0 < real < 24 * 64     # padding is not counted
  assert r["tokens_s"] / r["examples_s"] == pytest.approx(real / 24)
  assert r["examples_s_per_core"] == pytest.approx(
      r["examples_s"] / r["cores_busy"])


def test_task_models_match_their_configs():
  """The model each pipeline feeds: the head, length and causality of its
  config file; the image model shaped by the patches."""
  from hypermixer_jax import data  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  text = {"inputs": np.zeros((2, 24), np.int32)}
  want = {"c4_mlm": "mlm", "c4_lm": "causal_lm", "glue_sst2": "classify",
          "glue_mnli": "pair_classify"}
  for task, head in want.items():
    cfg = data.default_data_config()
    cfg.task = task
    m = input_rates.task_model(cfg, text, "hypermixer", 1, "mixer_s16")
    assert (models.model_facts(m).head, m.max_len, m.num_layers) == (
        head, 24, 1), task
    assert m.mixer_kwargs.get("causal", False) == (task == "c4_lm"), task
  cfg = data.default_data_config()
  cfg.task = "imagenet_patches"
  m = input_rates.task_model(
      cfg, {"inputs": np.zeros((2, 49, 48), np.float32)}, "hypermixer", 0,
      "mixer_s16")
  assert (m.input_dim, m.max_len, m.patch_size) == (48, 49, 0)
  assert m.num_layers == models.get_model_config("mixer_s16").num_layers
  # The synthetic task: no model.
  assert input_rates.task_model(data.default_data_config(), text,
                                "hypermixer", 1, "mixer_s16") is None


def test_torch_timed_protocol_and_a_dead_worker():
  """The child answers warm/round in seconds per call; a child that cannot
  build its workload ends, and the parent says so instead of hanging."""
  timer = bc.TorchTimed(sys.executable, "sleep",
                        dict(seconds=0.02, min_seconds=0.05))
  try:
    timer.warm()
    rounds = [timer.round() for _ in range(2)]
  finally:
    timer.close()
  assert all(t >= 0.02 for t in rounds)
  dead = bc.TorchTimed(sys.executable, "no_such_workload",
                       dict(min_seconds=0.05))
  with pytest.raises(RuntimeError, match="the torch worker ended"):
    dead.warm()
  dead.close()


def test_model_consumption_is_steps_times_batch():
  from hypermixer_jax.train.config import text_model  # pylint: disable=g-import-not-at-top
  m = text_model("hypermixer", "classify")
  m.update(num_layers=1, d_model=16, d_ffn=32, max_len=8, vocab_size=64)
  m.mixer_kwargs.hyper_dim = 8
  c = input_rates.model_consumption(m, batch_size=4, length=8, rounds=1,
                                    min_seconds=0.01)
  assert c["steps_s"] > 0
  assert c["examples_s"] == pytest.approx(4 * c["steps_s"])


def test_gemm_forms_compute_the_same_product_as_torchs():
  """bench_gemm times each product as the step writes it and in a plain
  layout: the two give the same matrix (the plain form's operands are the
  written ones transposed), and the PyTorch child's logical shapes give
  the same output shape."""
  import jax  # pylint: disable=g-import-not-at-top
  import script_modules  # pylint: disable=g-import-not-at-top
  gemm = script_modules.load("benchmarks/bench_gemm.py")
  rng = np.random.default_rng(0)
  plain_from_written = [
      lambda x, w: (x, w),
      lambda x, g: (x.T, g),
      lambda v, w: (np.swapaxes(v, 1, 2), w),
      lambda w, h: (w, np.swapaxes(h, 1, 2))]
  for p, to_plain in zip(gemm.products(2, 6, 3, 4), plain_from_written):
    fn, shapes = p["written"]
    args = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    written = np.asarray(jax.jit(fn)(*args))
    plain_fn, plain_shapes = p["plain"]
    plain_args = to_plain(*args)
    assert [a.shape for a in plain_args] == [tuple(s) for s in plain_shapes]
    np.testing.assert_allclose(np.asarray(plain_fn(*plain_args)), written,
                               rtol=1e-5, atol=1e-5, err_msg=p["name"])
    t = p["torch"]
    assert np.matmul(np.empty(t["lhs"]), np.empty(t["rhs"])).shape == \
        written.shape, p["name"]
    assert p["flops"] == 2 * written.size * plain_shapes[0][-1]


@pytest.mark.parametrize("kind", ["TPU v4", "TPU v5 lite", "TPU v5e",
                                  "TPU v5", "TPU v5p", "TPU v6 lite",
                                  "TPU v6e", "NVIDIA H100 80GB HBM3",
                                  "NVIDIA H200"])
def test_benchmark_peaks_are_the_loops_for_every_chip(kind, monkeypatch):
  # The benchmarks' bf16 peak of each device kind is the training loop's
  # (train.metrics.PEAK_FLOPS): v5p reports itself as "TPU v5".
  from hypermixer_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  dev = types.SimpleNamespace(device_kind=kind, platform="tpu")
  monkeypatch.setattr(bc.jax, "devices", lambda: [dev])
  assert bc.device_peak("bfloat16") == metrics_lib.peak_flops(kind)
