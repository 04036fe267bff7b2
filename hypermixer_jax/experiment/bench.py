"""Shared helpers of the benchmarks (``benchmarks/bench_*.py``): matmul
ceiling, timing, the library's train step, XLA cost, tables.

Every MFU these scripts print is a ratio of two measurements taken in the same
process on the same device: the step's XLA-counted FLOPs per second over the
FLOP/s of a jitted square matmul (``matmul_ceiling``). On a shared host, pin
the process (``taskset -c 1 python ...``): XLA's CPU backend then uses one
thread, and both sides of the ratio see the same core.

On a core that other jobs share, the speed of the core changes while a
benchmark runs. ``Timed`` + ``interleave`` therefore measure the ceiling and
the workloads in alternating rounds (ceiling, A, B, ..., ceiling, A, B, ...,
ceiling), and ``summarize`` reports for each workload the least disturbed
(minimum) and the typical (median) time, and the MFU both ways:
``mfu_best`` = FLOPs / min(step) / max(ceiling FLOP/s) (best against best),
``mfu_paired`` = the median over rounds of FLOPs / step_r / ceiling_r, where
ceiling_r is the mean of the ceiling rounds just before and just after round
r (each round's step is compared with the core's speed at that time).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hypermixer_jax import runtime
from hypermixer_jax.experiment.flags import REPO


def time_call(fn: Callable[..., Any], *args, repeats: int = 5,
              min_seconds: float = 0.2, warmup: int = 1) -> float:
  """Best-of-``repeats`` seconds per call of ``fn(*args)`` (results blocked).

  Each repeat runs the call enough times to last ``min_seconds``; the best
  repeat is reported, the least disturbed by other processes on the host.
  """
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = max(time.perf_counter() - t0, 1e-6)
  inner = max(1, int(min_seconds / once))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t0) / inner)
  return best


def matmul_ceiling(dtype=jnp.float32, n: int = 2048, repeats: int = 5
                   ) -> float:
  """FLOP/s of a jitted ``n x n`` matmul in ``dtype`` on the default device."""
  keys = jax.random.split(jax.random.key(0))
  a = jax.random.normal(keys[0], (n, n), dtype)
  b = jax.random.normal(keys[1], (n, n), dtype)
  mm = jax.jit(jnp.matmul)
  return 2 * n ** 3 / time_call(mm, a, b, repeats=repeats)


class Timed:
  """One workload timed in rounds: ``call()`` runs it once (returns what to
  block on); a round runs it ``inner`` times, with ``inner`` fixed by
  ``warm()`` so that a round lasts about ``min_seconds``.

  ``clock`` and ``block`` are ``time.perf_counter`` and
  ``jax.block_until_ready`` (replaceable in tests).
  """

  def __init__(self, call: Callable[[], Any], *, flops: float = 0.0,
               min_seconds: float = 0.5, warmup: int = 1,
               clock: Callable[[], float] = time.perf_counter,
               block: Callable[[Any], Any] = jax.block_until_ready):
    self.call, self.flops, self.min_seconds = call, flops, min_seconds
    self.warmup, self.clock, self.block = warmup, clock, block
    self.inner = 0

  def warm(self) -> None:
    """Warm-up calls (not timed), then one timed call to size the rounds."""
    for _ in range(self.warmup):
      self.block(self.call())
    t0 = self.clock()
    self.block(self.call())
    once = max(self.clock() - t0, 1e-9)
    self.inner = max(1, math.ceil(self.min_seconds / once))

  def round(self) -> float:
    """Seconds per call over one round."""
    if not self.inner:
      self.warm()
    t0 = self.clock()
    out = None
    for _ in range(self.inner):
      out = self.call()
    self.block(out)
    return (self.clock() - t0) / self.inner


class TorchTimed:
  """``Timed``'s warm/round for a PyTorch workload in a child process.

  The child (``benchmarks/torch_worker.py``, run by ``python``: an
  interpreter with torch) builds ``workload`` from ``cfg`` and answers each
  round, so ``interleave`` can alternate its rounds with this process's.
  Started under ``taskset``, the child inherits the parent's core, and
  the parent's host allocator: a preloaded one through ``LD_PRELOAD``,
  ``runtime.retain_host_memory``'s settings through glibc's variables.
  """

  def __init__(self, python: str, workload: str, cfg: Mapping[str, Any]):
    import subprocess  # pylint: disable=g-import-not-at-top
    worker = str(REPO / "benchmarks" / "torch_worker.py")
    env = dict(os.environ)
    if runtime.host_malloc() == "retained":
      env.update(runtime.RETAINED_MALLOC_ENV)
    self.proc = subprocess.Popen([python, worker, workload, json.dumps(cfg)],
                                 stdin=subprocess.PIPE, env=env,
                                 stdout=subprocess.PIPE, text=True)

  def _ask(self, cmd: str) -> str:
    try:
      self.proc.stdin.write(cmd + "\n")
      self.proc.stdin.flush()
      answer = self.proc.stdout.readline()
    except BrokenPipeError:
      answer = ""
    if not answer:
      raise RuntimeError("the torch worker ended (its error is above); is "
                         "torch installed for the given interpreter?")
    return answer.strip()

  def warm(self) -> None:
    self._ask("warm")

  def round(self) -> float:
    return float(self._ask("round"))

  def close(self) -> None:
    try:
      self.proc.stdin.close()
    except BrokenPipeError:
      pass  # the child has ended already
    self.proc.wait()


def interleave(ceiling: Timed, workloads: Mapping[str, Timed], rounds: int
               ) -> tuple[list[float], dict[str, list[float]]]:
  """Seconds per call, round by round: ceiling, each workload, ..., ceiling.

  Every timer is warmed up first (outside the rounds). Returns the
  ``rounds + 1`` ceiling times and, per workload, its ``rounds`` times.
  """
  if rounds < 1:
    raise ValueError(f"rounds={rounds} must be at least 1.")
  ceiling.warm()
  for t in workloads.values():
    t.warm()
  ceil_times, times = [ceiling.round()], {k: [] for k in workloads}
  for _ in range(rounds):
    for name, t in workloads.items():
      times[name].append(t.round())
    ceil_times.append(ceiling.round())
  return ceil_times, times


@dataclasses.dataclass
class Summary:
  """One workload's times and MFU against the interleaved ceiling."""
  min_s: float
  median_s: float
  ceiling_best: float      # FLOP/s of the fastest ceiling round
  ceiling_median: float    # median FLOP/s over the ceiling rounds
  mfu_best: float          # flops / min_s / ceiling_best
  mfu_paired: float        # median over rounds of the paired ratios
  paired: list[float]      # per round: flops / t_r / mean(ceiling r, r + 1)
  times: list[float]


def summarize(ceil_times: Sequence[float], ceiling_flops: float,
              times: Sequence[float], flops: float) -> Summary:
  """MFU of a workload from ``interleave``'s times (see the module doc)."""
  if len(ceil_times) != len(times) + 1:
    raise ValueError(f"{len(ceil_times)} ceiling rounds for {len(times)} "
                     "workload rounds; interleave() gives rounds + 1.")
  rates = [ceiling_flops / t for t in ceil_times]
  paired = [flops / t / ((rates[r] + rates[r + 1]) / 2)
            for r, t in enumerate(times)]
  best = max(rates)
  return Summary(min_s=min(times), median_s=float(np.median(times)),
                 ceiling_best=best, ceiling_median=float(np.median(rates)),
                 mfu_best=flops / min(times) / best,
                 mfu_paired=float(np.median(paired)), paired=paired,
                 times=list(times))


def ceiling_timer(dtype=jnp.float32, n: int = 2048, min_seconds: float = 0.5
                  ) -> tuple[Timed, float]:
  """(Timed jitted ``n x n`` matmul in ``dtype``, its FLOPs = 2 n^3)."""
  keys = jax.random.split(jax.random.key(0))
  a = jax.random.normal(keys[0], (n, n), dtype)
  b = jax.random.normal(keys[1], (n, n), dtype)
  mm = jax.jit(jnp.matmul)
  return Timed(lambda: mm(a, b), flops=2 * n ** 3,
               min_seconds=min_seconds), 2.0 * n ** 3


def against_ceiling(workloads: Mapping[str, tuple[Callable[[], Any], float]],
                    rounds: int, min_seconds: float, n: int = 1024
                    ) -> dict[str, dict[str, float]]:
  """Each ``name: (call, flops)`` timed in the same interleaved rounds as an
  ``n x n`` float32 matmul (the machine's ceiling at that moment): per name
  the median and least seconds per call, its FLOP/s as a fraction of the
  neighbouring ceiling rounds (``Summary.mfu_paired``), the ceiling's median
  FLOP/s and the calls per round."""
  timed = {k: Timed(call, flops=flops, min_seconds=min_seconds)
           for k, (call, flops) in workloads.items()}
  ceiling, ceiling_flops = ceiling_timer(n=n, min_seconds=min_seconds)
  ceil_times, times = interleave(ceiling, timed, rounds)
  out = {}
  for k, t in times.items():
    s = summarize(ceil_times, ceiling_flops, t, workloads[k][1])
    out[k] = dict(time_s=s.median_s, time_min_s=s.min_s, repeats=rounds,
                  calls_per_round=timed[k].inner, of_ceiling=s.mfu_paired,
                  ceiling_flops_s=s.ceiling_median)
  return out


def loglog_slope(ns: Sequence[float], values: Sequence[float | None]
                 ) -> float:
  """Slope of log(value) against log(N) over the upper half of the ``ns``
  (2 for quadratic growth, 1 for linear); missing or non-positive values
  are left out; NaN with fewer than two points."""
  pts = sorted((n, v) for n, v in zip(ns, values)
               if v is not None and np.isfinite(v) and v > 0)
  if len(pts) < 2:
    return float("nan")
  upper = [p for p in pts if p[0] >= np.median([q[0] for q in pts])]
  if len(upper) < 2:
    upper = pts[-2:]
  x, y = np.log([p[0] for p in upper]), np.log([p[1] for p in upper])
  return float(np.polyfit(x, y, 1)[0])


def train_step(model_cfg, batch: Mapping[str, np.ndarray], mesh, rules,
               tx=None, *, config=None):
  """The library's train step of ``model_cfg`` on ``mesh``, compiled for the
  host ``batch``: ``(step, state, global batch, rng)``, where
  ``step(state, batch, rng)`` returns ``(state, metrics)`` and donates its
  state (``steps.make_train_step`` with the model's head and loss weights,
  ``steps.jit_train_step``, ``steps.create_train_state`` with optimizer
  ``tx`` from ``jax.random.key(0)``). ``config`` instead of ``tx``: the
  training config's optimiser (``optim.make_optimizer`` on the model's
  parameters), as the training loop builds it."""
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import sharding  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import optim  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import steps  # pylint: disable=g-import-not-at-top
  model, facts = models.build_model(model_cfg), models.model_facts(model_cfg)
  if (tx is None) == (config is None):
    raise ValueError("bench.train_step: pass tx or config, one of them.")
  if tx is None:
    tx, _ = optim.make_optimizer(config, steps.param_shapes(model, batch))
  state, state_sh = steps.create_train_state(model, tx, jax.random.key(0),
                                             batch, mesh, rules)
  step = steps.jit_train_step(
      steps.make_train_step(model, facts.head,
                            loss_weights=facts.loss_weights),
      state_sh, sharding.batch_shardings(batch, mesh, rules), mesh, rules)
  batch = sharding.make_global_batch(batch, mesh, rules)
  rng = jax.device_put(jax.random.key(1), jax.NamedSharding(mesh, jax.P()))
  return step.lower(state, batch, rng).compile(), state, batch, rng


def time_steps(step, state, batch, rng, n: int, warmup: int = 2) -> float:
  """Seconds per call of a ``train_step`` step over ``n`` calls, after
  ``warmup`` untimed ones (the donated state carried from call to call)."""
  for _ in range(warmup):
    state, metrics = step(state, batch, rng)
  jax.block_until_ready(metrics)
  t0 = time.perf_counter()
  for _ in range(n):
    state, metrics = step(state, batch, rng)
  jax.block_until_ready(metrics)
  return (time.perf_counter() - t0) / n


def xla_cost(compiled) -> dict[str, float]:
  """XLA's cost analysis of a compiled executable as one dict (older JAX
  gave one per computation: the first)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return dict(cost or {})


def xla_flops(compiled) -> float:
  """FLOPs of one call of a compiled executable (XLA's cost analysis, as the
  training loop counts them; 0 where the backend gives none)."""
  from hypermixer_jax.train import metrics  # pylint: disable=g-import-not-at-top
  return metrics.step_flops(compiled) or 0.0


def compiled_forward(module, x):
  """(params, the compiled ``module.apply`` on inputs shaped as ``x``): the
  forward a benchmark times and counts, its parameters from ``key(1)``."""
  params = jax.jit(module.init)(jax.random.key(1), x)
  return params, jax.jit(module.apply).lower(params, x).compile()


def compiled_grad(module, params, x, **apply_kw):
  """The compiled gradients of sum(y^2) to the parameters and the input, y
  being ``module.apply(params, x, **apply_kw)``: a training step's mixer
  work without an optimizer."""
  loss = lambda p, x: jnp.sum(module.apply(p, x, **apply_kw) ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile()


# Dense peak FLOP/s per device kind and dtype (vendor data sheets, without
# sparsity), for the MFU against the device's peak on accelerators (the
# loop's train.metrics.PEAK_FLOPS has bf16 only). On CPU the measured
# matmul ceiling is the reference.
PEAK_FLOPS = {
    # (substring of jax's device_kind, lower-case) -> {dtype: FLOP/s}
    "h200": {"bfloat16": 989e12, "float32": 67e12},
    "h100": {"bfloat16": 989e12, "float32": 67e12},   # SXM
    "a100": {"bfloat16": 312e12, "float32": 19.5e12},
    "l40s": {"bfloat16": 362e12, "float32": 91.6e12},
    "l4": {"bfloat16": 121e12, "float32": 30.3e12},   # after l40s (longest first)
    "v100": {"bfloat16": 125e12, "float32": 15.7e12},  # fp16 tensor cores
    "tpu v4": {"bfloat16": 275e12, "float32": 275e12 / 4},
    "tpu v5 lite": {"bfloat16": 197e12, "float32": 197e12 / 4},
    "tpu v5e": {"bfloat16": 197e12, "float32": 197e12 / 4},
    # v5p's device_kind is "TPU v5" (after "tpu v5 lite": longest first).
    "tpu v5": {"bfloat16": 459e12, "float32": 459e12 / 4},
    "tpu v5p": {"bfloat16": 459e12, "float32": 459e12 / 4},
    "tpu v6 lite": {"bfloat16": 918e12, "float32": 918e12 / 4},
    "tpu v6e": {"bfloat16": 918e12, "float32": 918e12 / 4},
}


def device_peak(dtype: str) -> float | None:
  """The table's peak FLOP/s of device 0 in ``dtype``, None if unknown."""
  kind = getattr(jax.devices()[0], "device_kind", "").lower()
  if jax.devices()[0].platform == "cpu":
    return None
  for key in sorted(PEAK_FLOPS, key=len, reverse=True):
    if key in kind:
      return PEAK_FLOPS[key].get(dtype)
  return None



def device_name() -> str:
  """The device, the host cores this process may use, its host allocator
  (``runtime.host_malloc``) and the XLA flags it was started with (they
  change what the compiled programs run)."""
  d = jax.devices()[0]
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
      else os.cpu_count()
  kind = getattr(d, "device_kind", d.platform)
  flags = os.environ.get("XLA_FLAGS", "").strip()
  return (f"{d.platform}:{kind} ({cores} host cores visible; host malloc: "
          f"{runtime.host_malloc()}"
          + (f"; XLA_FLAGS='{flags}'" if flags else "") + ")")


def parser(doc: str, *, rounds: str = "repeats", min_seconds: float = 0.5,
           quick: str = "small sizes for a fast check"
           ) -> argparse.ArgumentParser:
  """The flags every benchmark takes: ``--<rounds>`` (interleaved timing
  rounds), ``--min_seconds``, ``--quick`` and ``--out``.

  Benchmarks build it first in ``main``, before JAX's first device query,
  so it also keeps libtpu from starting where no TPU chip is attached
  (``runtime.choose_platforms``, as ``main.run()`` does) and keeps freed
  host memory in the process (``runtime.retain_host_memory``; the table
  header says which allocator ran).
  """
  runtime.prepare_host()
  ap = argparse.ArgumentParser(description=doc.split("\n")[0])
  ap.add_argument(f"--{rounds}", type=int, default=5,
                  help="interleaved timing rounds")
  ap.add_argument("--min_seconds", type=float, default=min_seconds,
                  help="least duration of one round of one workload")
  ap.add_argument("--quick", action="store_true", help=quick)
  ap.add_argument("--out", default="", help="folder for the table and json")
  return ap


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]
                   ) -> str:
  """GitHub Markdown table; numbers right-aligned."""
  def cell(v):
    return f"{v:,.4g}" if isinstance(v, float) else str(v)
  align = ["---:" if rows and isinstance(rows[0][i], (int, float)) else "---"
           for i in range(len(headers))]
  lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
  lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
  return "\n".join(lines)


def write_outputs(out_dir: str | None, name: str, text: str, results: Any
                  ) -> None:
  """Writes ``<name>.md`` and ``results.json`` under ``out_dir`` (if given)."""
  if not out_dir:
    return
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, f"{name}.md"), "w", encoding="utf-8") as f:
    f.write(text + "\n")
  with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1, default=lambda o: np.asarray(o).tolist())


def _self_times(events, names) -> list[tuple[str, int]]:
  """(name, self picoseconds) of nested trace events on one line."""
  evs = sorted(events, key=lambda e: (e.offset_ps, -e.duration_ps))
  out, stack = [], []  # stack of [end, name, self]

  def close(until):
    while stack and stack[-1][0] <= until:
      end, name, own = stack.pop()
      out.append((name, own))

  for ev in evs:
    close(ev.offset_ps)
    if stack:
      stack[-1][2] -= ev.duration_ps
    stack.append([ev.offset_ps + ev.duration_ps,
                  names.get(ev.metadata_id, "?"), ev.duration_ps])
  close(float("inf"))
  return out


def profile_ops(fn: Callable[..., Any], *args, calls: int = 3,
                logdir: str = "/tmp/hypermixer_jax_profile", top: int = 12
                ) -> list[tuple[str, float, float]]:
  """Where ``fn``'s time goes: ``jax.profiler`` trace, summed by XLA op.

  Returns ``(op or fusion name, ms per call, share of the ops' total)``, the
  largest first. Times are self times: events nest on a trace line (the
  executor's event holds the ops, a fusion may hold sub-events), and each
  event is charged its duration less that of the events inside it. The trace (TensorBoard profile format) stays in ``logdir``.
  Reading it needs TensorFlow's ``xplane_pb2`` (installed with TF).
  """
  import glob  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(fn(*args))
  shutil.rmtree(logdir, ignore_errors=True)
  with jax.profiler.trace(logdir):
    for _ in range(calls):
      jax.block_until_ready(fn(*args))
  space = xplane_pb2.XSpace()
  path = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"),
                          recursive=True))[-1]
  with open(path, "rb") as f:
    space.ParseFromString(f.read())
  totals: dict[str, float] = {}
  skip = ("Thunk", "PjRt", "Execute", "jit_", "ThreadpoolListener", "$")
  for plane in space.planes:
    names = {k: v.name for k, v in plane.event_metadata.items()}
    for line in plane.lines:
      for name, ps in _self_times(line.events, names):
        if any(name.startswith(s) for s in skip) or " " in name:
          continue
        totals[name] = totals.get(name, 0.0) + ps / 1e9
  total = sum(totals.values()) or 1.0
  ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
  return [(k, v / calls, v / total) for k, v in ranked]
