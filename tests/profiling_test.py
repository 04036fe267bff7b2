"""The profiler option traces its window of steps into a viewable trace."""
import gzip
import json
import os

import jax
import jax.numpy as jnp

from hypermixer_jax.train import profiling


def test_trace_of_a_step_window_is_written(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
  x = jnp.ones((64, 64))
  prof = profiling.StepProfiler(str(tmp_path), start_step=3, num_steps=2)
  started = []
  for step in range(1, 7):
    with prof.step(step):
      started.append(prof._active)  # pylint: disable=protected-access
      prof.keep(f(x + step))
  prof.close()
  assert started == [False, False, True, True, False, False]
  files = profiling.trace_files(str(tmp_path / "profile"))
  assert any(p.endswith(".xplane.pb") for p in files), files
  [perfetto] = [p for p in files if p.endswith("perfetto_trace.json.gz")]
  with gzip.open(perfetto, "rt") as fh:
    events = json.load(fh)
  events = events["traceEvents"] if isinstance(events, dict) else events
  names = {e.get("name", "") for e in events}
  # The two annotated steps are in the trace.
  assert {"train"} <= names or any("train" in n for n in names), sorted(
      names)[:50]


def test_disabled_profiler_writes_nothing(tmp_path):
  prof = profiling.StepProfiler(str(tmp_path))
  for step in range(1, 4):
    with prof.step(step):
      pass
  prof.close()
  assert not prof.enabled and not os.path.exists(tmp_path / "profile")


def test_run_ending_inside_the_window_still_writes_the_trace(tmp_path):
  prof = profiling.StepProfiler(str(tmp_path), start_step=1, num_steps=10)
  with prof.step(1):
    prof.keep(jnp.ones(3) * 2)
  prof.close()
  assert profiling.trace_files(str(tmp_path / "profile"))
