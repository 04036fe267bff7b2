"""Process start-up: TensorFlow kept on the host, and JAX's multi-host runtime.

``main.py`` calls them before anything touches a device (``prepare_host``
runs the host-side two for every entry point: the experiments and the
benchmarks too); notebooks and other entry points can call them too.

TensorFlow only runs the input pipelines (seqio / TFDS / tf.data), but on a
GPU machine its first op would initialise CUDA and reserve most of the GPU
memory that JAX needs, and its start-up prints a page of C++ log lines on
every host. ``hide_accelerators_from_tensorflow`` hides the GPUs (and TPUs)
from it and silences those lines.

``choose_platforms`` keeps libtpu out of runs on machines without TPU
chips: installed (the ``tpu`` extra, for ``--mode=compile``), it would
otherwise try to start a TPU runtime at JAX's first device query, print
host-bound, worker-hostname and "no jellyfish device" lines, and hold a
lock file that makes a second concurrent run fail its own attempt.

``retain_host_memory`` keeps the memory that glibc's ``free`` returns in the
process. XLA:CPU allocates a program's temporaries afresh at every call
(68 MB for a HyperMixing train step of 8 x 512 tokens); above glibc's mmap
threshold each one is mapped and unmapped again, so the step first-touches
~18,000 new zeroed pages (minor page faults) every time, and its products
then run ~20% slower than the same products timed alone
(docs/performance.md, "Host memory"). ``main.run()``, the experiments and
the benchmarks call it at start-up. By default it acts only where the model
runs on XLA:CPU; ``HYPERMIXER_HOST_MALLOC=system`` keeps glibc's defaults.

``initialize_distributed`` calls ``jax.distributed.initialize``:

* explicit, when a coordinator address is given (any cluster; the test
  starts processes on 127.0.0.1 this way);
* automatic on Cloud TPU pod slices and under SLURM (``srun`` with more
  than one task), where JAX reads the process layout from the environment;
* not at all for a single process elsewhere (a workstation, Colab), where
  JAX needs no coordinator.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import io
import ipaddress
import logging
import os
import sys
import tempfile

DISTRIBUTED_MODES = ("auto", "on", "off")
_tensorflow_hidden = False   # hide_accelerators_from_tensorflow has run
HOST_MALLOC_MODES = ("auto", "retain", "system")
# What retain_host_memory sets, as (glibc mallopt parameter of malloc.h,
# the same setting's environment variable for a child process, value): one
# arena, no mmap'd chunks, freed memory trimmed only beyond 2 GiB (mallopt
# takes a C int), the heap grown in 64 MB steps.
_RETAINED = ((-8, "MALLOC_ARENA_MAX", 1), (-4, "MALLOC_MMAP_MAX_", 0),
             (-1, "MALLOC_TRIM_THRESHOLD_", 2 ** 31 - 1),
             (-2, "MALLOC_TOP_PAD_", 64 << 20))
RETAINED_MALLOC_ENV = {name: str(value) for _, name, value in _RETAINED}
_host_memory_retained = False


@contextlib.contextmanager
def _quiet_native_stderr():
  """Holds back what native code writes to fd 2; replays it on an error.

  TensorFlow's C++ start-up lines (oneDNN, CUDA stubs, cuInit) are written
  through absl before its logging is initialised, where
  ``TF_CPP_MIN_LOG_LEVEL`` does not reach them.
  """
  try:
    fd = sys.stderr.fileno()
  except (AttributeError, ValueError, io.UnsupportedOperation):
    yield  # no real stderr (e.g. a notebook kernel's stream): nothing to hide
    return
  sys.stderr.flush()
  saved = os.dup(fd)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), fd)
    try:
      yield
    except BaseException:
      os.dup2(saved, fd)
      held.seek(0)
      os.write(fd, held.read())
      raise
    finally:
      sys.stderr.flush()
      os.dup2(saved, fd)
      os.close(saved)


def hide_accelerators_from_tensorflow() -> None:
  """TensorFlow sees only the CPU, and its start-up noise is silenced.

  Must run before TensorFlow executes its first op (afterwards its devices
  are fixed), which is why entry points call it first; later calls do
  nothing.
  """
  global _tensorflow_hidden
  if _tensorflow_hidden:
    return
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")   # C++: errors only
  with _quiet_native_stderr():
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.get_logger().setLevel(logging.ERROR)
    for kind in ("GPU", "TPU"):
      try:
        tf.config.set_visible_devices([], kind)
      except (RuntimeError, ValueError) as e:
        # RuntimeError: TF already initialised its devices (too late to hide
        # them); ValueError: this build knows no such device type.
        if isinstance(e, RuntimeError):
          logging.warning("TensorFlow's devices are already initialised; "
                          "%s devices stay visible to it: %s", kind, e)
  _tensorflow_hidden = True


def detect_cluster() -> str | None:
  """``'slurm'``, ``'tpu'`` or None: where ``initialize()`` needs no flags.

  SLURM: a job step with several tasks (``srun``; JAX reads SLURM_* for the
  coordinator, the process count and id). TPU: a Cloud TPU VM (TPU chips at
  ``/dev/accel*`` or ``/dev/vfio/<n>``) with libtpu installed; JAX asks the
  VM's metadata server for the pod slice's workers.
  """
  slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
           "SLURM_PROCID", "SLURM_LOCALID")
  if all(k in os.environ for k in slurm) and int(os.environ["SLURM_NTASKS"]) > 1:
    return "slurm"
  import importlib.util  # pylint: disable=g-import-not-at-top
  if tpu_chips() and importlib.util.find_spec("libtpu") is not None:
    return "tpu"
  return None


def _tasks_on_this_node() -> int | None:
  """This node's task count in the SLURM step (``SLURM_STEP_TASKS_PER_NODE``
  or ``SLURM_TASKS_PER_NODE``: ``8(x2),4`` lists the nodes' counts, in the
  order of ``SLURM_NODEID``); None where SLURM does not say."""
  text = os.environ.get("SLURM_STEP_TASKS_PER_NODE",
                        os.environ.get("SLURM_TASKS_PER_NODE", ""))
  counts = []
  for item in filter(None, text.split(",")):
    n, _, times = item.partition("(x")
    try:
      counts += [int(n)] * int(times.rstrip(")") or 1)
    except ValueError:
      return None
  node = int(os.environ.get("SLURM_NODEID", "0") or 0)
  return counts[node] if node < len(counts) else None


def slurm_local_devices() -> list[int] | None:
  """The GPUs a SLURM task takes: None (JAX's SLURM detection gives each
  task GPU ``SLURM_LOCALID``: one task per GPU, each seeing all), the GPUs
  a task sees where srun binds some to each (``--gpus-per-task=k``: they are
  0..k-1 to the task), or every GPU the task sees where it is the node's
  only task (``srun --ntasks-per-node=1``), which would otherwise train on
  GPU 0 alone. A node with fewer tasks than GPUs
  (more than one each) is refused in one line: its other GPUs would idle."""
  tasks = _tasks_on_this_node()
  visible = os.environ.get("CUDA_VISIBLE_DEVICES",
                           os.environ.get("ROCR_VISIBLE_DEVICES"))
  seen = len([d for d in visible.split(",") if d.strip()]) if visible else 0
  node = int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0)
  if seen and (tasks or 0) > 1 and (seen == 1 or seen < node):
    # Bound to its own GPUs (--gpus-per-task=k): numbered 0..k-1 to it.
    return list(range(seen))
  gpus = node or seen
  if tasks is None or gpus <= 1 or tasks >= gpus:
    return None
  if tasks == 1:
    return list(range(gpus))
  raise ValueError(
      f"SLURM runs {tasks} tasks on this node, which has {gpus} GPUs: run "
      f"one task per GPU (srun --ntasks-per-node={gpus}, as "
      "scripts/slurm_gpu.sbatch does) or one task per node.")


# JAX's GPU plugins (module, device node that shows a GPU is attached).
_GPU_PLUGINS = (("cuda", ("jax_cuda13_plugin", "jax_cuda12_plugin"),
                 "/dev/nvidiactl"),
                ("rocm", ("jax_rocm7_plugin", "jax_rocm60_plugin"),
                 "/dev/kfd"))


def tpu_chips() -> list[str]:
  """Device files of the TPU chips attached to this host (empty elsewhere)."""
  return glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*")


def choose_platforms() -> str | None:
  """Leaves the TPU backend out where no TPU chip is attached.

  Runs before JAX initialises its backends (the first device query); it
  sets ``jax_platforms`` to the attached GPU platforms and ``cpu`` when
  libtpu is installed but the machine has no TPU chips, so that libtpu is
  never started. An explicit ``JAX_PLATFORMS`` (or ``jax_platforms``), a TPU
  VM and a machine without libtpu are left alone; in a process whose
  backends already started the setting has no effect. Compile-only TPU
  devices (``--mode=compile``) do not need the TPU backend: libtpu is
  loaded for them on request.

  Returns:
    The platforms set, or None when nothing was changed.
  """
  import importlib.util  # pylint: disable=g-import-not-at-top
  if os.environ.get("JAX_PLATFORMS") or tpu_chips() or (
      importlib.util.find_spec("libtpu") is None):
    return None
  import jax  # pylint: disable=g-import-not-at-top
  if jax.config.jax_platforms:
    return None
  gpus = [name for name, modules, node in _GPU_PLUGINS
          if os.path.exists(node)
          and any(importlib.util.find_spec(m) for m in modules)]
  platforms = ",".join([*gpus, "cpu"])
  jax.config.update("jax_platforms", platforms)
  return platforms


def preloaded_allocator(maps: str = "/proc/self/maps") -> str | None:
  """``'tcmalloc'``, ``'jemalloc'`` or ``'mimalloc'`` when such an
  allocator is mapped into the process (``LD_PRELOAD``), else None."""
  try:
    with open(maps, encoding="utf-8", errors="replace") as f:
      text = f.read()
  except OSError:
    return None
  return next((name for name in ("tcmalloc", "jemalloc", "mimalloc")
               if f"lib{name}" in text), None)


def _cpu_only_host() -> bool:
  """Whether JAX will run on the CPU: ``JAX_PLATFORMS`` names only ``cpu``,
  or (unset) the host has no TPU chip and no GPU device node."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return {p.strip() for p in platforms.split(",") if p.strip()} == {"cpu"}
  return not tpu_chips() and not any(
      os.path.exists(node) for _, _, node in _GPU_PLUGINS)


def _jax_started() -> bool:
  """Whether JAX's backends (and their threads) have started."""
  if "jax" not in sys.modules:
    return False
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return xla_bridge.backends_are_initialized()
  except (ImportError, AttributeError):
    return len(os.listdir("/proc/self/task")) > 1


def retain_host_memory(mode: str | None = None) -> str:
  """Keeps freed host memory in the process (glibc's ``mallopt``).

  Must run before JAX's backends start: their threads take their own
  malloc arenas, where chunks larger than an arena's 64 MB heap are always
  mapped afresh. Afterwards it changes nothing and says so. The memory a
  step frees stays with the process (its resident size keeps its peak,
  which a training process reaches again at every step anyway, plus the
  few temporaries the heap grows by while small blocks split the holes
  earlier temporaries left).

  ``'auto'`` retains only where the model runs on XLA:CPU (no TPU chip or
  GPU device node, or ``JAX_PLATFORMS=cpu``): on an accelerator host the
  temporaries live on the device, and the host's allocations are the input
  pipeline's many threads, which one shared arena would serialise.

  Args:
    mode: ``'auto'``, ``'retain'`` or ``'system'`` (glibc's defaults); None
      reads ``HYPERMIXER_HOST_MALLOC`` (default ``'auto'``).
  Returns:
    What the process allocates with: ``'retained'``, ``'system'``, or the
    name of a preloaded allocator (tcmalloc keeps freed memory itself).
  """
  global _host_memory_retained
  if mode is None:
    mode = os.environ.get("HYPERMIXER_HOST_MALLOC", "") or "auto"
  if mode not in HOST_MALLOC_MODES:
    raise ValueError(f"HYPERMIXER_HOST_MALLOC={mode!r}: use 'auto' (retain "
                     "on hosts without accelerators), 'retain' (keep freed "
                     "host memory in the process) or 'system' (glibc's "
                     "defaults).")
  if mode == "auto":
    mode = "retain" if _cpu_only_host() else "system"
  other = preloaded_allocator()
  if other:
    return other
  if _host_memory_retained:
    return "retained"
  if mode == "system" or not sys.platform.startswith("linux"):
    return "system"
  try:
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version  # pylint: disable=pointless-statement
  except (OSError, AttributeError):
    return "system"   # not glibc (musl, ...): its own policy
  if _jax_started():
    logging.warning("retain_host_memory: JAX's backends have started, so "
                    "host memory keeps glibc's defaults; call it before the "
                    "first device query.")
    return "system"
  _host_memory_retained = all(libc.mallopt(param, value) == 1
                              for param, _, value in _RETAINED)
  return "retained" if _host_memory_retained else "system"


def prepare_host() -> str:
  """The start-up of every entry point, before JAX's first device query:
  ``choose_platforms`` (no libtpu on machines without TPU chips), then
  ``retain_host_memory`` (before JAX's threads take malloc arenas).
  Returns what the process allocates with (``retain_host_memory``)."""
  choose_platforms()
  return retain_host_memory()


def host_malloc() -> str:
  """What ``retain_host_memory`` settled (without changing anything)."""
  return preloaded_allocator() or (
      "retained" if _host_memory_retained else "system")


def _is_loopback(address: str) -> bool:
  host = address.rsplit(":", 1)[0].strip("[]")
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def initialize_distributed(mode: str = "auto", *,
                           coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None,
                           initialization_timeout: int = 300) -> str | None:
  """Starts JAX's distributed runtime when this process is one of several.

  Args:
    mode: ``auto`` (explicit flags, else a detected TPU pod / SLURM job,
      else nothing), ``on`` (always call ``jax.distributed.initialize``,
      letting JAX detect the cluster: e.g. Open MPI, Kubernetes), ``off``.
    coordinator_address: ``host:port`` of process 0 (then ``num_processes``
      and ``process_id`` are required). A loopback address also makes the
      coordinator listen on loopback only (JAX otherwise binds every
      interface).
    initialization_timeout: seconds to wait for all processes.

  Returns:
    How it was initialised (``'explicit'``, ``'slurm'``, ``'tpu'``,
    ``'auto-detected'``) or None when it was not.

  Raises:
    ValueError: naming the missing or contradictory flag.
  """
  if mode not in DISTRIBUTED_MODES:
    raise ValueError(f"--distributed={mode!r}; valid: "
                     f"{', '.join(DISTRIBUTED_MODES)}.")
  explicit = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in explicit):
    if mode == "off":
      raise ValueError("--distributed=off contradicts --coordinator_address/"
                       "--num_processes/--process_id; drop one or the other.")
    missing = [n for n, v in zip(("--coordinator_address", "--num_processes",
                                  "--process_id"), explicit) if v is None]
    if missing:
      raise ValueError(f"explicit multi-process start needs all of "
                       f"--coordinator_address, --num_processes and "
                       f"--process_id; missing {', '.join(missing)}.")
    if not 0 <= process_id < num_processes:
      raise ValueError(f"--process_id={process_id} not in [0, "
                       f"--num_processes={num_processes}).")
  if mode == "off":
    return None
  import jax  # pylint: disable=g-import-not-at-top
  if coordinator_address is not None:
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes,
        process_id=process_id,
        coordinator_bind_address=(coordinator_address
                                  if _is_loopback(coordinator_address)
                                  else None),
        initialization_timeout=initialization_timeout)
    return "explicit"
  cluster = detect_cluster()
  if cluster is None and mode == "auto":
    return None
  local = slurm_local_devices() if cluster == "slurm" else None
  jax.distributed.initialize(initialization_timeout=initialization_timeout,
                             local_device_ids=local)
  return cluster or "auto-detected"
