"""The profiler option traces its window of steps into a viewable trace."""
import gzip
import json
import os

import jax
import jax.numpy as jnp
import pytest

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


# Marked slow to run early (conftest.py: slow modules first): late in a test
# worker that had run hundreds of tests this run took 44 s, alone 6 s.
@pytest.mark.slow
def test_training_run_profiles_logs_lines_and_reports_mfu(tmp_path, capsys):
  """Through the loop: the profiled window, one plain line per log step, MFU
  from the configured peak (CPUs are not in the peak table)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import loop  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  argv = ["prog", f"--config={os.path.join(root, 'configs', 'default.py')}",
          "--config.model.num_layers=1", "--config.model.d_model=16",
          "--config.model.d_ffn=32", "--config.model.max_len=40",
          "--config.model.mixer_kwargs.hyper_dim=8",
          "--config.data.synthetic.seq_len=40",
          "--config.data.synthetic.num_eval_examples=16",
          "--config.batch_size=8", "--config.eval_batch_size=16",
          "--config.num_train_steps=6", "--config.warmup_steps=1",
          "--config.log_every=2", "--config.eval_every=0",
          "--config.checkpoint_every=0", "--config.profile.start_step=3",
          "--config.profile.num_steps=2",
          "--config.peak_flops_per_device=1e12"]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  fv(argv)
  config = fv.config
  config.evals = {}
  loop.train_and_evaluate(config, str(tmp_path))
  assert profiling.trace_files(str(tmp_path / "profile"))
  out = capsys.readouterr().out
  lines = [l for l in out.splitlines() if l.startswith("[train] step ")]
  assert [l.split(":")[0] for l in lines] == [
      "[train] step 2/6", "[train] step 4/6", "[train] step 6/6"], out
  assert all("loss=" in l for l in lines)
  train = metrics_lib.read_metrics(str(tmp_path))
  assert train[6]["mfu"] == pytest.approx(
      train[6]["tflops_per_device"] * 1e12 / 1e12)


def test_op_times_names_the_compiled_instructions(tmp_path):
  # Per-instruction times of a traced program carry the names of its
  # compiled HLO's instructions (what the kit's profile maps to parts).
  from hypermixer_jax.train import hlo_costs  # pylint: disable=g-import-not-at-top
  f = jax.jit(lambda a, b: jnp.tanh(a @ b).sum(axis=0))
  a = jnp.ones((256, 256))
  compiled = f.lower(a, a).compile()
  compiled(a, a).block_until_ready()
  jax.profiler.start_trace(str(tmp_path))
  for _ in range(3):
    compiled(a, a).block_until_ready()
  jax.profiler.stop_trace()
  [xplane] = [p for p in profiling.trace_files(str(tmp_path))
              if p.endswith(".xplane.pb")]
  times = profiling.op_times(xplane)
  [(module, ops)] = [(m, t) for m, t in times.items() if "jit" in m]
  assert "_lambda" in module
  names = hlo_costs.instruction_parts(compiled.as_text())
  assert ops and set(ops) <= set(names), (sorted(ops), sorted(names))
  assert all(s > 0 for s in ops.values())
  # The matmul is one of them and not the cheapest.
  dots = [n for n in ops if "dot" in names[n][1] or "dot" in n
          or "ynn" in n or "fusion" in n]
  assert dots, sorted(ops)
