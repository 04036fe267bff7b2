#!/usr/bin/env python3
"""Runs hypermixer-jax on Cloud TPU VM slices with ``gcloud``.

    S="--name=hm --zone=us-west4-a --accelerator-type=v5litepod-256"
    scripts/tpu_pod.py create  $S [--spot] [--num-slices=2]
    scripts/tpu_pod.py install $S --repo=https://github.com/ORG/hypermixer-jax.git --ref=main
    scripts/tpu_pod.py train   $S --config=configs/c4_mlm.py:hypermixer \
        --workdir=gs://BUCKET/mlm_hm -- --config.batch_size=1024
    scripts/tpu_pod.py status  $S     # the slice's state, and the job on each worker
    scripts/tpu_pod.py logs    $S     # ~/hypermixer.log of each worker, copied here
                                      # (--parallel=16 copies at a time)
    scripts/tpu_pod.py stop    $S     # the job on every worker (it saves first)
    scripts/tpu_pod.py delete  $S

``--dry-run`` (anywhere on the command line, also after ``--``) prints the
exact commands and runs nothing.

* ``create``: one slice with ``gcloud compute tpus tpu-vm create``; with
  ``--num-slices=K > 1`` a multi-slice queued resource (``gcloud compute tpus
  queued-resources create --node-count=K``: Multislice needs queued
  resources), whose nodes are ``NAME-0`` ... ``NAME-<K-1>``. The runtime
  version (``--version``) defaults to the one Cloud TPU's documentation
  ("TPU software versions") lists for JAX on the generation: v2/v3/v4
  ``tpu-ubuntu2204-base``, v5e ``v2-alpha-tpuv5-lite``, v5p
  ``v2-alpha-tpuv5``, v6e ``v2-alpha-tpuv6e``.
* ``install``: on every worker of every slice, clones the repository, puts a
  Python >= 3.11 virtual environment in ``~/hypermixer-venv`` and installs
  the project with the ``tpu`` and ``gcs`` extras under ``constraints.txt``.
* ``train``: starts the same ``python -m hypermixer_jax.main`` on every
  worker, in the background (``~/hypermixer.log``, PID in
  ``~/hypermixer.pid``). ``jax.distributed.initialize()`` finds the other
  workers by itself, across slices too (the TPU runtime sets the
  ``MEGASCALE_*`` variables of a multi-slice queued resource, and JAX reads
  them). A worker whose previous job still runs refuses to start a second
  one (``stop`` it first); the ``gs://`` workdir's lock refuses a second job
  on the same workdir as well.
* ``stop``: SIGTERM to the job's process group on every worker, which JAX
  and Orbax treat as a preemption (a checkpoint is saved, then the job
  exits), then SIGKILL after ``--grace`` seconds.
* ``status``: the slice (or queued resource) state, then on each worker
  whether the job runs and its last log line.
* ``logs``: one ``scp`` per worker (``scp --worker=all`` would copy every
  worker's file onto one local path), ``--parallel`` of them at a time; the
  workers whose copy failed are named at the end.

``--accelerator-type`` takes Cloud TPU's names, which differ by generation:
``v2-N``, ``v3-N``, ``v4-N`` and ``v5p-N`` count TensorCores (multiples of
8), ``v5litepod-N`` (v5e) and ``v6e-N`` count chips (1, 4, 8, ..., 256).
"""
from __future__ import annotations

import argparse
from concurrent import futures
import re
import shlex
import subprocess
import sys

REPO_DIR = "~/hypermixer-jax"
VENV = "~/hypermixer-venv"
LOG = "~/hypermixer.log"
PID = "~/hypermixer.pid"
PYTHON = "3.11"

# Cloud TPU's runtime versions for JAX / PyTorch, by generation
# (cloud.google.com/tpu/docs/runtimes, "TPU software versions").
RUNTIME_VERSIONS = {
    "v2": "tpu-ubuntu2204-base", "v3": "tpu-ubuntu2204-base",
    "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}
# gcloud's accelerator types by generation (cloud.google.com/tpu/docs: "TPU
# versions"): the number after the dash counts TensorCores up to v5p (two
# per chip, slices of 8 and up), chips for v5e and v6e (fixed slice sizes).
CHIP_SIZES = (1, 4, 8, 16, 32, 64, 128, 256)
# Names people write for a generation that gcloud spells otherwise.
SPELLINGS = {"v5e": "v5litepod", "v5lite": "v5litepod", "v6": "v6e",
             "v6litepod": "v6e", "v5": "v5p"}
_TYPE = re.compile(r"(v\w+?)-(\d+)")


def _generation(accelerator_type: str) -> tuple[str, int]:
  m = _TYPE.fullmatch(accelerator_type)
  gen, n = (m.group(1), int(m.group(2))) if m else (None, 0)
  flag = f"--accelerator-type={accelerator_type}"
  if gen in SPELLINGS:
    raise SystemExit(
        f"{flag}: Cloud TPU names {gen} slices {SPELLINGS[gen]}-N; use "
        f"--accelerator-type={SPELLINGS[gen]}-{n}.")
  if gen not in RUNTIME_VERSIONS:
    raise SystemExit(
        f"{flag}: unknown; use one of v4-N, v5litepod-N (v5e), v5p-N, v6e-N "
        "(or v2-N, v3-N).")
  if gen in ("v5litepod", "v6e") and n not in CHIP_SIZES:
    raise SystemExit(
        f"{flag}: {gen} slices have {', '.join(map(str, CHIP_SIZES))} chips; "
        f"e.g. --accelerator-type={gen}-"
        f"{min(CHIP_SIZES, key=lambda c: abs(c - n))}.")
  if gen not in ("v5litepod", "v6e") and (n < 8 or n % 8):
    raise SystemExit(
        f"{flag}: {gen}-N counts TensorCores (2 per chip), in slices of 8 or "
        f"more in steps of 8; e.g. --accelerator-type={gen}-"
        f"{max(8, (n + 7) // 8 * 8)}.")
  return gen, n


def num_workers(accelerator_type: str) -> int:
  """Hosts of one slice (v2-v4/v5p: 8 TensorCores = 4 chips per host;
  v5e/v6e: single host up to 8 chips, 4 chips per host beyond)."""
  gen, n = _generation(accelerator_type)
  if gen in ("v2", "v3", "v4", "v5p"):
    return max(1, n // 8)
  return 1 if n <= 8 else n // 4


def runtime_version(args) -> str:
  return args.runtime_version or RUNTIME_VERSIONS[
      _generation(args.accelerator_type)[0]]


def _where(args) -> list[str]:
  return [f"--zone={args.zone}"] + (
      [f"--project={args.project}"] if args.project else [])


def _multi(args) -> bool:
  return args.num_slices > 1


def _ssh(args, remote: str) -> list[str]:
  """``remote`` (a shell command line) on every worker of every slice."""
  if _multi(args):
    return ["gcloud", "compute", "tpus", "queued-resources", "ssh", args.name,
            *_where(args), "--node=all", "--worker=all",
            f"--command={remote}"]
  return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name,
          *_where(args), "--worker=all", f"--command={remote}"]


def _running() -> str:
  """Shell test: this worker's job (from the PID file) is alive."""
  return f"[ -e {PID} ] && kill -0 \"$(cat {PID})\" 2>/dev/null"


def _install(args) -> str:
  # The images ship Python 3.10 (tpu-ubuntu2204-base: Ubuntu 22.04) and the
  # project needs >= 3.11. uv, itself installed from PyPI with the system
  # pip, downloads a standalone CPython build and makes the virtual
  # environment: no apt repository (deadsnakes) or root needed, the same on
  # every image.
  uv = "~/.local/bin/uv"
  return (
      "set -e; "
      f"if [ ! -d {REPO_DIR} ]; then git clone -q {shlex.quote(args.repo)} "
      f"{REPO_DIR}; fi; cd {REPO_DIR}; "
      f"git fetch -q origin {shlex.quote(args.ref)}; git checkout -q FETCH_HEAD; "
      "python3 -m pip install -q --user -U uv; "
      f"{uv} python install {PYTHON}; "
      f"{uv} venv -q --allow-existing --python {PYTHON} {VENV}; "
      f"{uv} pip install -q --python {VENV}/bin/python -e '.[tpu,gcs]' "
      "-c constraints.txt; "
      f"{VENV}/bin/python -c 'import jax, sys; print(sys.version.split()[0], "
      "jax.__version__, jax.device_count())'")


def _train(args) -> str:
  # The venv's path unquoted: the remote shell expands its ~.
  job = f"{VENV}/bin/python -m hypermixer_jax.main " + shlex.join([
      f"--config={args.config}", f"--workdir={args.workdir}", *args.extra])
  return (
      f"if {_running()}; then echo \"$(hostname): job $(cat {PID}) is still "
      f"running; stop it first (scripts/tpu_pod.py stop ...)\" >&2; exit 1; "
      # setsid: the job leads its own process group, which stop signals.
      f"fi; cd {REPO_DIR} || exit 1; setsid nohup {job} >> {LOG} 2>&1 "
      f"< /dev/null & echo $! > {PID}")


def _stop(args) -> str:
  return (
      f"if {_running()}; then p=$(cat {PID}); kill -TERM -- -$p; "
      f"for i in $(seq {args.grace}); do kill -0 $p 2>/dev/null || break; "
      "sleep 1; done; kill -KILL -- -$p 2>/dev/null || true; "
      "echo \"$(hostname): stopped job $p\"; "
      "else echo \"$(hostname): no job running\"; fi; "
      f"rm -f {PID}")


def _status() -> str:
  return (
      f"if {_running()}; then echo \"$(hostname): running (PID $(cat {PID}))"
      f": $(tail -n 1 {LOG})\"; else echo \"$(hostname): no job running; "
      f"last log line: $(tail -n 1 {LOG} 2>/dev/null)\"; fi")


def commands(args) -> list[list[str]]:
  """The command lines of ``args.action``."""
  a = args.action
  if a == "create":
    if _multi(args):
      cmd = ["gcloud", "compute", "tpus", "queued-resources", "create",
             args.name, *_where(args),
             f"--accelerator-type={args.accelerator_type}",
             f"--runtime-version={runtime_version(args)}",
             f"--node-count={args.num_slices}", f"--node-prefix={args.name}"]
    else:
      cmd = ["gcloud", "compute", "tpus", "tpu-vm", "create", args.name,
             *_where(args), f"--accelerator-type={args.accelerator_type}",
             f"--version={runtime_version(args)}"]
    return [cmd + (["--spot"] if args.spot else [])]
  if a == "delete":
    if _multi(args):  # --force: the slices go with the queued resource
      return [["gcloud", "compute", "tpus", "queued-resources", "delete",
               args.name, *_where(args), "--force", "--quiet"]]
    return [["gcloud", "compute", "tpus", "tpu-vm", "delete", args.name,
             *_where(args), "--quiet"]]
  if a == "install":
    if not args.repo:
      raise SystemExit("install needs --repo (the git URL to clone).")
    return [_ssh(args, _install(args))]
  if a == "train":
    if not args.config or not args.workdir:
      raise SystemExit("train needs --config and --workdir.")
    hosts = args.num_slices * (args.num_workers
                               or num_workers(args.accelerator_type))
    if hosts > 1 and not args.workdir.startswith("gs://"):
      raise SystemExit(f"--workdir={args.workdir}: the {hosts} workers must "
                       "all reach it; give a gs:// path.")
    return [_ssh(args, _train(args))]
  if a == "stop":
    return [_ssh(args, _stop(args))]
  if a == "status":
    kind, state = (("queued-resources", "state.state") if _multi(args)
                   else ("tpu-vm", "state"))
    return [["gcloud", "compute", "tpus", kind, "describe", args.name,
             *_where(args), f"--format=value({state})"],
            _ssh(args, _status())]
  if a == "logs":
    n = args.num_workers or num_workers(args.accelerator_type)
    out = f"{args.logs_dir}/{args.name}"
    nodes = ([f"{args.name}-{s}" for s in range(args.num_slices)]
             if _multi(args) else [args.name])
    cmds = [["mkdir", "-p", out]]
    for node in nodes:
      prefix = f"{out}/{node}-" if _multi(args) else f"{out}/"
      cmds += [["gcloud", "compute", "tpus", "tpu-vm", "scp",
                f"{node}:{LOG}", f"{prefix}worker-{i}.log", f"--zone={args.zone}",
                f"--worker={i}"]
               + ([f"--project={args.project}"] if args.project else [])
               for i in range(n)]
    return cmds
  raise SystemExit(f"unknown action {a!r}")


def parse(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("action", choices=("create", "install", "train", "status",
                                    "logs", "stop", "delete"))
  p.add_argument("--name", required=True, help="TPU VM (slice) or queued "
                 "resource name")
  p.add_argument("--zone", required=True)
  p.add_argument("--project", default="")
  p.add_argument("--accelerator-type", default="v4-32",
                 help="of one slice: v4-32, v5litepod-256, v5p-128, v6e-256 ...")
  p.add_argument("--num-slices", type=int, default=1,
                 help="> 1: a multi-slice queued resource (over DCN)")
  p.add_argument("--runtime-version", default="",
                 help="default: the generation's (see RUNTIME_VERSIONS)")
  p.add_argument("--spot", action="store_true", help="spot (preemptible) VMs")
  p.add_argument("--repo", default="", help="git URL of the repository")
  p.add_argument("--ref", default="main", help="branch, tag or commit")
  p.add_argument("--config", default="")
  p.add_argument("--workdir", default="", help="gs:// path all workers reach")
  p.add_argument("--num-workers", type=int, default=0,
                 help="hosts of one slice (default: from --accelerator-type)")
  p.add_argument("--grace", type=int, default=300,
                 help="stop: seconds between SIGTERM and SIGKILL")
  p.add_argument("--logs-dir", default="tpu_logs")
  p.add_argument("--parallel", type=int, default=16,
                 help="logs: copies running at a time")
  p.add_argument("--dry-run", action="store_true",
                 help="print the commands instead of running them")
  own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
      if "--" in argv else (argv, [])
  # --dry-run is this script's, wherever it is written: never the job's.
  dry = "--dry-run" in extra
  args = p.parse_args(own + (["--dry-run"] if dry else []))
  args.extra = [f for f in extra if f != "--dry-run"]
  if args.num_slices < 1:
    p.error(f"--num-slices={args.num_slices}: must be >= 1")
  if args.parallel < 1:
    p.error(f"--parallel={args.parallel}: must be >= 1")
  return args


def _fetch(cmds: list[list[str]], parallel: int) -> int:
  """Runs the ``scp`` commands ``parallel`` at a time; names the failures."""
  with futures.ThreadPoolExecutor(parallel) as pool:
    done = list(pool.map(lambda c: subprocess.run(
        c, capture_output=True, text=True), cmds))
  failed = [(c, d) for c, d in zip(cmds, done) if d.returncode]
  for cmd, d in failed:
    why = (d.stderr or d.stdout).strip().splitlines()
    print(f"not copied: {shlex.join(cmd)}: "
          f"{why[-1] if why else f'exit status {d.returncode}'}",
          file=sys.stderr)
  print(f"copied {len(cmds) - len(failed)} of {len(cmds)} worker logs",
        flush=True)
  return 1 if failed else 0


def main(argv=None) -> int:
  args = parse(list(sys.argv[1:] if argv is None else argv))
  cmds = commands(args)
  if args.action == "logs" and not args.dry_run:
    for cmd in cmds:
      print(shlex.join(cmd), flush=True)
    rc = subprocess.call(cmds[0])   # the local folder
    return rc or _fetch(cmds[1:], args.parallel)
  for cmd in cmds:
    print(shlex.join(cmd), flush=True)
    if not args.dry_run:
      rc = subprocess.call(cmd)
      if rc:
        return rc
  return 0


if __name__ == "__main__":
  sys.exit(main())
