#!/usr/bin/env python3
"""Runs hypermixer-jax on a Cloud TPU VM pod slice with ``gcloud``.

    # everything in order (create, install, train, wait for nothing):
    scripts/tpu_pod.py create  --name=hm-v4 --zone=us-central2-b --accelerator-type=v4-32
    scripts/tpu_pod.py install --name=hm-v4 --zone=us-central2-b \
        --repo=https://github.com/ORG/hypermixer-jax.git --ref=main
    scripts/tpu_pod.py train   --name=hm-v4 --zone=us-central2-b \
        --config=configs/c4_mlm.py:hypermixer --workdir=gs://BUCKET/mlm_hm \
        -- --config.batch_size=1024
    scripts/tpu_pod.py logs    --name=hm-v4 --zone=us-central2-b --accelerator-type=v4-32
    scripts/tpu_pod.py delete  --name=hm-v4 --zone=us-central2-b

``--dry-run`` prints the exact commands instead of running them.

Every worker (host) of the slice runs the same ``python3 -m
hypermixer_jax.main`` in the background; ``jax.distributed.initialize()``
finds the other workers by itself on a TPU VM (``hypermixer_jax.runtime``).
Checkpoints and metrics go to ``--workdir``, which all workers must reach
(a ``gs://`` bucket). Each worker writes its own log, ``~/hypermixer.log``;
``logs`` copies them to ``--logs-dir/<name>/worker-<i>.log``.
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys

REPO_DIR = "~/hypermixer-jax"
LOG = "~/hypermixer.log"


def num_workers(accelerator_type: str) -> int:
  """Hosts of a slice type (v4/v5p: 8 TensorCores = 4 chips per host;
  v5e/v6e: single host up to 8 chips, 4 chips per host beyond)."""
  m = re.fullmatch(r"(v2|v3|v4|v5p|v5litepod|v5e|v6e)-(\d+)", accelerator_type)
  if not m:
    raise SystemExit(f"--accelerator-type={accelerator_type!r}: unknown; "
                     "give --num-workers explicitly.")
  gen, n = m.group(1), int(m.group(2))
  if gen in ("v2", "v3", "v4", "v5p"):
    return max(1, n // 8)
  return 1 if n <= 8 else n // 4


def _base(args, verb: str) -> list[str]:
  cmd = ["gcloud", "compute", "tpus", "tpu-vm", verb, args.name,
         f"--zone={args.zone}"]
  if args.project:
    cmd.append(f"--project={args.project}")
  return cmd


def commands(args) -> list[list[str]]:
  """The gcloud command lines of ``args.action``."""
  if args.action == "create":
    cmd = _base(args, "create") + [
        f"--accelerator-type={args.accelerator_type}",
        f"--version={args.runtime_version}"]
    if args.spot:
      cmd.append("--spot")
    return [cmd]
  if args.action == "delete":
    return [_base(args, "delete") + ["--quiet"]]
  if args.action == "install":
    if not args.repo:
      raise SystemExit("install needs --repo (the git URL to clone).")
    remote = (
        f"set -e; if [ ! -d {REPO_DIR} ]; then git clone {shlex.quote(args.repo)} "
        f"{REPO_DIR}; fi; cd {REPO_DIR} && git fetch -q origin "
        f"{shlex.quote(args.ref)} && git checkout -q FETCH_HEAD && "
        "python3 -m pip install -q -U pip && "
        "python3 -m pip install -q -e '.[tpu]' -c constraints.txt")
    return [_base(args, "ssh") + ["--worker=all", f"--command={remote}"]]
  if args.action == "train":
    if not args.config or not args.workdir:
      raise SystemExit("train needs --config and --workdir.")
    job = ["python3", "-m", "hypermixer_jax.main", f"--config={args.config}",
           f"--workdir={args.workdir}", *args.extra]
    remote = (f"cd {REPO_DIR} && setsid nohup {shlex.join(job)} "
              f"> {LOG} 2>&1 < /dev/null &")
    return [_base(args, "ssh") + ["--worker=all", f"--command={remote}"]]
  if args.action == "logs":
    n = args.num_workers or num_workers(args.accelerator_type)
    out = f"{args.logs_dir}/{args.name}"
    return [["mkdir", "-p", out]] + [
        _base(args, "scp")[:5] + [f"{args.name}:{LOG}",
                                  f"{out}/worker-{i}.log",
                                  f"--zone={args.zone}", f"--worker={i}"]
        + ([f"--project={args.project}"] if args.project else [])
        for i in range(n)]
  raise SystemExit(f"unknown action {args.action!r}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("action", choices=("create", "install", "train", "logs",
                                    "delete"))
  p.add_argument("--name", required=True, help="TPU VM (slice) name")
  p.add_argument("--zone", required=True)
  p.add_argument("--project", default="")
  p.add_argument("--accelerator-type", default="v4-32")
  p.add_argument("--runtime-version", default="tpu-ubuntu2204-base")
  p.add_argument("--spot", action="store_true", help="spot (preemptible) VMs")
  p.add_argument("--repo", default="", help="git URL of the repository")
  p.add_argument("--ref", default="main", help="branch, tag or commit")
  p.add_argument("--config", default="")
  p.add_argument("--workdir", default="", help="gs:// path all workers reach")
  p.add_argument("--num-workers", type=int, default=0,
                 help="hosts of the slice (default: from --accelerator-type)")
  p.add_argument("--logs-dir", default="tpu_logs")
  p.add_argument("--dry-run", action="store_true",
                 help="print the commands instead of running them")
  argv = list(sys.argv[1:] if argv is None else argv)
  extra = argv[argv.index("--") + 1:] if "--" in argv else []
  args = p.parse_args(argv[:len(argv) - len(extra) - bool(extra or "--" in argv)])
  args.extra = extra  # after --: flags for main.py
  for cmd in commands(args):
    print(shlex.join(cmd), flush=True)
    if not args.dry_run:
      rc = subprocess.call(cmd)
      if rc:
        return rc
  return 0


if __name__ == "__main__":
  sys.exit(main())
