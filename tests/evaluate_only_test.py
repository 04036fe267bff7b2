"""``--mode=evaluate``: a workdir's checkpoint evaluated without training
gives the metrics the run logged at that step."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hypermixer_jax.train import artifacts
from hypermixer_jax.train import config_checks
from hypermixer_jax.train import loop
from hypermixer_jax.train import metrics as metrics_lib

import flag_configs

ROOT = flag_configs.ROOT
DEFAULT = flag_configs.DEFAULT
TINY = flag_configs.TINY


def _config():
  return flag_configs.load(DEFAULT, *TINY)


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
  assert saved["examples"] == saved["split_examples"] == 48
  # Fewer batches: the examples scored out of the split's size.
  first = artifacts.evaluate_checkpoint(_config(), str(run), step=4,
                                        eval_steps=2)
  saved = json.load(open(run / "evaluations" / "validation_step4.json"))
  assert (saved["examples"], saved["split_examples"]) == (32, 48)
  assert first["mse"] != mid["mse"]
  # Exported parameters evaluate the same.
  artifacts.export_params(_config(), str(run), str(tmp_path / "p"), step=4)
  again = artifacts.evaluate_checkpoint(_config(), str(tmp_path / "p"))
  np.testing.assert_allclose(again["mse"], logged[4]["mse"], rtol=1e-6)
  # Another run's step (a copy of the run is another run) beside it would
  # be read in its place: refused; --overwrite replaces the folder's steps.
  other = tmp_path / "other_run"
  shutil.copytree(run, other)
  with pytest.raises(config_checks.ConfigError, match=(
      rf"holds step\(s\) \[4\] exported from another run \({run}\); this "
      r"run's step beside them would not be the one evaluate, predict or "
      r"fine-tuning read: export into another folder, or pass --overwrite")):
    artifacts.export_params(_config(), str(other), str(tmp_path / "p"))
  artifacts.export_params(_config(), str(run), str(tmp_path / "p"))  # its own
  artifacts.export_params(_config(), str(other), str(tmp_path / "p"),
                          step=8, overwrite=True)
  assert [n for n in os.listdir(tmp_path / "p") if n.isdigit()] == ["8"]
  assert json.load(open(tmp_path / "p" / artifacts.SOURCES)) == {
      "8": str(other)}


NOISE = ("oneDNN", "cuda drivers", "cuInit", "Length validation is skipped",
         "Traceback", "read_only=True", "read only")


@pytest.mark.slow
def test_main_modes_from_the_command_line(run, tmp_path):
  """evaluate, export and evaluate-the-export from the run's own config (no
  --config), and one-line errors."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=(os.environ["HYPERMIXER_TEST_XLA_FLAGS"] +
                        " --xla_force_host_platform_device_count=8"))

  def main(*args):
    out = subprocess.run([sys.executable, "-m", "hypermixer_jax.main", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    for noise in NOISE:
      assert noise not in out.stderr, out.stderr[-3000:]
    return out

  out = main(f"--workdir={run}", "--mode=evaluate", "--step=8")
  assert out.returncode == 0, out.stderr[-3000:]
  logged = metrics_lib.read_metrics(str(run), "eval")
  assert "step 8 on validation (48 of 48 examples): " in out.stdout
  assert f"mse={logged[8]['mse']:.5g}" in out.stdout
  # --config.eval_steps counts as --eval_steps does; the two must agree.
  out = main(f"--workdir={run}", "--mode=evaluate", "--step=8",
             "--config.eval_steps=2")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "step 8 on validation (32 of 48 examples): " in out.stdout
  out = main(f"--workdir={run}", "--mode=evaluate", "--eval_steps=1",
             "--config.eval_steps=2")
  assert out.returncode == 1
  assert out.stderr.splitlines()[-1] == (
      "Stopped: --eval_steps=1 and --config.eval_steps=2 disagree: pass one "
      "of them.")
  # The export carries the config: evaluating it needs nothing else.
  out = main(f"--workdir={run}", "--mode=export", "--step=4",
             f"--output={tmp_path / 'p'}")
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.load(open(tmp_path / "p" / "config.json")) == json.load(
      open(run / "config.json"))
  out = main(f"--workdir={tmp_path / 'p'}", "--mode=evaluate")
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"mse={logged[4]['mse']:.5g}" in out.stdout
  # Training into the export would write a run over it: one line.
  out = main(f"--workdir={tmp_path / 'p'}", "--config=configs/default.py",
             "--config.num_train_steps=2")
  assert out.returncode == 1
  assert out.stderr.splitlines()[-1] == (
      f"Stopped: --workdir={tmp_path / 'p'} is an exported folder (step(s) "
      f"[4]), not a run to resume: fine-tune from it with "
      f"--config.init_checkpoint={tmp_path / 'p'} and another --workdir "
      "(evaluate or predict it with --workdir as it is).")
  # An override that changes the parameters' shapes: one line, once.
  out = main(f"--workdir={run}", "--mode=evaluate",
             "--config.model.d_model=24")
  assert out.returncode == 1
  assert out.stderr.count("would change") == 1
  assert out.stderr.splitlines()[-1] == (
      f"Stopped: --config.model.d_model would change the shapes, dtypes or "
      f"vocabulary of the parameters, or the optimizer state's layout or "
      f"accumulation, saved with {run} (see its config.json); drop the "
      "override(s), or train a new run in another --workdir.")
  # An empty workdir is named (see also the test below, with --config).
  (tmp_path / "empty").mkdir()
  out = main(f"--workdir={tmp_path / 'empty'}", "--mode=evaluate")
  assert (f"--mode=evaluate: {tmp_path / 'empty'} holds no checkpoint and no "
          "saved config.json") in out.stderr and out.returncode == 1
  # An export that lost its config.json is named as one.
  (tmp_path / "p" / "config.json").unlink()
  out = main(f"--workdir={tmp_path / 'p'}", "--mode=evaluate")
  assert (f"--mode=evaluate: {tmp_path / 'p'} holds exported steps but no "
          "config.json; pass --config=FILE[:arg] of the run it was exported "
          "from") in out.stderr and out.returncode == 1
  out = main(f"--workdir={run}", "--mode=export")
  assert out.returncode != 0
  assert out.stderr.splitlines()[-1] == "Stopped: --mode=export needs --output."
  assert "USAGE" not in out.stderr                    # no help text above


def test_empty_workdir_is_named_as_having_no_checkpoint(tmp_path):
  from hypermixer_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  for folder, why in ((tmp_path, "no step folder"),
                      (tmp_path / "nowhere", "no such folder")):
    with pytest.raises(ckpt_lib.CheckpointError) as e:
      artifacts.load_params(_config(), str(folder))
    assert str(e.value) == (
        f"no checkpoint in {folder} ({why}): give the --workdir of a trained "
        "run (it has checkpoints/) or an exported folder.")


def test_config_mistakes_stop_in_one_line_before_jax_starts(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  cases = {
      "--config.num_train_step=3": (
          "Stopped: --config.num_train_step: the config has no field "
          "'num_train_step'; did you mean --config.num_train_steps?"),
      "--config=configs/defualt.py": (
          "Stopped: --config=configs/defualt.py: no config file "
          "'configs/defualt.py'. Did you mean configs/default.py? The "
          "configs in configs: c4_lm.py, c4_mlm.py, cifar10.py, default.py, "
          "glue.py, imagenet.py, smlp_lm.py."),
  }
  for arg, line in cases.items():
    args = ([arg] if arg.startswith("--config=") else
            ["--config=configs/default.py", arg])
    out = subprocess.run([sys.executable, "-m", "hypermixer_jax.main",
                          f"--workdir={tmp_path}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip() == line     # the whole of stderr: no noise


def test_repeated_library_lines_are_dropped_from_the_log():
  import logging as std_logging  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import main as main_lib  # pylint: disable=g-import-not-at-top

  def record(path, level, msg):
    return std_logging.LogRecord("absl", level, path, 1, msg, (), None)

  quiet = main_lib._QuietLibraries()
  seqio = os.path.join("site-packages", "seqio", "feature_converters.py")
  assert not quiet.filter(record(seqio, std_logging.INFO, "Length validation "
                                 "is skipped since `apply_length_check=False`"))
  assert quiet.filter(record(seqio, std_logging.INFO, "Other seqio news"))
  assert quiet.filter(record(seqio, std_logging.WARNING,
                             "Length validation is skipped"))
  orbax = os.path.join("site-packages", "orbax", "checkpoint", "x.py")
  assert not quiet.filter(record(orbax, std_logging.INFO, "saved"))
  assert quiet.filter(record(orbax, std_logging.ERROR, "failed"))


def test_a_path_flag_with_an_unexpanded_home_is_refused():
  """``--workdir=~/run``: the shell expands no '~' after '=', and the run
  would write into a folder named '~' under the current one."""
  from hypermixer_jax import main as main_lib  # pylint: disable=g-import-not-at-top
  assert main_lib.unexpanded_home({"workdir": "~/run", "output": None}) == (
      "--workdir=~/run: the shell does not expand '~' after '=', so it would "
      "name a folder '~' in this one; write --workdir=$HOME/run or an "
      "absolute path.")
  assert main_lib.unexpanded_home({"workdir": "/tmp/~x", "input": "a~b",
                                   "output": "~user_file"}) is None
