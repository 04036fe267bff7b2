"""The command line refuses bad data, configs, checkpoints and busy workdirs
with the message and a failing exit status, and keeps logs free of repeats.

Each case runs ``python -m hypermixer_jax.main`` on a tiny model in a
temporary workdir.
"""
import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf
from tensorflow.core.util import event_pb2

from hypermixer_jax.data import testing
from hypermixer_jax.train import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
TINY_TEXT = ["--config.model.num_layers=1", "--config.model.d_model=16",
             "--config.model.d_ffn=32", "--config.model.max_len=16",
             "--config.model.mixer_kwargs.hyper_dim=8",
             "--config.data.seq_len=16", "--config.batch_size=2",
             "--config.eval_batch_size=2", "--config.eval_steps=1",
             "--config.num_train_steps=2", "--config.log_every=1",
             "--config.warmup_steps=0"]
TINY_SYNTH = ["--config.model.num_layers=1", "--config.model.d_model=16",
              "--config.model.d_ffn=32", "--config.model.max_len=40",
              "--config.model.mixer_kwargs.hyper_dim=8",
              "--config.data.synthetic.seq_len=40",
              "--config.data.synthetic.num_eval_examples=8",
              "--config.batch_size=4", "--config.eval_batch_size=8",
              "--config.eval_steps=1", "--config.warmup_steps=0",
              "--config.log_every=1", "--config.eval_every=3",
              "--config.checkpoint_every=3",
              "--config.evals.pseudo_attention.every=-1"]


def _main(workdir, config, *flags, timeout=400):
  cmd = [sys.executable, "-m", "hypermixer_jax.main", f"--config={config}",
         f"--workdir={workdir}", *flags]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             TF_CPP_MIN_LOG_LEVEL="2", XLA_FLAGS=os.environ["HYPERMIXER_TEST_XLA_FLAGS"])  # one device
  return subprocess.run(cmd, capture_output=True, text=True, env=env,
                        timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
  return testing.tiny_vocab(str(tmp_path_factory.mktemp("vocab")))


def test_bad_label_stops_the_command(vocab, tmp_path):
  train = tmp_path / "train.tsv"
  train.write_text("sentence\tlabel\ngood .\tpositive\nbad .\tnegative\n"
                   "typo .\tpositive_typo\n" + "more .\t1\n" * 8)
  out = _main(tmp_path / "w", f"{CONFIGS}/glue.py:sst2,hypermixer",
              f"--config.data.vocab_path={vocab}",
              f"--config.data.local_files.train={train}",
              f"--config.data.local_files.validation={train}", *TINY_TEXT)
  assert out.returncode == 1, out.stderr[-3000:]
  assert (f"Stopped: {train}:4: label 'positive_typo' is not one of the "
          "labels (negative, positive)") in out.stderr
  assert "Traceback" not in out.stderr


# Bad values of four fields: one launch, since the command lists every
# problem of the config at once (train.config_checks).
BAD_FLAGS = {
    "--config.num_train_steps=-5": "num_train_steps=-5: must be a positive",
    "--config.log_every=0": "log_every=0: must be a positive integer",
    "--config.eval_batch_size=0": "eval_batch_size=0: must be a positive",
    "--config.learning_rate=nan": "learning_rate=nan: must be a finite",
}


def test_invalid_config_stops_before_compiling(tmp_path):
  out = _main(tmp_path / "w", f"{CONFIGS}/default.py", *TINY_SYNTH,
              *BAD_FLAGS)
  assert out.returncode == 1, out.stderr[-3000:]
  for message in BAD_FLAGS.values():
    assert message in out.stderr, (message, out.stderr[-3000:])
  assert "Traceback" not in out.stderr
  assert not os.path.exists(tmp_path / "w" / "checkpoints")  # nothing built


def test_busy_workdir_is_refused_with_holder(tmp_path):
  lock = workdir_lib.WorkdirLock(str(tmp_path)).acquire()
  try:
    out = _main(tmp_path, f"{CONFIGS}/default.py", *TINY_SYNTH)
    # Without --config (the job has no checkpoint yet): the holder too,
    # not "--config is required".
    alone = subprocess.run(
        [sys.executable, "-m", "hypermixer_jax.main", f"--workdir={tmp_path}"],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  finally:
    lock.release()
  for o in (out, alone):
    assert o.returncode == 1, o.stderr[-3000:]
    assert f"is in use by another job (host " in o.stderr
    assert f"PID {os.getpid()}" in o.stderr


def test_missing_init_checkpoint_one_clean_error(tmp_path):
  out = _main(tmp_path / "w", f"{CONFIGS}/default.py", *TINY_SYNTH,
              f"--config.init_checkpoint={tmp_path}/nowhere")
  assert out.returncode == 1
  assert out.stderr.splitlines()[-1] == (
      f"Stopped: init_checkpoint {tmp_path}/nowhere: no such folder; pass a "
      "trained run's workdir, an exported folder or a converted checkpoint.")
  assert "cannot schedule new futures" not in out.stderr
  assert "Traceback" not in out.stderr


def _event_steps(workdir):
  out = []
  for root, _, files in os.walk(os.path.join(workdir, "tensorboard")):
    for name in files:
      for r in tf.data.TFRecordDataset(os.path.join(root, name)):
        e = event_pb2.Event.FromString(r.numpy())
        out += [(v.tag, e.step) for v in e.summary.value]
  return out


@pytest.mark.slow
def test_kill_and_resume_logs_each_step_once(tmp_path):
  work = tmp_path / "w"
  first = _main(work, f"{CONFIGS}/default.py", *TINY_SYNTH,
                "--config.num_train_steps=8", "--config.debug.kill_at_step=5")
  assert first.returncode != 0   # SIGKILLed after step 5 (checkpoint at 3)
  with open(work / "metrics.jsonl") as f:
    assert max(json.loads(l)["step"] for l in f) == 5
  second = _main(work, f"{CONFIGS}/default.py", *TINY_SYNTH,
                 "--config.num_train_steps=8")
  assert second.returncode == 0, second.stderr[-3000:]
  with open(work / "metrics.jsonl") as f:
    keys = [(r["split"], r["step"]) for r in map(json.loads, f)]
  assert sorted(keys) == sorted(set(keys))
  assert [s for split, s in keys if split == "train"] == list(range(1, 9))
  events = _event_steps(work)
  assert len(events) == len(set(events))
  assert sorted(s for t, s in events if t == "train/loss") == list(range(1, 9))
  # The resolved config of each run is kept.
  runs = sorted(os.listdir(work / "configs"))
  assert [r.split("-step")[1] for r in runs] == ["0.json", "3.json"]
  with open(work / "config.json") as f:
    assert json.load(f)["num_train_steps"] == 8
