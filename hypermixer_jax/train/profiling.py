"""A window of training steps traced with ``jax.profiler``.

``config.profile.start_step`` (-1: off) and ``config.profile.num_steps``
choose the window; steps after compilation and warm-up are the ones worth
looking at. Every process traces its own devices into
``workdir/profile/plugins/profile/<run>/<host>.xplane.pb``, which TensorBoard's
profile plugin (``pip install -e ".[profile]"``; ``tensorboard --logdir
WORKDIR/profile`` or ``xprof --logdir ...``) shows as a trace viewer and op
statistics; ``perfetto_trace.json.gz`` next to it opens in
https://ui.perfetto.dev. Each step is annotated (``jax.profiler.StepTraceAnnotation``)
so the viewers count steps. A ``gs://`` workdir gets the trace files
copied through ``etils.epath`` when the window ends (the trace itself is
written to a local temporary folder: the profiler writes with its own file
layer).
"""
from __future__ import annotations

import collections
import contextlib
import os
import shutil
import tempfile
from typing import Any

from absl import logging
import jax

from hypermixer_jax.train import storage


class StepProfiler:
  """Starts a trace before ``start_step`` and stops it after the window.

  Use as::

      profiler = StepProfiler(workdir, start_step=10, num_steps=5)
      for step in ...:
        with profiler.step(step):
          state, metrics = train_step(state, batch)
          profiler.keep(metrics)    # waited for before the trace stops
      profiler.close()
  """

  def __init__(self, workdir: str, start_step: int = -1, num_steps: int = 5):
    self.directory = os.path.join(os.fspath(workdir), "profile")
    self._local = None   # the trace's local folder for a remote workdir
    self.start_step = int(start_step)
    self.num_steps = max(int(num_steps), 1)
    self._active = False
    self._pending: Any = None

  @property
  def enabled(self) -> bool:
    return self.start_step >= 0

  def keep(self, outputs: Any) -> None:
    """Outputs of the current step: the trace ends only once they exist."""
    self._pending = outputs

  @contextlib.contextmanager
  def step(self, step: int):
    """Context of one training step (annotated while tracing)."""
    if self.enabled and step == self.start_step and not self._active:
      storage.path(self.directory).mkdir(parents=True, exist_ok=True)
      if not storage.is_local(self.directory):
        self._local = tempfile.mkdtemp(prefix="profile")
      jax.profiler.start_trace(self._local or self.directory,
                               create_perfetto_trace=True)
      self._active = True
      logging.info("profiler: tracing steps %d..%d into %s", step,
                   step + self.num_steps - 1, self.directory)
    if self._active:
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        yield
    else:
      yield
    if self._active and step >= self.start_step + self.num_steps - 1:
      self._stop()

  def _stop(self) -> None:
    jax.block_until_ready(self._pending)
    self._pending = None
    jax.profiler.stop_trace()
    self._active = False
    if self._local:
      for root, _, names in os.walk(self._local):
        target = storage.path(self.directory) / os.path.relpath(
            root, self._local)
        target.mkdir(parents=True, exist_ok=True)
        for name in names:
          storage.path(os.path.join(root, name)).copy(target / name,
                                                      overwrite=True)
      shutil.rmtree(self._local)
      self._local = None
    files = trace_files(self.directory)
    logging.info("profiler: trace written (%s); view with `tensorboard "
                 "--logdir %s` or ui.perfetto.dev", ", ".join(files),
                 self.directory)

  def close(self) -> None:
    """Stops a trace still running (a run that ended inside the window)."""
    if self._active:
      self._stop()


def trace_files(directory: str) -> list[str]:
  """The ``.xplane.pb`` and Perfetto files under ``directory``."""
  runs = storage.path(directory) / "plugins" / "profile"
  return sorted(os.fspath(p) for pattern in ("*/*.xplane.pb",
                                             "*/perfetto_trace.json.gz")
                for p in runs.glob(pattern))


# Lines the profiler derives from the annotated events (they repeat them).
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework Ops",
                  "Framework Name Scope", "Source code", "XLA TraceMe",
                  "Launch Stats", "TensorFlow Ops", "TensorFlow Name Scope")


def op_times(xplane: str) -> dict[str, dict[str, float]]:
  """``{HLO module: {instruction: seconds}}`` summed over a trace.

  The events counted are those that XLA's runtime annotates with their HLO
  instruction (stat ``hlo_op``): the kernels on an accelerator's planes
  (``/device:GPU:0``, ``/device:TPU:0``), or the CPU runtime's thunks where
  the trace has no accelerator. Lines the profiler derives from those
  events (``XLA Ops``, ...) are read only where no event carries the stat.
  GPU command buffers (CUDA graphs) hide the per-kernel annotation: trace
  with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` for a full split.
  """
  data = jax.profiler.ProfileData.from_file(xplane)
  device = [p for p in data.planes if p.name.startswith("/device:") and (
      "CUSTOM" not in p.name)]
  for planes in (device, [p for p in data.planes if p.name == "/host:CPU"]):
    out = collections.defaultdict(lambda: collections.defaultdict(float))
    derived = collections.defaultdict(lambda: collections.defaultdict(float))
    for plane in planes:
      for line in plane.lines:
        for e in line.events:
          if line.name in _DERIVED_LINES:
            if line.name == "XLA Ops":
              derived[""][e.name] += e.duration_ns * 1e-9
            continue
          stats = dict(e.stats)
          if "hlo_op" in stats:
            out[str(stats.get("hlo_module", ""))][str(stats["hlo_op"])] += (
                e.duration_ns * 1e-9)
    if out or derived:
      return {m: dict(v) for m, v in (out or derived).items()}
  return {}
