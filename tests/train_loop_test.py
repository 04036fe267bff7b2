"""End-to-end tests of the training job (hypermixer_jax.train.loop / main)."""
import logging as std_logging
import os
import shutil
import re
import signal
import subprocess
import sys
import threading

from absl import flags
import jax
import numpy as np
import pytest
from ml_collections import config_flags

from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import loop
from hypermixer_jax.train import run_config
from hypermixer_jax.train import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.py")

# A tiny version of the default job: seconds on two CPU cores. One
# evaluation batch holds the whole validation split, so an evaluation that
# lost the pipeline's first batch would find none.
TINY = [
    "--config.model.num_layers=1", "--config.model.d_model=16",
    "--config.model.d_ffn=32", "--config.model.max_len=40",
    "--config.data.synthetic.seq_len=40",
    "--config.data.synthetic.num_eval_examples=64",
    "--config.batch_size=16", "--config.eval_batch_size=64",
    "--config.warmup_steps=5", "--config.evals.pseudo_attention.every=-1",
]
# The run shared by the tests: they change only fields that do not enter the
# compiled train step, so its programs are compiled once (persistent cache).
RUN = ["--config.num_train_steps=60", "--config.log_every=5",
       "--config.eval_every=30", "--config.checkpoint_every=30",
       "--config.learning_rate=1e-2", "--config.model.dropout_rate=0.1"]


def _config(*overrides):
  argv = ["prog", f"--config={DEFAULT}", *TINY, *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  fv(argv)
  return fv.config


@pytest.fixture(scope="module")
def compilation_cache():
  """The run's persistent compilation cache (tests/conftest.py), for the
  commands this module launches."""
  return os.environ["JAX_COMPILATION_CACHE_DIR"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run of RUN, with the pseudo-attention map."""
  workdir = tmp_path_factory.mktemp("reference")
  # QUIET_SECONDS = -1: the quiet-start warning comes at once (its test).
  warned = []
  handler = std_logging.Handler(std_logging.WARNING)
  handler.emit = lambda record: warned.append(record.getMessage())
  std_logging.getLogger("absl").addHandler(handler)
  quiet, loop.QUIET_SECONDS = loop.QUIET_SECONDS, -1.0
  try:
    result = loop.train_and_evaluate(
        _config(*RUN, "--config.evals.pseudo_attention.every=0"),
        str(workdir))
  finally:
    loop.QUIET_SECONDS = quiet
    std_logging.getLogger("absl").removeHandler(handler)
  return workdir, result, warned


@pytest.mark.slow
def test_default_job_loss_falls(reference):
  tmp_path, res, _ = reference
  train = metrics_lib.read_metrics(str(tmp_path))
  losses = [r["loss"] for r in train.values()]
  assert len(losses) == 12
  assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:2]), losses
  ev = metrics_lib.read_metrics(str(tmp_path), "eval")
  assert sorted(ev) == [30, 60]
  assert ev[60]["mse"] < ev[30]["mse"] * 1.05
  assert res.source == "scratch" and res.step == 60 and not res.preempted
  assert res.eval_metrics["mse"] == pytest.approx(ev[60]["mse"])
  assert int(res.state.step) == 60 and res.workdir == str(tmp_path)
  assert res.evals["pseudo_attention"]["map"].shape == (40, 40)
  assert os.path.getsize(tmp_path / "pseudo_attention.png") > 1000
  assert list(ckpt_lib.Checkpointer(tmp_path / "checkpoints").all_steps()) == [30, 60]
  assert any(f.startswith("events.") for f in os.listdir(tmp_path / "tensorboard"))


def test_unknown_config_field_fails():
  with pytest.raises(AttributeError,
                     match='Did you mean "learning_rate" instead of '
                     '"lerning_rate"'):
    _config("--config.lerning_rate=0.1")


def test_mesh_that_does_not_fit(tmp_path):
  config = _config("--config.mesh.data=3")
  with pytest.raises(ValueError, match="mesh .*data=3.* devices"):
    loop.train_and_evaluate(config, str(tmp_path))


def test_nan_loss_stops_and_is_never_saved(tmp_path):
  config = _config(*RUN, "--config.checkpoint_every=2",
                   "--config.debug.nan_at_step=5")
  with pytest.raises(FloatingPointError,
                     match="NaN/Inf at step 5.*latest checkpoint is step 4"):
    loop.train_and_evaluate(config, str(tmp_path))
  assert max(ckpt_lib.Checkpointer(tmp_path / "checkpoints").all_steps()) == 4


def test_nan_loss_stops_before_an_evaluation_between_log_steps(tmp_path):
  """NaN at step 3, evaluation due at step 3, next log at step 5: the run
  stops at step 3 without evaluating the non-finite state, nothing saved."""
  config = _config(*RUN, "--config.eval_every=3", "--config.log_every=5",
                   "--config.debug.nan_at_step=3")
  with pytest.raises(FloatingPointError,
                     match="NaN/Inf at step 3.*no checkpoint in .* yet"):
    loop.train_and_evaluate(config, str(tmp_path))
  assert not metrics_lib.read_metrics(str(tmp_path), "eval")
  assert not ckpt_lib.Checkpointer(tmp_path / "checkpoints").all_steps()


def test_nan_loss_stops_one_step_later_between_checks(tmp_path, monkeypatch):
  """NaN at step 7, next log at step 50, save at 30: the run stops while
  step 8 runs (its flag is read one step behind), not at the log step."""
  seen = []
  real = loop._check_finite
  monkeypatch.setattr(loop, "_check_finite", lambda progress, ck, step: (
      seen.append(progress.step), real(progress, ck, step))[1])
  config = _config(*RUN, "--config.log_every=50",
                   "--config.debug.nan_at_step=7")
  with pytest.raises(FloatingPointError,
                     match="NaN/Inf at step 7; stopping.*no checkpoint"):
    loop.train_and_evaluate(config, str(tmp_path))
  assert seen[-1] == 8
  assert not ckpt_lib.Checkpointer(tmp_path / "checkpoints").all_steps()


def test_a_checkpoint_beyond_num_train_steps_is_refused(tmp_path, reference):
  """A finished run of 60 steps resumed with num_train_steps=30: refused
  before anything is logged, since step 60's state would be evaluated and
  recorded as step 30's beside the run's own step-30 records."""
  source, _, _ = reference
  workdir = tmp_path / "run"
  shutil.copytree(source, workdir)
  before = metrics_lib.read_metrics(str(workdir), "eval")
  with pytest.raises(run_config.ConfigFlagError, match=(
      r"^config.num_train_steps=30 is below step 60, which .*checkpoints "
      r"resumes from: set it to at least 60 \(--mode=evaluate")):
    loop.train_and_evaluate(_config(*RUN, "--config.num_train_steps=30"),
                            str(workdir))
  assert metrics_lib.read_metrics(str(workdir), "eval") == before


def _main(workdir, cache_dir, *overrides, devices=8):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
             XLA_FLAGS=(os.environ["HYPERMIXER_TEST_XLA_FLAGS"] +
                        f" --xla_force_host_platform_device_count={devices}"),
             JAX_COMPILATION_CACHE_DIR=cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return subprocess.run(
      [sys.executable, "-m", "hypermixer_jax.main", f"--config={DEFAULT}",
       f"--workdir={workdir}", *TINY, *overrides],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_sigkill_and_resume_equals_uninterrupted_run(tmp_path, reference,
                                                     compilation_cache):
  """A process killed after step 35 (checkpoint at 30) and restarted in the
  same workdir ends with the losses of an uninterrupted run, bit for bit."""
  killed = _main(tmp_path / "a", compilation_cache, *RUN,
                 "--config.debug.kill_at_step=35")
  assert killed.returncode == -9, killed.stderr[-3000:]
  assert max(metrics_lib.read_metrics(str(tmp_path / "a"))) == 35
  # Restart in the same workdir (in-process: same 8-device layout).
  resumed = loop.train_and_evaluate(_config(*RUN), str(tmp_path / "a"))
  assert resumed.source == "workdir"
  a = metrics_lib.read_metrics(str(tmp_path / "a"))
  b = metrics_lib.read_metrics(str(reference[0]))
  assert sorted(a) == sorted(b) == list(range(5, 61, 5))
  for step in b:
    assert a[step]["loss"] == b[step]["loss"], step
    assert a[step]["grad_norm"] == b[step]["grad_norm"], step
  a_ev = metrics_lib.read_metrics(str(tmp_path / "a"), "eval")
  b_ev = metrics_lib.read_metrics(str(reference[0]), "eval")
  assert a_ev[60]["mse"] == b_ev[60]["mse"]


@pytest.mark.slow
def test_sigterm_saves_stops_and_resumes_like_an_uninterrupted_run(
    tmp_path, reference):
  """A run of one process (no jax.distributed, so Orbax sees no preemption)
  that gets SIGTERM after step 37 saves step 37 (between the periodic saves
  at 30 and 60), stops, and gives SIGTERM its handler back; resumed, it ends
  with the uninterrupted run's losses."""
  before = signal.getsignal(signal.SIGTERM)
  result = loop.train_and_evaluate(
      _config(*RUN, "--config.debug.sigterm_at_step=37"), str(tmp_path))
  assert result.preempted and result.step == 37
  assert signal.getsignal(signal.SIGTERM) is before
  assert list(ckpt_lib.Checkpointer(tmp_path / "checkpoints").all_steps()) == [
      30, 37]
  resumed = loop.train_and_evaluate(_config(*RUN), str(tmp_path))
  assert resumed.source == "workdir" and resumed.step == 60
  a = metrics_lib.read_metrics(str(tmp_path))
  b = metrics_lib.read_metrics(str(reference[0]))
  assert sorted(a) == sorted(b)
  for step in b:
    assert a[step]["loss"] == b[step]["loss"], step


def test_an_experiment_stops_on_a_preempted_run_and_resumes_it(tmp_path):
  # An experiment's cell must not record a run that SIGTERM cut short.
  from hypermixer_jax.experiment import runs  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit, match=r"preempted at step 7 \(its "
                     r"checkpoint is saved\); run the same command again"):
    runs.train(_config(*RUN, "--config.debug.sigterm_at_step=7"),
               str(tmp_path))
  out = runs.train(_config(*RUN), str(tmp_path))
  assert out["step"] == 60 and out["source"] == "workdir" and out["eval"]


def test_a_notice_after_the_last_step_records_the_run_then_stops(
    tmp_path, monkeypatch):
  # SIGTERM during the final evaluation or close: no step is left to stop
  # at, so the run ends whole (recorded), and the experiment starts no
  # other run (before, it went on to the next cell).
  from hypermixer_jax.experiment import runs  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(runs, "_NOTICE", [])
  close = ckpt_lib.Checkpointer.close

  def close_after_a_notice(self):
    if self._sigterm is not None and not self._sigterm.received:
      os.kill(os.getpid(), signal.SIGTERM)
    close(self)
  monkeypatch.setattr(ckpt_lib.Checkpointer, "close", close_after_a_notice)
  out = runs.train(_config(*RUN), str(tmp_path / "a"))
  assert out["step"] == 60 and out["eval"]
  monkeypatch.setattr(ckpt_lib.Checkpointer, "close", close)
  with pytest.raises(SystemExit, match=(
      f"notice \\(SIGTERM\\) came after the last step of {tmp_path}/a, "
      f"which is recorded; stopping before {tmp_path}/b")):
    runs.train(_config(*RUN), str(tmp_path / "b"))
  assert not (tmp_path / "b").exists()


def test_sigterm_notice_is_one_process_and_main_thread_only():
  before = signal.getsignal(signal.SIGTERM)
  notice = ckpt_lib.SigtermNotice()
  assert signal.getsignal(signal.SIGTERM) == notice._on_sigterm
  notice.close()
  assert signal.getsignal(signal.SIGTERM) is before
  # Off the main thread Python refuses handlers: nothing is installed.
  out = []
  thread = threading.Thread(target=lambda: out.append(ckpt_lib.SigtermNotice()))
  thread.start()
  thread.join()
  assert signal.getsignal(signal.SIGTERM) is before and not out[0].received


@pytest.mark.slow
def test_a_quiet_start_says_when_the_first_log_line_comes(reference):
  """No log line within QUIET_SECONDS of the first step: one warning naming
  the step of the first line."""
  quiet = [m for m in reference[2] if "no log line" in m]
  assert len(quiet) == 1, quiet
  assert re.fullmatch(
      r"step \d+/60, no log line in \d+ s: the first comes at step 5 "
      r"\(log_every=5\); pass a smaller --config.log_every to see progress "
      r"sooner\.", quiet[0]), quiet


@pytest.mark.slow
def test_a_run_stopped_within_an_accumulation_resumes_it_exactly(tmp_path):
  """grad_accum_steps=2, SIGTERM after micro-batch 7 (the accumulator holds
  one weighted gradient): the saved step carries it, and the resumed run
  ends with the uninterrupted run's parameters, bit for bit."""
  run = ["--config.num_train_steps=12", "--config.log_every=2",
         "--config.eval_every=12", "--config.checkpoint_every=4",
         "--config.grad_accum_steps=2", "--config.warmup_steps=1",
         "--config.model.dropout_rate=0.1"]
  whole = loop.train_and_evaluate(_config(*run), str(tmp_path / "whole"))
  stopped = loop.train_and_evaluate(
      _config(*run, "--config.debug.sigterm_at_step=7"), str(tmp_path / "cut"))
  assert stopped.preempted and stopped.step == 7
  assert int(jax.device_get(stopped.state.opt_state.mini_step)) == 1
  resumed = loop.train_and_evaluate(_config(*run), str(tmp_path / "cut"))
  assert resumed.source == "workdir" and resumed.step == 12
  for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state.params)),
                  jax.tree.leaves(jax.device_get(whole.state.params))):
    np.testing.assert_array_equal(a, b)


def test_a_relative_workdir_saves_resumes_and_evaluates(tmp_path, monkeypatch):
  """``--workdir=run`` (relative to the current folder): Orbax's array
  storage takes absolute paths only; the run saves, resumes from its own
  step and its checkpoint evaluates as the training run scored it."""
  from hypermixer_jax.train import artifacts
  monkeypatch.chdir(tmp_path)
  short = ("--config.log_every=2", "--config.eval_every=2",
           "--config.checkpoint_every=2")
  loop.train_and_evaluate(_config("--config.num_train_steps=2", *short), "run")
  loop.train_and_evaluate(_config("--config.num_train_steps=4", *short), "run")
  assert ckpt_lib.Checkpointer("run/checkpoints").all_steps() == [2, 4]
  trained = metrics_lib.read_metrics("run", "eval")[4]
  got = artifacts.evaluate_checkpoint(_config(), "run", eval_steps=None)
  np.testing.assert_allclose(got["loss"], trained["loss"], rtol=1e-6)
