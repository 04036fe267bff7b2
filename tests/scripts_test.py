"""Launch scripts: the exact commands they print and run, a ``gcloud`` that
records its calls, the remote shell logic run locally, and JAX's own SLURM
detection on the environment the sbatch script gives each task."""
import json
import os
import pathlib
import shlex
import stat
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = os.path.join(ROOT, "scripts", "tpu_pod.py")
SLURM = os.path.join(ROOT, "scripts", "slurm_gpu.sbatch")
COMMON = ["--name=hm-pod", "--zone=us-central2-b", "--project=proj",
          "--dry-run"]
WHERE = ["--zone=us-central2-b", "--project=proj"]


def _tpu(*args, ok=True, env=None):
  out = subprocess.run([sys.executable, TPU, *args], capture_output=True,
                       text=True, timeout=60, env=env)
  assert (out.returncode == 0) == ok, out.stderr
  return out if not ok else [shlex.split(l) for l in out.stdout.splitlines()]


@pytest.mark.parametrize("kind, version", [
    ("v4-32", "tpu-ubuntu2204-base"),
    ("v5litepod-256", "v2-alpha-tpuv5-lite"),
    ("v5p-128", "v2-alpha-tpuv5"),
    ("v6e-256", "v2-alpha-tpuv6e")])
def test_tpu_create_uses_the_generations_runtime(kind, version):
  assert _tpu("create", *COMMON, f"--accelerator-type={kind}", "--spot") == [[
      "gcloud", "compute", "tpus", "tpu-vm", "create", "hm-pod", *WHERE,
      f"--accelerator-type={kind}", f"--version={version}", "--spot"]]
  assert _tpu("create", *COMMON, f"--accelerator-type={kind}",
              "--runtime-version=custom")[0][-1] == "--version=custom"


def test_tpu_two_slices_through_a_queued_resource():
  two = [*COMMON, "--accelerator-type=v5litepod-256", "--num-slices=2"]
  assert _tpu("create", *two) == [[
      "gcloud", "compute", "tpus", "queued-resources", "create", "hm-pod",
      *WHERE, "--accelerator-type=v5litepod-256",
      "--runtime-version=v2-alpha-tpuv5-lite", "--node-count=2",
      "--node-prefix=hm-pod"]]
  [train] = _tpu("train", *two, "--config=configs/c4_mlm.py:hypermixer",
                 "--workdir=gs://b/mlm")
  assert train[:10] == ["gcloud", "compute", "tpus", "queued-resources",
                        "ssh", "hm-pod", *WHERE, "--node=all", "--worker=all"]
  [status, ssh] = _tpu("status", *two)
  assert status == ["gcloud", "compute", "tpus", "queued-resources",
                    "describe", "hm-pod", *WHERE, "--format=value(state.state)"]
  assert ssh[4:10] == ["ssh", "hm-pod", *WHERE, "--node=all", "--worker=all"]
  assert _tpu("delete", *two) == [[
      "gcloud", "compute", "tpus", "queued-resources", "delete", "hm-pod",
      *WHERE, "--force", "--quiet"]]
  logs = _tpu("logs", *two, "--logs-dir=/tmp/l")
  assert [c[5] for c in logs[1:]] == [f"hm-pod-{s}:~/hypermixer.log"
                                      for s in range(2) for _ in range(64)]
  assert logs[-1][6] == "/tmp/l/hm-pod/hm-pod-1-worker-63.log"


def test_tpu_install_makes_a_python_311_venv_on_every_worker():
  [cmd] = _tpu("install", *COMMON, "--repo=https://example.org/hm.git",
               "--ref=v1.0")
  assert cmd[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "hm-pod",
                     *WHERE, "--worker=all"]
  assert cmd[9].removeprefix("--command=") == "; ".join([
      "set -e",
      "if [ ! -d ~/hypermixer-jax ]; then git clone -q "
      "https://example.org/hm.git ~/hypermixer-jax; fi", "cd ~/hypermixer-jax",
      "git fetch -q origin v1.0", "git checkout -q FETCH_HEAD",
      "python3 -m pip install -q --user -U uv",
      "~/.local/bin/uv python install 3.11",
      "~/.local/bin/uv venv -q --allow-existing --python 3.11 "
      "~/hypermixer-venv",
      "~/.local/bin/uv pip install -q --python ~/hypermixer-venv/bin/python "
      "-e '.[tpu,gcs]' -c constraints.txt",
      "~/hypermixer-venv/bin/python -c 'import jax, sys; "
      "print(sys.version.split()[0], jax.__version__, jax.device_count())'"])


def test_tpu_train_starts_the_same_job_on_all_workers():
  [cmd] = _tpu("train", *COMMON, "--config=configs/c4_mlm.py:hypermixer",
               "--workdir=gs://bucket/mlm", "--",
               "--config.batch_size=1024", "--config.log_every=10")
  assert cmd[8] == "--worker=all"
  assert cmd[9].endswith(
      "cd ~/hypermixer-jax || exit 1; setsid nohup "
      "~/hypermixer-venv/bin/python -m "
      "hypermixer_jax.main --config=configs/c4_mlm.py:hypermixer "
      "--workdir=gs://bucket/mlm --config.batch_size=1024 "
      "--config.log_every=10 >> ~/hypermixer.log 2>&1 < /dev/null & "
      "echo $! > ~/hypermixer.pid")


@pytest.mark.parametrize("kind, workers", [
    ("v4-8", 1), ("v4-32", 4), ("v5p-128", 16), ("v5litepod-8", 1),
    ("v5litepod-16", 4), ("v6e-64", 16)])
def test_tpu_logs_fetched_from_each_worker(kind, workers):
  cmds = _tpu("logs", *COMMON, f"--accelerator-type={kind}",
              "--logs-dir=/tmp/l")
  assert cmds[0] == ["mkdir", "-p", "/tmp/l/hm-pod"]
  assert cmds[1:] == [
      ["gcloud", "compute", "tpus", "tpu-vm", "scp", "hm-pod:~/hypermixer.log",
       f"/tmp/l/hm-pod/worker-{i}.log", "--zone=us-central2-b",
       f"--worker={i}", "--project=proj"] for i in range(workers)]


@pytest.mark.parametrize("kind, line", [
    ("v5e-16", "--accelerator-type=v5e-16: Cloud TPU names v5e slices "
     "v5litepod-N; use --accelerator-type=v5litepod-16."),
    ("v6e-3", "--accelerator-type=v6e-3: v6e slices have 1, 4, 8, 16, 32, "
     "64, 128, 256 chips; e.g. --accelerator-type=v6e-4."),
    ("v5litepod-12", "--accelerator-type=v5litepod-12: v5litepod slices have "
     "1, 4, 8, 16, 32, 64, 128, 256 chips; e.g. "
     "--accelerator-type=v5litepod-8."),
    ("v4-12", "--accelerator-type=v4-12: v4-N counts TensorCores (2 per "
     "chip), in slices of 8 or more in steps of 8; e.g. "
     "--accelerator-type=v4-16."),
    ("v5p-4", "--accelerator-type=v5p-4: v5p-N counts TensorCores (2 per "
     "chip), in slices of 8 or more in steps of 8; e.g. "
     "--accelerator-type=v5p-8.")])
def test_tpu_accelerator_types_are_gclouds_names(kind, line):
  """Each generation's own spelling and sizes, checked before gcloud is
  called; the error gives the name gcloud takes."""
  out = _tpu("create", *COMMON, f"--accelerator-type={kind}", ok=False)
  assert out.stderr.strip() == line
  assert out.stdout == ""


def test_tpu_logs_copied_in_parallel_and_failures_named(worker, tmp_path):
  """One scp per worker (``--worker=all`` would copy every worker's file
  onto one path), run together; a worker whose copy fails is named."""
  env, calls, _ = worker
  gcloud = pathlib.Path(env["PATH"].split(":")[0]) / "gcloud"
  # Each scp holds until 4 copies run at once (a sequential loop never gets
  # there), then copies; worker 2's copy fails.
  gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable) + """
import pathlib, time
if "scp" in sys.argv:
  running = pathlib.Path(os.environ["GCLOUD_CALLS"]).with_suffix(".running")
  with open(running, "a") as f:
    f.write("x")
  for _ in range(500):
    if len(running.read_text()) >= 4:
      break
    time.sleep(0.01)
  else:
    sys.exit("copies ran one after the other")
  if "--worker=2" in sys.argv:
    sys.exit("ERROR: (gcloud.compute.tpus.tpu-vm.scp) worker 2 unreachable")
  pathlib.Path(sys.argv[6]).write_text("log of " + sys.argv[-1])
""")
  out = subprocess.run(
      [sys.executable, TPU, "logs", "--name=hm", "--zone=z",
       "--accelerator-type=v5litepod-16", f"--logs-dir={tmp_path / 'l'}",
       "--parallel=4"], env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 1
  assert out.stdout.splitlines()[-1] == "copied 3 of 4 worker logs"
  assert out.stderr.strip().endswith(
      "--worker=2: ERROR: (gcloud.compute.tpus.tpu-vm.scp) worker 2 "
      "unreachable")
  logs = tmp_path / "l" / "hm"
  assert sorted(p.name for p in logs.iterdir()) == [
      "worker-0.log", "worker-1.log", "worker-3.log"]
  assert (logs / "worker-3.log").read_text() == "log of --worker=3"
  assert len(_calls(calls)) == 4


def test_tpu_errors_name_the_fix():
  assert "install needs --repo" in _tpu("install", *COMMON, ok=False).stderr
  assert "train needs --config and --workdir" in _tpu(
      "train", *COMMON, ok=False).stderr
  assert "use one of v4-N, v5litepod-N" in _tpu(
      "logs", *COMMON, "--accelerator-type=v9-7", ok=False).stderr
  assert ("--workdir=/data/run: the 4 workers must all reach it; give a "
          "gs:// path.") in _tpu("train", *COMMON, "--config=c",
                                 "--workdir=/data/run", ok=False).stderr
  assert "--num-slices=0: must be >= 1" in _tpu(
      "create", *COMMON, "--num-slices=0", ok=False).stderr


# ---------------------------------------------------------------------------
# A gcloud on PATH that records its calls and runs ``ssh --command`` locally
# (HOME = a temporary folder standing for a worker's home).
# ---------------------------------------------------------------------------
FAKE_GCLOUD = """#!{python}
import json, os, subprocess, sys
with open(os.environ["GCLOUD_CALLS"], "a") as f:
  f.write(json.dumps(sys.argv[1:]) + "\\n")
remote = [a[len("--command="):] for a in sys.argv if a.startswith("--command=")]
if "ssh" in sys.argv and remote:
  sys.exit(subprocess.call(["bash", "-c", remote[0]], cwd=os.environ["HOME"]))
"""


@pytest.fixture
def worker(tmp_path):
  """(env with the fake gcloud first on PATH, calls file, worker home)."""
  bin_dir, home = tmp_path / "bin", tmp_path / "home"
  (home / "hypermixer-jax").mkdir(parents=True)
  venv = home / "hypermixer-venv" / "bin"
  venv.mkdir(parents=True)
  # The job: logs its arguments, then runs until it is stopped.
  (venv / "python").write_text(
      "#!/usr/bin/env bash\necho \"job $*\"\nexec sleep 600\n")
  bin_dir.mkdir()
  (bin_dir / "gcloud").write_text(FAKE_GCLOUD.format(python=sys.executable))
  for f in (venv / "python", bin_dir / "gcloud"):
    f.chmod(f.stat().st_mode | stat.S_IEXEC)
  calls = tmp_path / "calls.jsonl"
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
             GCLOUD_CALLS=str(calls), HOME=str(home))
  return env, calls, home


def _calls(path):
  return [json.loads(l) for l in path.read_text().splitlines()] \
      if path.exists() else []


def test_dry_run_anywhere_runs_nothing_and_is_not_forwarded(worker):
  env, calls, _ = worker
  train = ["train", "--name=hm", "--zone=z", "--accelerator-type=v4-8",
           "--config=c.py", "--workdir=gs://b/r"]
  for argv in ([*train, "--dry-run", "--", "--config.batch_size=8"],
               [*train, "--", "--config.batch_size=8", "--dry-run"]):
    [printed] = _tpu(*argv, env=env)
    assert not _calls(calls)
    assert printed[-1].endswith("--workdir=gs://b/r --config.batch_size=8 >> "
                                "~/hypermixer.log 2>&1 < /dev/null & echo $! "
                                "> ~/hypermixer.pid")
    assert "--dry-run" not in printed[-1]
  for action in ("create", "install", "status", "stop", "logs", "delete"):
    _tpu(action, "--name=hm", "--zone=z", "--repo=r", "--dry-run", env=env)
  assert not _calls(calls)


def test_train_status_stop_on_a_worker(worker):
  env, calls, home = worker
  where = ["--name=hm", "--zone=z", "--accelerator-type=v4-8"]
  train = ["train", *where, "--config=c.py", "--workdir=gs://b/r", "--",
           "--config.seed=3"]
  printed = _tpu(*train, env=env)
  assert _calls(calls) == [c[1:] for c in printed]   # ran what it printed
  pid = int((home / "hypermixer.pid").read_text())
  os.kill(pid, 0)                                    # the job runs
  try:
    again = _tpu(*train, env=env, ok=False)          # a second copy: refused
    assert f"job {pid} is still running; stop it first" in again.stderr
    status = subprocess.run([sys.executable, TPU, "status", *where], env=env,
                            capture_output=True, text=True, timeout=60)
    assert f": running (PID {pid}): job -m hypermixer_jax.main --config=c.py "\
           "--workdir=gs://b/r --config.seed=3" in status.stdout
  finally:
    stop = subprocess.run([sys.executable, TPU, "stop", *where, "--grace=5"],
                          env=env, capture_output=True, text=True, timeout=60)
  assert f"stopped job {pid}" in stop.stdout, stop.stderr
  with pytest.raises(ProcessLookupError):
    for _ in range(100):    # until the orphaned job is reaped
      os.kill(pid, 0)
      time.sleep(0.05)
  assert not (home / "hypermixer.pid").exists()
  status = subprocess.run([sys.executable, TPU, "status", *where], env=env,
                          capture_output=True, text=True, timeout=60)
  assert ": no job running" in status.stdout


# ---------------------------------------------------------------------------
# SLURM.
# ---------------------------------------------------------------------------
def _srun(tmp_path, nodes="4"):
  env = dict(os.environ, DRY_RUN="1", SLURM_JOB_NUM_NODES=nodes,
             GPUS_PER_NODE="8", VENV="/opt/venv",
             SLURM_SUBMIT_DIR=str(tmp_path))
  out = subprocess.run(
      ["bash", SLURM, "configs/c4_mlm.py:hypermixer", "/shared/ckpt/mlm",
       "--config.batch_size=1024"], env=env, capture_output=True, text=True,
      timeout=60)
  assert out.returncode == 0, out.stderr
  return shlex.split(out.stdout), env


def test_slurm_dry_run_prints_srun(tmp_path):
  cmd, env = _srun(tmp_path)
  assert cmd == [
      "srun", "--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8",
      "--gpu-bind=none", "--cpus-per-task=8", "--kill-on-bad-exit=1",
      "--label",
      "/opt/venv/bin/python", "-m", "hypermixer_jax.main",
      "--config=configs/c4_mlm.py:hypermixer", "--workdir=/shared/ckpt/mlm",
      "--config.batch_size=1024"]
  # The allocation's GPUs and CPUs per task carry over to srun (a
  # --gpus-per-node given to sbatch on the command line).
  env4 = {k: v for k, v in env.items() if k != "GPUS_PER_NODE"}
  out = subprocess.run(
      ["bash", SLURM, "c", "/w"], capture_output=True, text=True, timeout=60,
      env=dict(env4, SLURM_GPUS_ON_NODE="4", SLURM_CPUS_PER_TASK="12"))
  assert "--ntasks-per-node=4 --gpus-per-node=4" in out.stdout
  assert "--cpus-per-task=12" in out.stdout
  bad = subprocess.run(["bash", SLURM, "only-config"], env=env,
                       capture_output=True, text=True, timeout=60)
  assert bad.returncode == 2 and "usage: sbatch" in bad.stderr


def test_slurm_every_task_sees_the_gpu_jax_picks(tmp_path, monkeypatch):
  """JAX's SLURM detection gives task (node n, local id l) the process id
  8n + l of 32 and local_device_ids [l]; with the srun line above every task
  sees its node's 8 GPUs (no per-task binding), so device l exists."""
  from jax._src import clusters  # pylint: disable=g-import-not-at-top
  cmd, _ = _srun(tmp_path)
  assert not any(a.startswith("--gpus-per-task") for a in cmd)
  assert "--gpu-bind=none" in cmd and "--gpus-per-node=8" in cmd
  visible = range(8)   # what a task sees: all GPUs of its node
  for k in os.environ:
    if k.startswith("SLURM_"):
      monkeypatch.delenv(k)
  monkeypatch.setenv("SLURM_JOB_ID", "4242")
  monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[017-020]")
  monkeypatch.setenv("SLURM_NTASKS", "32")
  monkeypatch.setenv("SLURM_STEP_NUM_NODES", "4")
  for node in range(4):
    for local in range(8):
      monkeypatch.setenv("SLURM_PROCID", str(8 * node + local))
      monkeypatch.setenv("SLURM_LOCALID", str(local))
      address, count, index, local_ids = (
          clusters.ClusterEnv.auto_detect_unset_distributed_params(
              None, None, None, None, None, None))
      assert (count, index, local_ids) == (32, 8 * node + local, [local])
      assert address == f"gpu017:{4242 % 4096 + 61440}"
      assert all(i in visible for i in local_ids)


def test_slurm_header_matches_one_task_per_gpu():
  text = open(SLURM, encoding="utf-8").read()
  assert "#SBATCH --ntasks-per-node=8" in text
  assert "#SBATCH --gpus-per-node=8" in text
