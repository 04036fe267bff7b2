"""Training metrics: TensorBoard event files, a JSON-lines log and a console bar.

Only process 0 writes (``MetricWriter(enabled=jax.process_index() == 0)``).
Throughput follows MaxText: steps/s, examples/s and tokens/s measured between
two logging points, and model FLOPs utilisation

    MFU = (FLOPs of one step on one device, from XLA's cost analysis of the
           compiled, partitioned train step) * steps/s / peak FLOP/s per device

with the peak per device from ``PEAK_FLOPS`` (vendors' dense bf16 figures,
matched on ``jax.Device.device_kind``), or ``config.peak_flops_per_device``
when set (e.g. a measured peak, or another dtype's). Unknown devices (CPUs)
show no MFU.

Logs are readable without a terminal (pod workers, SLURM output files):
``ProgressBar.update`` also writes one plain log line per log step.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from absl import logging
import numpy as np

from hypermixer_jax.train import storage

METRICS_FILE = "metrics.jsonl"


# Dense bf16 peak FLOP/s of one JAX device (a TPU chip; a GPU), from the
# vendors' specifications: Cloud TPU system architecture pages (v4 275 T,
# v5e 197 T, v5p 459 T, v6e Trillium 918 T per chip) and NVIDIA data sheets
# (A100 312 T; H100 SXM 989 T, H100 NVL 835 T, H100 PCIe 756 T; H200 989 T),
# without structured sparsity. First match wins: (substrings of the
# lower-cased device_kind that must all occur, FLOP/s).
PEAK_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("v6 lite",), 918e12), (("v6e",), 918e12),
    (("v5 lite",), 197e12), (("v5e",), 197e12), (("v5litepod",), 197e12),
    (("v5p",), 459e12), (("tpu v5",), 459e12),
    (("tpu v4",), 275e12),
    (("h100", "pcie"), 756e12), (("h100", "nvl"), 835e12),
    (("h100",), 989e12), (("h200",), 989e12),
    (("a100",), 312e12),
)


def peak_flops(device_kind: str, override: float | None = None
               ) -> float | None:
  """Peak FLOP/s of a device kind: ``override`` if > 0, else ``PEAK_FLOPS``.

  None for a device the table does not know (then MFU is not reported).
  """
  if override and override > 0:
    return float(override)
  kind = device_kind.lower()
  for needles, flops in PEAK_FLOPS:
    if all(n in kind for n in needles):
      return flops
  return None


def device_peak_flops(devices: Sequence[Any], override: float | None = None
                      ) -> float | None:
  """``peak_flops`` of the mesh's devices (all of one kind in practice)."""
  kinds = {d.device_kind for d in devices}
  peaks = {peak_flops(k, override) for k in kinds}
  if len(peaks) != 1:
    logging.warning("devices of several kinds %s: MFU uses the smallest "
                    "peak (none where a kind's peak is unknown).",
                    sorted(kinds))
  known = [p for p in peaks if p]
  return min(known) if known and None not in peaks else None


def step_flops(compiled) -> float | None:
  """FLOPs of one call of ``compiled`` on one device (XLA cost analysis).

  For an SPMD-partitioned executable the analysis covers one partition, so
  this is already per device. Returns None when the backend gives no count.
  """
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if isinstance(analysis, (list, tuple)):  # older JAX: one dict per module
    analysis = analysis[0] if analysis else None
  if not analysis or "flops" not in analysis:
    return None
  flops = float(analysis["flops"])
  return flops if flops > 0 else None


class Throughput:
  """Steps/s, examples/s, tokens/s and MFU between successive ``update`` calls.

  Args:
    examples_per_step: global batch size.
    tokens_per_step: global tokens (or patches) per step.
    flops_per_step: per-device FLOPs of one step (``step_flops``), or None.
    peak_flops_per_device: measured peak FLOP/s of one device, or 0/None.
  """

  def __init__(self, examples_per_step: int, tokens_per_step: int,
               flops_per_step: float | None = None,
               peak_flops_per_device: float | None = None):
    self.examples_per_step = examples_per_step
    self.tokens_per_step = tokens_per_step
    self.flops_per_step = flops_per_step
    self.peak = peak_flops_per_device
    self._t = None
    self._step = None

  def start(self, step: int) -> None:
    self._t, self._step = time.perf_counter(), step

  def update(self, step: int) -> dict[str, float]:
    """Rates since the last call (call after the step's results are ready)."""
    now = time.perf_counter()
    if self._t is None:
      self.start(step)
      return {}
    steps, dt = step - self._step, now - self._t
    self._t, self._step = now, step
    if steps <= 0 or dt <= 0:
      return {}
    rate = steps / dt
    out = {"steps_per_sec": rate,
           "examples_per_sec": rate * self.examples_per_step,
           "tokens_per_sec": rate * self.tokens_per_step}
    if self.flops_per_step:
      out["tflops_per_device"] = rate * self.flops_per_step / 1e12
      if self.peak:
        out["mfu"] = rate * self.flops_per_step / self.peak
    return out


class MetricWriter:
  """Writes scalars to TensorBoard and ``metrics.jsonl``, images to
  TensorBoard.

  ``metrics.jsonl`` holds one record per (split, step) with full-precision
  floats; a resumed run appends, and ``read_metrics`` keeps the last record of
  each step, so it shows the history the final model actually went through.
  """

  def __init__(self, workdir: str, *, enabled: bool = True):
    self.enabled = enabled
    self.workdir = workdir
    self._tb = None
    self._jsonl = None
    if enabled:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      storage.path(workdir).mkdir(parents=True, exist_ok=True)
      storage.register_tensorboard()
      # The default file name has one-second resolution: a run restarted
      # within the same second would overwrite the previous run's events.
      self._tb = SummaryWriter(
          logdir=os.fspath(storage.path(workdir) / "tensorboard"),
          filename_suffix=f".{time.time_ns()}")
      self._jsonl = storage.AppendFile(storage.path(workdir) / METRICS_FILE)

  def write_scalars(self, step: int, scalars: Mapping[str, Any],
                    split: str = "train") -> None:
    if not self.enabled:
      return
    clean = {k: float(np.asarray(v)) for k, v in scalars.items()}
    for k, v in clean.items():
      self._tb.add_scalar(f"{split}/{k}", v, step)
    self._jsonl.write(json.dumps({"split": split, "step": int(step), **clean})
                      + "\n")
    self._jsonl.flush()

  def write_text(self, tag: str, text: str, step: int = 0) -> None:
    if self.enabled:
      self._tb.add_text(tag, text, step)

  def write_image(self, tag: str, step: int, image: np.ndarray) -> None:
    """``image``: [H, W, 3 or 4] uint8 or float in [0, 1]."""
    if self.enabled:
      self._tb.add_image(tag, np.asarray(image), step, dataformats="HWC")

  def flush(self) -> None:
    if self.enabled:
      self._tb.flush()
      self._jsonl.flush()

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()
      self.enabled = False


def read_metrics(workdir: str, split: str = "train") -> dict[int, dict]:
  """``{step: record}`` of ``split`` from ``workdir/metrics.jsonl``."""
  out = {}
  with (storage.path(workdir) / METRICS_FILE).open() as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError:  # a line cut short by a kill
        continue
      if rec.pop("split") == split:
        out[rec.pop("step")] = rec
  return dict(sorted(out.items()))


def duration(seconds: float) -> str:
  """``42 s``, ``3 min 08 s``, ``1 h 02 min``."""
  seconds = int(round(seconds))
  if seconds < 60:
    return f"{seconds} s"
  if seconds < 3600:
    return f"{seconds // 60} min {seconds % 60:02d} s"
  return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _say(text: str, warn: bool = False) -> None:
  """An absl log line, or stdout where INFO is not logged (a notebook)."""
  if warn:
    logging.warning("%s", text)
  elif logging.level_info():
    logging.info("%s", text)
  else:
    print(text, flush=True)


class Heartbeat:
  """A line whenever the process has said nothing for ``every`` seconds.

  A daemon thread, so that the line comes while the main thread waits in
  XLA's compiler, the input pipeline or a device transfer (a check between
  steps would only run once they return; with asynchronous dispatch, not even
  then). ``beat()`` restarts the clock (call it with each line written);
  ``message(elapsed_seconds)`` says what is being waited for.
  """

  def __init__(self, message: Callable[[float], str], every: float = 60.0,
               *, repeat: bool = True, warn: bool = False,
               enabled: bool = True):
    if repeat and every <= 0:
      raise ValueError(f"Heartbeat(every={every}) would repeat without pause; "
                       "give every > 0, or repeat=False.")
    self._message, self.every = message, every
    self._repeat, self._warn = repeat, warn
    self._start = self._last = time.monotonic()
    self._stopped = threading.Event()
    self._thread = None
    if enabled:
      self._thread = threading.Thread(target=self._run, daemon=True,
                                      name="heartbeat")
      self._thread.start()

  def _run(self) -> None:
    while not self._stopped.wait(max(0.0, self._last + self.every
                                     - time.monotonic())):
      now = time.monotonic()
      if now < self._last + self.every:
        continue   # a beat came while waiting
      _say(self._message(now - self._start), self._warn)
      if not self._repeat:
        return
      self._last = now

  def beat(self) -> None:
    self._last = time.monotonic()

  def stop(self) -> None:
    self._stopped.set()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join()

  def __enter__(self) -> "Heartbeat":
    return self

  def __exit__(self, *exc) -> None:
    self.stop()


@contextlib.contextmanager
def announce(what: str, *, every: float = 60.0,
             enabled: bool = True) -> Iterator[None]:
  """Says ``what`` is starting, every ``every`` s that it is still going,
  and how long it took (e.g. ``compiling the train step``: XLA gives no
  sign of life for minutes on a large model or a slow host)."""
  if enabled:
    _say(f"{what} ...")
  start = time.monotonic()
  with Heartbeat(lambda t: f"still {what}: {duration(t)} so far", every,
                 enabled=enabled):
    yield
  if enabled:
    _say(f"{what}: done in {duration(time.monotonic() - start)}")


class ProgressBar:
  """Progress of process 0: plain log lines, plus a tqdm bar on a terminal.

  Each ``update`` with scalars writes one plain line, ``[name] step
  200/1000: loss=0.4213 steps/s=5.21 ...``: through absl logging where there
  is no terminal (pod workers, SLURM output files: tqdm's redrawn line would
  be unreadable there, so no bar is drawn), above the bar on a terminal.
  """

  def __init__(self, total: int, initial: int = 0, *, enabled: bool = True,
               name: str = "train", terminal: bool | None = None):
    self._bar = None
    self._total = total
    self._name = name
    self.enabled = enabled
    self._quiet = None
    if terminal is None:
      terminal = _is_terminal()
    if enabled and terminal:
      import tqdm  # pylint: disable=g-import-not-at-top
      self._bar = tqdm.tqdm(total=total, initial=initial, dynamic_ncols=True,
                            desc=name, unit="step", smoothing=0.1)

  def update(self, step: int, scalars: Mapping[str, float] | None = None):
    if not self.enabled:
      return
    if self._bar is not None:
      # The postfix before ``update``, which redraws the bar: it must show
      # this step's figures, not those of the previous log step.
      if scalars:
        self._bar.set_postfix(_format(scalars), refresh=False)
      self._bar.update(step - self._bar.n)
    if scalars:
      self.write(log_line(self._name, step, self._total, scalars))

  def write(self, text: str) -> None:
    """A line above the bar on a terminal, else an absl INFO log line (or
    stdout where INFO is not logged: a notebook, a script without app.run)."""
    if not self.enabled:
      return
    self.until_first_line(None)
    if self._bar is not None:
      self._bar.write(text)
    else:
      _say(text)

  def until_first_line(self, message: Callable[[float], str] | None,
                       after: float = 60.0) -> None:
    """Warns ``message(elapsed)`` once if no line is written in ``after``
    seconds (None: no more warning)."""
    if self._quiet is not None:
      self._quiet.stop()
      self._quiet = None
    if message is not None and self.enabled:
      self._quiet = Heartbeat(message, after, repeat=False, warn=True)

  def close(self) -> None:
    self.until_first_line(None)
    if self._bar is not None:
      self._bar.close()


def _is_terminal() -> bool:
  import sys  # pylint: disable=g-import-not-at-top
  try:
    return sys.stderr.isatty()
  except (AttributeError, ValueError):
    return False


_SHORT = {"loss": ("loss", "{:.4g}"), "steps_per_sec": ("steps/s", "{:.2f}"),
          "tokens_per_sec": ("tok/s", "{:.3g}"),
          "examples_per_sec": ("ex/s", "{:.3g}"), "mfu": ("MFU", "{:.2%}")}


def _format(scalars: Mapping[str, float]) -> dict[str, str]:
  return {name: fmt.format(scalars[k]) for k, (name, fmt) in _SHORT.items()
          if k in scalars}


def log_line(name: str, step: int, total: int,
             scalars: Mapping[str, float]) -> str:
  """``[name] step S/T: k=v ...`` with every scalar (short names first)."""
  parts = [f"{n}={v}" for n, v in _format(scalars).items()]
  short = set(_SHORT)
  parts += [f"{k}={float(np.asarray(v)):.5g}" for k, v in sorted(scalars.items())
            if k not in short]
  return f"[{name}] step {step}/{total}: " + " ".join(parts)
