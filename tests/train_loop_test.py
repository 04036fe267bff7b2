"""End-to-end tests of the training job (hypermixer_jax.train.loop / main)."""
import os
import subprocess
import sys

from absl import flags
import jax
import numpy as np
import pytest
from ml_collections import config_flags

from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import loop
from hypermixer_jax.train import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.py")

# A tiny version of the default job: seconds on two CPU cores.
TINY = [
    "--config.model.num_layers=1", "--config.model.d_model=16",
    "--config.model.d_ffn=32", "--config.model.max_len=40",
    "--config.data.synthetic.seq_len=40",
    "--config.data.synthetic.num_eval_examples=64",
    "--config.batch_size=16", "--config.eval_batch_size=32",
    "--config.warmup_steps=5", "--config.pseudo_attention=False",
]


def _config(*overrides):
  argv = ["prog", f"--config={DEFAULT}", *TINY, *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  fv(argv)
  return fv.config


def test_default_job_loss_falls(tmp_path):
  config = _config("--config.num_train_steps=60", "--config.log_every=5",
                   "--config.eval_every=30", "--config.checkpoint_every=30",
                   "--config.learning_rate=1e-2", "--config.pseudo_attention=True")
  results = loop.train_and_evaluate(config, str(tmp_path))
  train = metrics_lib.read_metrics(str(tmp_path))
  losses = [r["loss"] for r in train.values()]
  assert len(losses) == 12
  assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:2]), losses
  ev = metrics_lib.read_metrics(str(tmp_path), "eval")
  assert sorted(ev) == [30, 60]
  assert ev[60]["mse"] < ev[30]["mse"] * 1.05
  res = results["hypermixer"]
  assert res.source == "scratch" and res.step == 60
  assert res.eval_metrics["mse"] == pytest.approx(ev[60]["mse"])
  assert res.pseudo_attention.shape == (40, 40)
  assert os.path.getsize(tmp_path / "pseudo_attention.png") > 1000
  assert list(ckpt_lib.Checkpointer(tmp_path / "checkpoints").all_steps()) == [30, 60]
  assert any(f.startswith("events.") for f in os.listdir(tmp_path / "tensorboard"))


def test_unknown_config_field_fails():
  with pytest.raises(Exception, match="lerning_rate"):
    _config("--config.lerning_rate=0.1")


def test_mesh_that_does_not_fit(tmp_path):
  config = _config("--config.mesh.data=3")
  with pytest.raises(ValueError, match="mesh .*data=3.* devices"):
    loop.train_and_evaluate(config, str(tmp_path))


def test_nan_loss_stops_and_is_never_saved(tmp_path):
  config = _config("--config.num_train_steps=20", "--config.log_every=5",
                   "--config.checkpoint_every=2", "--config.debug.nan_at_step=5")
  with pytest.raises(FloatingPointError,
                     match="NaN/Inf between steps 5 and 5.*latest checkpoint is step 4"):
    loop.train_and_evaluate(config, str(tmp_path))
  assert max(ckpt_lib.Checkpointer(tmp_path / "checkpoints").all_steps()) == 4


def _main(workdir, *overrides, devices=8):
  env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.run(
      [sys.executable, "-m", "hypermixer_jax.main", f"--config={DEFAULT}",
       f"--workdir={workdir}", *TINY, *overrides],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_sigkill_and_resume_equals_uninterrupted_run(tmp_path):
  """A process killed after step 6 (checkpoint at 4) and restarted in the same
  workdir ends with the losses of an uninterrupted run, bit for bit."""
  run = ["--config.num_train_steps=12", "--config.log_every=1",
         "--config.eval_every=0", "--config.checkpoint_every=4",
         "--config.model.dropout_rate=0.1"]
  killed = _main(tmp_path / "a", *run, "--config.debug.kill_at_step=6")
  assert killed.returncode == -9, killed.stderr[-3000:]
  assert max(metrics_lib.read_metrics(str(tmp_path / "a"))) == 6
  # Restart in the same workdir (in-process: same 8-device layout).
  resumed = loop.train_and_evaluate(_config(*run), str(tmp_path / "a"))
  assert next(iter(resumed.values())).source == "workdir"
  loop.train_and_evaluate(_config(*run), str(tmp_path / "b"))
  a = metrics_lib.read_metrics(str(tmp_path / "a"))
  b = metrics_lib.read_metrics(str(tmp_path / "b"))
  assert sorted(a) == sorted(b) == list(range(1, 13))
  for step in b:
    assert a[step]["loss"] == b[step]["loss"], step
    assert a[step]["grad_norm"] == b[step]["grad_norm"], step
