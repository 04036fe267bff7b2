"""Launch scripts: their dry runs print the exact commands they would run."""
import os
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = os.path.join(ROOT, "scripts", "tpu_pod.py")
SLURM = os.path.join(ROOT, "scripts", "slurm_gpu.sbatch")
COMMON = ["--name=hm-pod", "--zone=us-central2-b", "--project=proj",
          "--dry-run"]


def _tpu(*args, ok=True):
  out = subprocess.run([sys.executable, TPU, *args], capture_output=True,
                       text=True, timeout=60)
  assert (out.returncode == 0) == ok, out.stderr
  return out if not ok else [shlex.split(l) for l in out.stdout.splitlines()]


def test_tpu_create_and_delete():
  assert _tpu("create", *COMMON, "--accelerator-type=v5p-64", "--spot") == [[
      "gcloud", "compute", "tpus", "tpu-vm", "create", "hm-pod",
      "--zone=us-central2-b", "--project=proj", "--accelerator-type=v5p-64",
      "--version=tpu-ubuntu2204-base", "--spot"]]
  assert _tpu("delete", *COMMON) == [[
      "gcloud", "compute", "tpus", "tpu-vm", "delete", "hm-pod",
      "--zone=us-central2-b", "--project=proj", "--quiet"]]


def test_tpu_install_on_every_worker():
  [cmd] = _tpu("install", *COMMON, "--repo=https://example.org/hm.git",
               "--ref=v1.0")
  assert cmd[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "hm-pod",
                     "--zone=us-central2-b", "--project=proj", "--worker=all"]
  remote = cmd[9].removeprefix("--command=")
  assert ("git clone https://example.org/hm.git ~/hypermixer-jax" in remote)
  assert "git fetch -q origin v1.0 && git checkout -q FETCH_HEAD" in remote
  assert remote.endswith(
      "python3 -m pip install -q -e '.[tpu]' -c constraints.txt")


def test_tpu_train_starts_the_same_job_on_all_workers():
  [cmd] = _tpu("train", *COMMON, "--config=configs/c4_mlm.py:hypermixer",
               "--workdir=gs://bucket/mlm", "--",
               "--config.batch_size=1024", "--config.log_every=10")
  assert cmd[8] == "--worker=all"
  assert cmd[9] == (
      "--command=cd ~/hypermixer-jax && setsid nohup python3 -m "
      "hypermixer_jax.main --config=configs/c4_mlm.py:hypermixer "
      "--workdir=gs://bucket/mlm --config.batch_size=1024 "
      "--config.log_every=10 > ~/hypermixer.log 2>&1 < /dev/null &")


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


def test_tpu_errors_name_the_fix():
  assert "install needs --repo" in _tpu("install", *COMMON, ok=False).stderr
  assert "train needs --config and --workdir" in _tpu(
      "train", *COMMON, ok=False).stderr
  assert "give --num-workers" in _tpu("logs", *COMMON,
                                      "--accelerator-type=v9-7",
                                      ok=False).stderr


def test_slurm_dry_run_prints_srun(tmp_path):
  env = dict(os.environ, DRY_RUN="1", SLURM_JOB_NUM_NODES="4",
             GPUS_PER_NODE="8", VENV="/opt/venv",
             SLURM_SUBMIT_DIR=str(tmp_path))
  out = subprocess.run(
      ["bash", SLURM, "configs/c4_mlm.py:hypermixer", "/shared/ckpt/mlm",
       "--config.batch_size=1024"], env=env, capture_output=True, text=True,
      timeout=60)
  assert out.returncode == 0, out.stderr
  assert shlex.split(out.stdout) == [
      "srun", "--nodes=4", "--ntasks-per-node=8", "--gpus-per-task=1",
      "--kill-on-bad-exit=1", "--label", "/opt/venv/bin/python", "-m",
      "hypermixer_jax.main", "--config=configs/c4_mlm.py:hypermixer",
      "--workdir=/shared/ckpt/mlm", "--config.batch_size=1024"]
  bad = subprocess.run(["bash", SLURM, "only-config"], env=env,
                       capture_output=True, text=True, timeout=60)
  assert bad.returncode == 2 and "usage: sbatch" in bad.stderr


def test_slurm_header_matches_one_task_per_gpu():
  text = open(SLURM, encoding="utf-8").read()
  assert "#SBATCH --ntasks-per-node=8" in text
  assert "#SBATCH --gpus-per-node=8" in text
