"""Start-up of a process: TensorFlow on the host only, distributed flags."""
import importlib.util
import json
import logging
import os
import subprocess
import sys
import types

import pytest

from hypermixer_jax import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tensorflow_sees_no_accelerator_and_stays_quiet():
  code = ("from hypermixer_jax import runtime\n"
          "runtime.hide_accelerators_from_tensorflow()\n"
          "import tensorflow as tf\n"
          "print(sorted({d.device_type for d in tf.config.get_visible_devices()}))\n"
          "print(float(tf.reduce_sum(tf.ones(3))))\n")
  env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120,
                       env=dict(env, PYTHONPATH=ROOT), capture_output=True,
                       text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["['CPU']", "3.0"]
  # TensorFlow's C++ start-up lines (oneDNN, CUDA stubs) are held back.
  assert out.stderr.strip() == "", out.stderr


def test_import_error_is_not_swallowed(monkeypatch):
  import builtins  # pylint: disable=g-import-not-at-top
  real = builtins.__import__

  def broken(name, *args, **kw):
    if name == "tensorflow":
      raise ImportError("no tensorflow here")
    return real(name, *args, **kw)

  monkeypatch.setattr(builtins, "__import__", broken)
  monkeypatch.setattr(runtime, "_tensorflow_hidden", False)  # not yet run
  with pytest.raises(ImportError, match="no tensorflow here"):
    runtime.hide_accelerators_from_tensorflow()


def test_hiding_twice_is_a_no_op(monkeypatch):
  """main.py hides before the config files import TensorFlow and again in
  main(): the second call must not touch TensorFlow's (fixed) devices."""
  monkeypatch.setattr(runtime, "_tensorflow_hidden", True)
  # A stand-in TensorFlow that records what is asked of it (importing the
  # real one costs seconds): a call that went on would import it here.
  calls = []
  tf = types.ModuleType("tensorflow")
  tf.config = types.SimpleNamespace(
      set_visible_devices=lambda *a: calls.append(a))
  tf.get_logger = lambda: calls.append("get_logger") or logging.getLogger()
  monkeypatch.setitem(sys.modules, "tensorflow", tf)
  runtime.hide_accelerators_from_tensorflow()
  assert calls == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="sometimes"), "--distributed='sometimes'; valid: auto, on, off"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2),
     "missing --process_id"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2),
     r"--process_id=2 not in \[0, --num_processes=2\)"),
    (dict(mode="off", coordinator_address="127.0.0.1:1", num_processes=2,
          process_id=0), "--distributed=off contradicts"),
])
def test_bad_flags_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    runtime.initialize_distributed(**kwargs)


def test_single_process_is_not_initialised(monkeypatch):
  for k in ("SLURM_JOB_ID", "SLURM_NTASKS"):
    monkeypatch.delenv(k, raising=False)
  assert runtime.detect_cluster() is None
  assert runtime.initialize_distributed("auto") is None
  assert runtime.initialize_distributed("off") is None


def test_slurm_is_detected_with_several_tasks(monkeypatch):
  env = dict(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="node[1-2]",
             SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0")
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  assert runtime.detect_cluster() == "slurm"
  monkeypatch.setenv("SLURM_NTASKS", "1")   # one task: nothing to join
  assert runtime.detect_cluster() is None


@pytest.mark.parametrize("env, want", [
    # One task per GPU, each seeing all 8: JAX's SLURM detection picks
    # GPU SLURM_LOCALID (None: nothing to pass).
    (dict(SLURM_STEP_TASKS_PER_NODE="8(x2)", SLURM_NODEID="1",
          SLURM_GPUS_ON_NODE="8"), None),
    # One task per node: every GPU it sees, not GPU 0 alone.
    (dict(SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_NODEID="1",
          SLURM_GPUS_ON_NODE="8"), list(range(8))),
    (dict(SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_NODEID="0",
          CUDA_VISIBLE_DEVICES="0,1,2,3"), [0, 1, 2, 3]),
    # srun --gpus-per-task=1: each task sees its own GPU as GPU 0.
    (dict(SLURM_STEP_TASKS_PER_NODE="4", CUDA_VISIBLE_DEVICES="2"), [0]),
    # --gpus-per-task=2 on 8: each task its own two, numbered 0 and 1.
    (dict(SLURM_STEP_TASKS_PER_NODE="4(x2)", CUDA_VISIBLE_DEVICES="4,5",
          SLURM_GPUS_ON_NODE="8"), [0, 1]),
    (dict(SLURM_STEP_TASKS_PER_NODE="2", CUDA_VISIBLE_DEVICES="4,5,6,7",
          SLURM_GPUS_ON_NODE="8"), [0, 1, 2, 3]),
    # Uneven nodes: node 1 runs 2 tasks of its 4 GPUs.
    (dict(SLURM_STEP_TASKS_PER_NODE="4,2", SLURM_NODEID="1",
          SLURM_GPUS_ON_NODE="4"), "runs 2 tasks on this node, which has 4"),
    (dict(SLURM_GPUS_ON_NODE="8"), None),       # SLURM gives no counts
])
def test_slurm_tasks_take_the_gpus_they_are_given(monkeypatch, env, want):
  for k in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
            "SLURM_NODEID", "SLURM_GPUS_ON_NODE", "CUDA_VISIBLE_DEVICES",
            "ROCR_VISIBLE_DEVICES"):
    monkeypatch.delenv(k, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  if isinstance(want, str):
    with pytest.raises(ValueError, match=want + r" GPUs: run one task per "
                       r"GPU \(srun --ntasks-per-node=4"):
      runtime.slurm_local_devices()
  else:
    assert runtime.slurm_local_devices() == want


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:1234", True), ("localhost:1", True), ("[::1]:5", True),
    ("10.0.0.1:1234", False), ("node-1:1234", False)])
def test_loopback_coordinator_binds_loopback_only(address, loopback):
  assert runtime._is_loopback(address) is loopback  # pylint: disable=protected-access


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed")
@pytest.mark.parametrize("platforms, chosen", [(None, "cpu"), ("cpu", "None")])
def test_libtpu_is_left_out_without_tpu_chips(platforms, chosen):
  """libtpu installed, no TPU chip: JAX starts on the CPU without trying
  libtpu (whose start-up prints host-bound and worker-hostname errors and
  takes a lock file); an explicit JAX_PLATFORMS is left as it is."""
  code = ("from hypermixer_jax import runtime\n"
          "print(runtime.choose_platforms())\n"
          "import jax\n"
          "print(jax.devices()[0].platform)\n")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  if platforms:
    env["JAX_PLATFORMS"] = platforms
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120,
                       env=dict(env, PYTHONPATH=ROOT), capture_output=True,
                       text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == [chosen, "cpu"]
  assert out.stderr.strip() == "", out.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="glibc's mallopt is Linux-only")
def test_prepare_host_settles_the_allocator_before_jax_starts():
  """The entry points' start-up: on a CPU-only host freed memory is kept
  (``HYPERMIXER_HOST_MALLOC=system`` keeps glibc's defaults: tested in
  process below), and JAX then starts on the CPU; a second call after JAX
  started keeps what was settled."""
  code = ("from hypermixer_jax import runtime\n"
          "print(runtime.prepare_host())\n"
          "import jax\n"
          "print(jax.devices()[0].platform)\n"
          "print(runtime.prepare_host(), runtime.host_malloc())\n")
  env = {k: v for k, v in os.environ.items()
         if k not in ("HYPERMIXER_HOST_MALLOC", "LD_PRELOAD")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120,
                       env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["retained", "cpu", "retained", "retained"], (
      out.stdout)


_FAULTS = """
import ctypes, json, resource, sys
from hypermixer_jax import runtime
print(runtime.retain_host_memory())
libc = ctypes.CDLL(None)
libc.sbrk.restype = ctypes.c_void_p
import jax, jax.numpy as jnp
f = jax.jit(lambda x, v: jnp.einsum("bij,bjk->bik", jnp.sin(x), v).sum())
x, v = jnp.ones((64, 512, 512)), jnp.ones((64, 512, 1))   # temporary: sin(x)
print(f.lower(x, v).compile().memory_analysis().temp_size_in_bytes)
calls = []
for _ in range(int(sys.argv[1])):
  faults, brk = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, libc.sbrk(0)
  f(x, v).block_until_ready()
  calls.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                libc.sbrk(0) - brk))
print(json.dumps(calls))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="glibc's mallopt and page-fault counts: Linux only")
def test_retained_host_memory_takes_fresh_pages_only_to_grow_the_heap():
  """glibc's defaults map XLA:CPU's large temporaries afresh at every call
  (a minor page fault per 4 KiB page). Retained, a call takes fresh pages
  only where the heap grows (by a temporary: a small block left in the hole
  an earlier temporary freed can keep the next one out), and the growth dies
  out: seen 1-9 growths in 400 calls, mostly in the first five, the last at
  call 224; the second half of 100 calls then faults at most a few times."""
  env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
  # The system allocator faults at every call: 20 calls show it.
  for mode, n in (("system", 20), ("retain", 100)):
    out = subprocess.run([sys.executable, "-c", _FAULTS, str(n)], cwd=ROOT,
                         timeout=120, capture_output=True, text=True,
                         env=dict(env, PYTHONPATH=ROOT,
                                  HYPERMIXER_HOST_MALLOC=mode))
    assert out.returncode == 0, out.stderr
    settled, temp, calls = out.stdout.splitlines()
    assert settled == {"system": "system", "retain": "retained"}[mode]
    temp, calls = int(temp), json.loads(calls)
    assert temp >= 64 << 20
    fresh = [faults > temp / 4096 / 2 for faults, _ in calls]
    if mode == "system":   # every call first-touches the whole temporary
      assert all(fresh[1:]), calls
      continue
    grown = [growth >= temp for _, growth in calls]
    assert all(g for f, g in zip(fresh, grown) if f), calls
    assert not any(faults > 1000 for (faults, _), g in zip(calls, grown)
                   if not g), calls
    assert sum(fresh[50:]) <= 5, calls


def test_host_malloc_mode_is_checked():
  with pytest.raises(ValueError, match="HYPERMIXER_HOST_MALLOC='big'.*'retain'"):
    runtime.retain_host_memory("big")


def test_retaining_after_jax_started_changes_nothing(monkeypatch, caplog):
  import jax  # pylint: disable=g-import-not-at-top
  jax.devices()   # the backends and their threads exist
  monkeypatch.setattr(runtime, "_host_memory_retained", False)
  monkeypatch.setattr(runtime, "preloaded_allocator", lambda: None)
  assert runtime.retain_host_memory("retain") == "system"
  assert "before the first device query" in caplog.text
  assert runtime.retain_host_memory("system") == "system"


def test_preloaded_allocator_is_read_from_the_maps(tmp_path):
  maps = tmp_path / "maps"
  maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
  assert runtime.preloaded_allocator(str(maps)) is None
  maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/"
                  "libtcmalloc_minimal.so.4.5.10\n")
  assert runtime.preloaded_allocator(str(maps)) == "tcmalloc"
  assert runtime.preloaded_allocator(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("platforms, chips, cpu_only", [
    ("cpu", ["/dev/accel0"], True), ("cuda,cpu", [], False),
    ("", [], True), ("", ["/dev/accel0"], False)])
def test_memory_is_retained_only_where_xla_cpu_runs_the_model(
    monkeypatch, platforms, chips, cpu_only):
  """'auto': retained on a CPU-only host (or JAX_PLATFORMS=cpu); on an
  accelerator host glibc's arenas stay for the input pipeline's threads."""
  monkeypatch.setenv("JAX_PLATFORMS", platforms)
  monkeypatch.setattr(runtime, "tpu_chips", lambda: chips)
  monkeypatch.setattr(runtime.os.path, "exists", lambda path: False)
  assert runtime._cpu_only_host() is cpu_only  # pylint: disable=protected-access
  if not cpu_only:
    monkeypatch.setattr(runtime, "_host_memory_retained", False)
    monkeypatch.setattr(runtime, "preloaded_allocator", lambda: None)
    assert runtime.retain_host_memory("auto") == "system"
