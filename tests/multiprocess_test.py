"""Two JAX processes on localhost train like one: the multi-host path of main.py.

Each process is a ``python -m hypermixer_jax.main`` with its own 2 fake CPU
devices, joined by ``jax.distributed.initialize`` through a coordinator on
127.0.0.1 (loopback only). They read their own shard of the input (per-host
pipelines), assemble global batches on a 4-device mesh, save a checkpoint
together, are restarted and restore it, train on and evaluate. The losses
and the evaluation must equal those of one process with 4 devices.

Dropout is off: its mask is drawn over the global batch, whose rows are
ordered differently (host 0's examples, then host 1's) than one process's,
while the loss, a mean over the same examples, does not depend on the order.
"""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.py")
TIMEOUT = 300  # seconds per launch, all processes together

# Constant learning rate: the restarted launch trains steps 7-12 again, and
# its losses must equal the uninterrupted run's.
TINY = [
    "--config.model.num_layers=1", "--config.model.d_model=16",
    "--config.model.d_ffn=32", "--config.model.max_len=40",
    "--config.model.mixer_kwargs.hyper_dim=8",
    "--config.model.dropout_rate=0.0", "--config.data.synthetic.seq_len=40",
    # 17 = 16 + 1: the last batch fills neither the 4 devices of one
    # process (padded to 4) nor the two processes' equal shares: their
    # shards hold 9 and 8 examples, so process 1 has run out when process 0
    # reads its second batch, and steps one of rows of weight 0 beside it.
    # The metrics count each example once either way.
    "--config.data.synthetic.num_eval_examples=17",
    "--config.batch_size=8", "--config.eval_batch_size=16",
    "--config.eval_steps=-1", "--config.warmup_steps=0",
    "--config.decay=constant", "--config.learning_rate=3e-3",
    "--config.log_every=1", "--config.eval_every=6",
    "--config.checkpoint_every=6", "--config.evals.pseudo_attention.every=-1",
    "--config.async_checkpoints=True",
]


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int, cache_dir: str) -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
              PYTHONPATH=ROOT,
              XLA_FLAGS=(os.environ["HYPERMIXER_TEST_XLA_FLAGS"] +
                        f" --xla_force_host_platform_device_count={devices}"),
              JAX_COMPILATION_CACHE_DIR=cache_dir,
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def _launch(workdir, steps: int, *, processes: int, devices: int,
            cache_dir: str) -> list[str]:
  """Runs ``processes`` main.py processes to completion; returns their logs.

  Every process is in its own session and is killed (with its children) if
  the launch fails or runs past TIMEOUT, so no stray process outlives it.
  """
  cmd = [sys.executable, "-m", "hypermixer_jax.main", f"--config={DEFAULT}",
         f"--workdir={workdir}", *TINY, f"--config.num_train_steps={steps}"]
  if processes > 1:
    port = _free_port()
    cmds = [cmd + [f"--coordinator_address=127.0.0.1:{port}",
                   f"--num_processes={processes}", f"--process_id={i}"]
            for i in range(processes)]
  else:
    cmds = [cmd]
  logs = [str(workdir) + f".log{i}" for i in range(processes)]
  procs = []
  with contextlib.ExitStack() as stack:
    try:
      for c, log in zip(cmds, logs):
        f = stack.enter_context(open(log, "w", encoding="utf-8"))
        procs.append(subprocess.Popen(
            c, cwd=ROOT, env=_env(devices, cache_dir), stdout=f,
            stderr=subprocess.STDOUT, start_new_session=True))
      for p in procs:
        p.wait(timeout=TIMEOUT)
    finally:
      for p in procs:
        if p.poll() is None:
          os.killpg(p.pid, signal.SIGKILL)
          p.wait()
  texts = [open(log, encoding="utf-8").read() for log in logs]
  for p, text in zip(procs, texts):
    assert p.returncode == 0, text[-4000:]
  return texts


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path, cache_dir):
  one, two = tmp_path / "one", tmp_path / "two"
  _launch(one, 12, processes=1, devices=4, cache_dir=cache_dir)
  logs = _launch(two, 12, processes=2, devices=2, cache_dir=cache_dir)
  assert "JAX process 1/2 (distributed: explicit)" in logs[1]
  assert "4 devices (2 processes)" in logs[0]
  # Both processes wrote the step-6 and step-12 checkpoints.
  assert ckpt_lib.Checkpointer(two / "checkpoints").all_steps() == [6, 12]
  # Each process wrote its own input position (nothing gathered), and they
  # differ: each host reads its own shard.
  data = two / "checkpoints" / "6" / "data"
  positions = [(data / f"process_{i}-of-2.json").read_text() for i in (0, 1)]
  assert positions[0] != positions[1]

  ref = metrics_lib.read_metrics(str(one))
  got = metrics_lib.read_metrics(str(two))
  assert sorted(got) == sorted(ref) == list(range(1, 13))
  np.testing.assert_allclose([got[s]["loss"] for s in got],
                             [ref[s]["loss"] for s in ref], rtol=1e-5)
  ref_eval = metrics_lib.read_metrics(str(one), "eval")
  got_eval = metrics_lib.read_metrics(str(two), "eval")
  assert sorted(got_eval) == sorted(ref_eval) == [6, 12]
  for s in (6, 12):
    np.testing.assert_allclose(got_eval[s]["mse"], ref_eval[s]["mse"],
                               rtol=1e-5)
  # The run learnt something, so equal losses are not equal constants.
  assert got[12]["loss"] < got[1]["loss"]

  # A restart restores step 6 in both processes and trains on to the same
  # losses: process 1's part of step 12 is damaged, so both processes
  # resume from step 6 (neither from 12 while the other falls back), step
  # 12 is set aside, and steps 7-12 train again.
  (two / "checkpoints" / "12" / "data" / "process_1-of-2.json").write_text(
      "{not json")
  logs = _launch(two, 12, processes=2, devices=2, cache_dir=cache_dir)
  for log in logs:
    assert "resuming from own checkpoint" in log and " step 6 " in log, (
        log[-3000:])
  assert ckpt_lib.Checkpointer(two / "checkpoints").all_steps() == [6, 12]
  assert len(list((two / "checkpoints_damaged").iterdir())) == 1
  again = metrics_lib.read_metrics(str(two))
  np.testing.assert_allclose([again[s]["loss"] for s in range(1, 13)],
                             [ref[s]["loss"] for s in range(1, 13)],
                             rtol=1e-5)


# One process of a job that reads another run's checkpoint (fine-tuning,
# evaluation, export): steps 1 and 2 saved together, then process 1 fails to
# read step 2 (a transient read error, or retention removing it under one
# host only), and both load.
_READER = r"""
import json, sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from hypermixer_jax import runtime
from hypermixer_jax.train import checkpoint as ck
pid = int(sys.argv[1])
runtime.initialize_distributed("on", coordinator_address=sys.argv[2],
                               num_processes=2, process_id=pid)
mesh = jax.make_mesh((2,), ("d",))
def arrays(v):
  host = {"w": np.full((4,), v, np.float32),
          "k": np.arange(8, dtype=np.float32).reshape(4, 2) + v}
  specs = {"w": P(), "k": P("d")}
  return {n: jax.make_array_from_callback(
      x.shape, NamedSharding(mesh, specs[n]), lambda i, x=x: x[i])
          for n, x in host.items()}
with ck.Checkpointer(sys.argv[3], save_every=1, async_save=False) as c:
  for step in (1, 2):
    c.save(step, {"params": arrays(10.0 * step)})
from orbax.checkpoint._src.handlers import json_checkpoint_handler as jh
read = jh.JsonCheckpointHandler.restore
def flaky(self, directory, *args, **kwargs):
  # Inside Orbax's restore: the fingerprints of step 2, on process 1 only.
  if pid == 1 and str(directory).rstrip("/").endswith("/2/" + ck.FINGERPRINTS):
    raise OSError("transient read error on this host")
  return read(self, directory, *args, **kwargs)
jh.JsonCheckpointHandler.restore = flaky
params, step = ck.load_pretrained_step(sys.argv[3], arrays(0.0), reinit=())
w = np.asarray(params["w"].addressable_data(0))   # (replicated)
print("RESULT " + json.dumps({"step": step, "w": float(w[0])}), flush=True)
"""


def test_processes_load_the_same_step_of_another_run(tmp_path, cache_dir):
  script = tmp_path / "reader.py"
  script.write_text(_READER)
  port = _free_port()
  procs, logs = [], []
  try:
    for i in range(2):
      logs.append(open(tmp_path / f"log{i}", "w+", encoding="utf-8"))
      procs.append(subprocess.Popen(
          [sys.executable, str(script), str(i), f"127.0.0.1:{port}",
           str(tmp_path / "checkpoints")], cwd=ROOT,
          env=_env(1, cache_dir), stdout=logs[i], stderr=subprocess.STDOUT,
          start_new_session=True))
    for p in procs:
      p.wait(timeout=TIMEOUT / 2)   # (processes that disagree would hang)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  texts = [(tmp_path / f"log{i}").read_text() for i in range(2)]
  results = []
  for p, text in zip(procs, texts):
    assert p.returncode == 0, text[-3000:]
    [line] = [x for x in text.splitlines() if x.startswith("RESULT ")]
    results.append(json.loads(line[len("RESULT "):]))
  # Neither process loads step 2 while the other falls back to step 1.
  assert results == [{"step": 1, "w": 10.0}] * 2
  assert "another process could not read its part" in texts[0]
