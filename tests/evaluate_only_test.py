"""``--mode=evaluate``: a workdir's checkpoint evaluated without training
gives the metrics the run logged at that step."""
import json
import os
import subprocess
import sys

from absl import flags
from ml_collections import config_flags
import numpy as np
import pytest

from hypermixer_jax.train import artifacts
from hypermixer_jax.train import loop
from hypermixer_jax.train import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.py")
TINY = ["--config.model.num_layers=1", "--config.model.d_model=16",
        "--config.model.d_ffn=32", "--config.model.max_len=40",
        "--config.model.mixer_kwargs.hyper_dim=8",
        "--config.data.synthetic.seq_len=40",
        "--config.data.synthetic.num_eval_examples=48",
        "--config.batch_size=8", "--config.eval_batch_size=16",
        "--config.eval_steps=-1", "--config.warmup_steps=2",
        "--config.num_train_steps=8", "--config.eval_every=4",
        "--config.checkpoint_every=4", "--config.keep_checkpoints=3",
        "--config.log_every=4", "--config.evals.pseudo_attention.every=-1"]


def _config():
  argv = ["prog", f"--config={DEFAULT}", *TINY]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  fv(argv)
  return fv.config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("run")
  loop.train_and_evaluate(_config(), str(workdir))
  return workdir


@pytest.mark.slow
def test_latest_and_given_step_equal_the_logged_evaluations(run, tmp_path):
  logged = metrics_lib.read_metrics(str(run), "eval")
  assert sorted(logged) == [4, 8]
  latest = artifacts.evaluate_checkpoint(_config(), str(run))
  np.testing.assert_allclose(latest["mse"], logged[8]["mse"], rtol=1e-6)
  mid = artifacts.evaluate_checkpoint(_config(), str(run), step=4)
  np.testing.assert_allclose(mid["mse"], logged[4]["mse"], rtol=1e-6)
  assert mid["mse"] != latest["mse"]
  saved = json.load(open(run / "evaluations" / "validation_step4.json"))
  assert saved["step"] == 4 and saved["mse"] == mid["mse"]
  # Exported parameters evaluate the same.
  artifacts.export_params(_config(), str(run), str(tmp_path / "p"), step=4)
  again = artifacts.evaluate_checkpoint(_config(), str(tmp_path / "p"))
  np.testing.assert_allclose(again["mse"], logged[4]["mse"], rtol=1e-6)


@pytest.mark.slow
def test_main_modes_from_the_command_line(run, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  base = [sys.executable, "-m", "hypermixer_jax.main", f"--config={DEFAULT}",
          *TINY]
  out = subprocess.run(base + [f"--workdir={run}", "--mode=evaluate",
                               "--step=8"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  mse = metrics_lib.read_metrics(str(run), "eval")[8]["mse"]
  assert f"step 8 on validation: " in out.stdout
  assert f"mse={mse:.5g}" in out.stdout
  bad = subprocess.run(base + [f"--workdir={run}", "--mode=export"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
  assert bad.returncode != 0 and "--mode=export needs --output" in bad.stderr
