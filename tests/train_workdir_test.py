"""Workdir lock, saved config, de-duplicated logs, config validation."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import ml_collections
import pytest
import tensorflow as tf
from tensorflow.core.util import event_pb2

from hypermixer_jax.train import config as config_lib
from hypermixer_jax.train import config_checks
from hypermixer_jax.train import metrics as metrics_lib
from hypermixer_jax.train import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = """
import sys, time
from hypermixer_jax.train import workdir
lock = workdir.WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_lock_refuses_second_job_and_survives_kill(tmp_path):
  holder = subprocess.Popen(
      [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE,
      env=dict(os.environ, PYTHONPATH=ROOT), text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(workdir_lib.WorkdirLocked) as e:
      workdir_lib.WorkdirLock(str(tmp_path)).acquire()
    msg = str(e.value)
    assert f"PID {holder.pid}" in msg and "host " in msg
    assert str(tmp_path) in msg and "another --workdir" in msg
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # A killed holder leaves nothing stuck.
  with workdir_lib.WorkdirLock(str(tmp_path)):
    with open(tmp_path / workdir_lib.LOCK_FILE) as f:
      assert json.load(f)["pid"] == os.getpid()
  with workdir_lib.WorkdirLock(str(tmp_path)):  # released on exit
    pass


def test_save_config_round_trips(tmp_path):
  config = config_lib.base_config()
  config.learning_rate = 3e-4
  path = workdir_lib.save_config(config, str(tmp_path), 40)
  assert path.endswith("-step40.json")
  for p in (path, tmp_path / "config.json"):
    with open(p) as f:
      saved = json.load(f)
    assert saved["learning_rate"] == 3e-4
    assert saved["data"]["task"] == config.data.task


def _events(workdir):
  out = []
  for path in sorted((workdir / "tensorboard").glob("events.out.tfevents.*")):
    for r in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
      e = event_pb2.Event.FromString(r)
      out += [(v.tag, e.step) for v in e.summary.value]
  return out


@pytest.mark.parametrize("redo_eval", [False, True])
def test_resume_drops_logs_after_the_checkpoint(tmp_path, redo_eval):
  w = metrics_lib.MetricWriter(str(tmp_path))
  for step in range(1, 11):
    w.write_scalars(step, {"loss": 1.0 / step})
    if step % 5 == 0:
      w.write_scalars(step, {"loss": 2.0}, split="eval")
      w.write_scalars(step, {"spread": 0.3}, split="pseudo_attention")
  w.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"split": "train", "st')   # cut short by a kill
  resume = 5
  dropped = workdir_lib.truncate_logs(str(tmp_path), resume,
                                      redo_eval_at_resume_step=redo_eval)
  # The resumed run logs steps 6..10 again (and every evaluator's step 5
  # when redone, the extras' included).
  w = metrics_lib.MetricWriter(str(tmp_path))
  if redo_eval:
    w.write_scalars(5, {"loss": 2.5}, split="eval")
    w.write_scalars(5, {"spread": 0.4}, split="pseudo_attention")
  for step in range(6, 11):
    w.write_scalars(step, {"loss": 0.5 / step})
  w.write_scalars(10, {"loss": 2.0}, split="eval")
  w.write_scalars(10, {"spread": 0.3}, split="pseudo_attention")
  w.close()
  with open(tmp_path / "metrics.jsonl") as f:
    recs = [json.loads(line) for line in f]
  keys = [(r["split"], r["step"]) for r in recs]
  assert len(keys) == len(set(keys)) == 14
  # jsonl and TensorBoard each: train 6..10, both evaluators' step 10 (and
  # step 5 when redone); the cut line.
  assert dropped == 2 * (5 + 2 + 2 * redo_eval) + 1
  events = _events(tmp_path)
  assert len(events) == len(set(events)) == 14
  assert sorted(s for t, s in events if t == "train/loss") == list(
      range(1, 11))
  new = {r["step"]: r["loss"] for r in recs if r["split"] == "train"}
  assert new[7] == 0.5 / 7 and new[3] == 1.0 / 3


def _base(**overrides):
  c = config_lib.base_config()
  for k, v in overrides.items():
    node = c
    *path, leaf = k.split(".")
    for p in path:
      node = node[p]
    node[leaf] = v
  return c


@pytest.mark.parametrize("field,value,message", [
    ("num_train_steps", -5, "num_train_steps=-5: must be a positive integer"),
    ("num_train_steps", 0, "num_train_steps=0: must be a positive integer"),
    ("log_every", 0, "log_every=0: must be a positive integer"),
    ("eval_batch_size", 0, "eval_batch_size=0: must be a positive integer"),
    ("learning_rate", math.nan, "learning_rate=nan: must be a finite number"),
    ("learning_rate", -1e-3, "learning_rate=-0.001: must be a finite"),
    ("b2", 1.0, "b2=1.0: must be in [0, 1)"),
    ("model.dropout_rate", 1.5, "model.dropout_rate=1.5: must be in [0, 1)"),
    ("data.mlm.select_rate", 0.0, "data.mlm.select_rate=0.0: must be in"),
    ("eval_steps", 0, "eval_steps=0: must be a positive integer, or -1"),
    ("mesh.fsdp", 0, "mesh.fsdp=0: must be a positive integer, or -1"),
    ("clip_norm", math.inf, "clip_norm=inf: must be a finite number"),
    ("decay", "cosin", "decay='cosin': must be one of"),
])
def test_invalid_fields_are_named(field, value, message):
  with pytest.raises(config_checks.ConfigError) as e:
    config_checks.validate(_base(**{field: value}))
  assert message in str(e.value)


def test_accumulated_steps_must_fill_their_last_update():
  found = config_checks.problems(_base(num_train_steps=10, grad_accum_steps=4))
  assert found == [
      "num_train_steps=10: must be a multiple of grad_accum_steps=4 (it "
      "counts micro-batches; the last 2 would never be applied), e.g. 8"]
  assert not config_checks.problems(_base(num_train_steps=12,
                                          grad_accum_steps=4))


def test_every_problem_is_listed_and_shipped_configs_pass():
  found = config_checks.problems(_base(log_every=0, eval_batch_size=0,
                                       weight_decay=math.nan))
  assert len(found) == 3, found
  config_checks.validate(config_lib.base_config())
  nested = ml_collections.ConfigDict({"model": {"mixer_kwargs": {
      "capacity_factor": math.nan}}})
  assert config_checks.problems(nested) == [
      "model.mixer_kwargs.capacity_factor=nan: must be a finite number"]
