"""Bookkeeping of the benchmarks' interleaved timing (fake clock, no timing)."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "experiments"))

import bench_common as bc  # noqa: E402


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


def _rec(rate, cpu_per_example=1e-3, share=0.5):
  return {"examples_s": rate, "cpu_s_per_example": cpu_per_example,
          "top_thread_share": share}


def test_input_scaling_bookkeeping_on_fake_runs():
  import bench_input as bi  # pylint: disable=g-import-not-at-top
  assert bi.round_order(4) == [(1, 2), (2, 1), (1, 2), (2, 1)]
  runs = {1: [_rec(100), _rec(80, 2e-3), _rec(90)],
          2: [_rec(190, share=0.6), _rec(150), _rec(175, share=0.7)]}
  s = bi.summarize_scaling(runs)
  assert s[1]["best"] == 100 and s[1]["median"] == 90
  assert s[2]["best"] == 190 and s[2]["per_core"] == 95
  assert s["speedup_best"] == pytest.approx(1.9)
  # Per round: 1.9, 1.875, 1.944..; median 1.9.
  assert s["speedup_paired"] == pytest.approx(1.9)
  assert s[1]["cpu_ms_per_example"] == pytest.approx(1.0)
  assert s[2]["top_thread_share"] == pytest.approx(0.6)
  assert not s["superlinear"]
  # A disturbed one-core round makes a ratio above 2: flagged.
  runs[1][1] = _rec(40, 5e-3)
  assert bi.summarize_scaling(runs)["superlinear"]
  with pytest.raises(ValueError, match="unpaired rounds: 3 one-core and 2"):
    bi.summarize_scaling({1: runs[1], 2: runs[2][:2]})


def test_machine_control_is_read_like_a_pipeline():
  import bench_input as bi  # pylint: disable=g-import-not-at-top
  rec = bi.control_measure(0.05, size=32)
  assert rec["examples_s"] > 0 and rec["cpu_s_per_example"] > 0
  # Two processes at once (2 cores): summed rate, mean CPU per matmul.
  both = bi.combine_control([_rec(90, 1e-3), _rec(110, 3e-3)])
  assert both["examples_s"] == 200
  assert both["cpu_s_per_example"] == pytest.approx(2e-3)
  control = bi.summarize_scaling({1: [_rec(100), _rec(100), _rec(100)],
                                  2: [both, _rec(180), _rec(190)]})
  assert control["speedup_paired"] == pytest.approx(1.9)
  pipeline = bi.summarize_scaling({1: [_rec(50), _rec(50), _rec(50)],
                                   2: [_rec(95), _rec(90), _rec(76)]})
  # Per round 1.9/2.0, 1.8/1.8, 1.52/1.9: median 0.95.
  assert bi.relative_speedup(pipeline, control) == pytest.approx(0.95)


def test_thread_cpu_seconds_sees_a_busy_thread():
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  import bench_input as bi  # pylint: disable=g-import-not-at-top
  busy, release, tid = threading.Event(), threading.Event(), []

  def spin():
    tid.append(threading.get_native_id())
    t = time.thread_time()
    while time.thread_time() - t < 0.2:
      pass
    busy.set()
    release.wait()            # alive while its /proc entry is read
  before = bi.thread_cpu_seconds()
  th = threading.Thread(target=spin)
  th.start()
  busy.wait()
  after = bi.thread_cpu_seconds()
  release.set()
  th.join()
  key = [k for k in after if k.endswith(f"/{tid[0]}")]
  assert key and after[key[0]] - before.get(key[0], 0.0) >= 0.15


def test_sharded_sample_reads_every_row_once_per_shard(tmp_path):
  """``--shards K``: K links whose glob the real local reader reads whole."""
  import collections  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import bench_input as bi  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data import sources  # pylint: disable=g-import-not-at-top
  sample = tmp_path / "docs.jsonl"
  texts = [f"document {i} \u00e9" for i in range(5)]
  sample.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts),
                    encoding="utf-8")
  assert bi.sharded(sample, 1, "") == str(sample)
  pattern = bi.sharded(sample, 3, str(tmp_path / "shards"))
  assert pattern == str(tmp_path / "shards" / "docs-*-of-00003.jsonl")
  again = bi.sharded(sample, 3, str(tmp_path / "shards"))  # idempotent
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


def test_state_timing_restores_without_replay(tmp_path):
  """``--state``: the position is saved in TF's own format (checked inside)
  and a restore continues without replaying batches."""
  import bench_input as bi  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import data  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data import testing  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / "pairs.tsv")
  testing.write_pairs_tsv(path, 40)
  cfg = data.default_data_config()
  cfg.update(task="glue_mnli", seq_len=16, shuffle_buffer_size=16,
             vocab_path=testing.tiny_vocab(str(tmp_path / "vocab")))
  cfg.local_files.train = path
  r = bi.state_timing(cfg, "train", batch_size=4, warmup=3)
  assert r["replayed"] == 0 and r["state_mb"] > 0
  assert min(r["save_s"], r["tf_save_s"], r["new_first_batch_s"]) > 0


def _slice(cores, rate, cpu=1e-4, epochs=1):
  return {"cores": cores, "examples_s": rate, "cpu_s_per_example": cpu,
          "epochs": epochs}


def test_switching_pairs_slices_and_drops_epoch_boundaries():
  import bench_input as bi  # pylint: disable=g-import-not-at-top
  slices = [_slice(1, 100), _slice(2, 180, 1.1e-4),     # 1.8
            _slice(2, 150, 1.2e-4), _slice(1, 100),     # 1.5
            _slice(1, 50, epochs=2), _slice(2, 190),    # dropped
            _slice(2, 190, 1.3e-4), _slice(1, 95, 2e-4)]  # 2.0
  s = bi.summarize_switching(slices)
  assert s["pairs"] == 3 and s["dropped"] == 1
  assert s["ratios"] == pytest.approx([1.8, 1.5, 190 / 95])
  assert s["speedup"] == pytest.approx(1.8)
  assert s["speedup_q25"] == pytest.approx(1.65)
  assert s[1]["median"] == 100 and s[2]["median"] == 180
  assert s[1]["cpu_ms_per_example"] == pytest.approx(0.1)
  assert s[2]["cpu_ms_per_example"] == pytest.approx(0.12)
  with pytest.raises(ValueError, match="3 slices do not make pairs"):
    bi.summarize_switching(slices[:3])
  with pytest.raises(ValueError, match="a pair of 1 and 1 cores"):
    bi.summarize_switching([_slice(1, 1), _slice(1, 1)])
  with pytest.raises(ValueError, match="every pair crossed an epoch"):
    bi.summarize_switching([_slice(1, 1, epochs=2), _slice(2, 1)])


def _allowed(tid):
  with open(f"/proc/self/task/{tid}/status", encoding="utf-8") as f:
    line = [l for l in f if l.startswith("Cpus_allowed_list")][0]
  return line.split(":")[1].strip()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                    reason="needs Linux /proc and sched_setaffinity")
def test_switching_moves_every_thread_and_times_alternate_slices():
  """``switching_measure`` on the embedded synthetic pipeline with a fake
  clock: slices alternate 1,2 | 2,1, and every thread of the process,
  including one started before, is on the slice's CPUs while it runs."""
  import threading  # pylint: disable=g-import-not-at-top
  import bench_input as bi  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import data  # pylint: disable=g-import-not-at-top
  original = os.sched_getaffinity(0)
  first = min(original)
  cpus = {1: {first}, 2: set(sorted(original)[:2])}
  release = threading.Event()
  other = threading.Thread(target=release.wait)
  other.start()
  seen = []
  clock = {"t": 0.0}

  def tick():  # each clock read is 10 ms; a timed slice is 5 reads
    clock["t"] += 0.01
    tids = os.listdir("/proc/self/task")
    seen.append({_allowed(t) for t in tids})
    return clock["t"]

  try:
    cfg = data.default_data_config()
    out = bi.switching_measure(cfg, "train", 8, 1, cpus, slices=3,
                               slice_seconds=0.04, settle_seconds=0.0,
                               clock=tick, cpu_clock=lambda: clock["t"] / 2)
    assert [r["cores"] for r in out] == [1, 2, 2, 1, 1, 2]
    for r in out:
      assert r["epochs"] == 1
      assert r["cpu_s_per_example"] == pytest.approx(
          r["examples_s"] ** -1 / 2, rel=1e-6)
      assert r["examples_s"] > 0
    # At every clock read all threads shared one mask: the running slice's
    # (runs of equal masks follow the slice order; one run if 1 CPU only).
    assert all(len(m) == 1 for m in seen), seen[:5]
    runs = [m for i, m in enumerate(seen) if i == 0 or m != seen[i - 1]]
    order = [{_fmt(cpus[r["cores"]])} for r in out]
    want = [m for i, m in enumerate(order) if i == 0 or m != order[i - 1]]
    assert runs == want
    assert _allowed(other.native_id) == _fmt(cpus[2])  # left on 2 cores
  finally:
    release.set()
    other.join()
    bi.pin_threads(original)
  assert os.sched_getaffinity(0) == original


def _fmt(cpus):
  """``Cpus_allowed_list`` spelling of a CPU set (ranges as a-b)."""
  cpus = sorted(cpus)
  parts, start = [], cpus[0]
  for a, b in zip(cpus, cpus[1:] + [None]):
    if b != a + 1:
      parts.append(f"{start}-{a}" if a != start else f"{a}")
      start = b
  return ",".join(parts)


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
