"""Compiles a configuration for a TPU topology without owning one.

``main.py --mode=compile --topology=v5e:16x16 [--num_slices=2]`` (as MaxText's
``train_compile``): libtpu describes the topology's chips
(``jax.experimental.topologies.get_topology_desc``, compile-only devices),
the config's mesh is built on them (``sharding.build_mesh``: several slices
become an ICI x DCN hybrid mesh), the train state and the batch stay abstract
(``jax.ShapeDtypeStruct`` with their shardings; nothing is materialised) and
the loop's own train and eval steps are lowered and compiled by XLA:TPU.

``report`` reads the executables per chip: parameter and optimizer bytes,
XLA's temporaries, the total against the chip's HBM, FLOPs (XLA's count and
the matmul FLOPs of the traced step, ``flop_count``), the HBM traffic with
each transfer counted once (``hlo_costs.traffic``; XLA's ``bytes accessed``
beside it, which counts memory-space-assignment copies up to four times and
loop bodies once), where the bytes and FLOPs go by model part, the
collectives of the TPU HLO by kind with the bytes of their results, and a
roofline *estimate* of the step time (the largest of FLOPs at peak, HBM
traffic at HBM bandwidth, the bytes a chip sends in collectives at what it
can send over ICI, half the bidirectional figure: ``collective_traffic``,
and on several slices the bytes its share sends between slices at its share
of the hosts' DCN bandwidth: ``dcn_traffic``) and of the MFU that follows
(matmul FLOPs over the step at peak), with a batch to try where the per-chip batch holds
MFU down (``suggest_batch``). XLA's cost analysis reads a loop body once
(``count_loops``: scanned layers, chunked scans, XLA's windowed dot-general
loops under fsdp); the matmul count, the HBM traffic and the collectives
count each loop by its trip count, and of a ``conditional`` (gradient
accumulation's emit-or-hold step) the costliest branch. A configuration that
does not fit raises ``DoesNotFit``, naming the largest buffers (or, where
libtpu refuses to compile it, the state's share of its total) and the
largest batch that fits (``largest_batch``: halving, then bisection of
compiles), or ``eval_batch_size`` where only the eval step does not fit. Compile mode says
what it is doing (``stderr_progress``).

GPU: jax compiles for a GPU only through its CUDA plugin and a GPU target
description; neither runs without a GPU here, so only TPU topologies are
accepted.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.data import config as data_config
from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import evaluation
from hypermixer_jax.train import flop_count
from hypermixer_jax.train import hlo_costs
from hypermixer_jax.train import metrics as metrics_lib
from hypermixer_jax.train import optim
from hypermixer_jax.train import steps

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation, per chip (peak FLOP/s: ``metrics.PEAK_FLOPS``)."""
  name: str
  hbm_bytes: float
  hbm_bandwidth: float     # bytes/s
  ici_bandwidth: float     # bytes/s, bidirectional, all links of one chip
  # bytes/s a chip's share of its host's network sends between slices; None
  # where Cloud TPU publishes no figure.
  dcn_bandwidth: float | None = None

  @property
  def ici_egress(self) -> float:
    """Bytes/s one chip can send over all its links: half the
    bidirectional figure (the other half is what it receives)."""
    return self.ici_bandwidth / 2


# Cloud TPU's chip specifications, one page per generation; the dense bf16
# peaks are those of ``metrics.PEAK_FLOPS`` (the same pages). DCN: the data
# center network's bandwidth per chip, from the page's per-Pod or per-chip
# figure (bits/s / 8).
CHIPS: dict[str, Chip] = {
    # https://cloud.google.com/tpu/docs/v4: 32 GiB HBM2 at 1,200 GB/s. ICI:
    # 6 links of 45 GB/s each way (https://jax-ml.github.io/scaling-book/tpus/).
    # The page gives no DCN bandwidth.
    "v4": Chip("TPU v4", 32 * GIB, 1.2e12, 6 * 2 * 45e9),
    # https://cloud.google.com/tpu/docs/v5e: 16 GiB HBM2 at 819 GB/s, ICI
    # 400 GB/s bidirectional per chip; DCN 6.4 Tbps per 256-chip Pod (two
    # 100 Gbps NICs per 8-chip host): 25 Gbps per chip.
    "v5e": Chip("TPU v5e", 16 * GIB, 819e9, 400e9, 25e9 / 8),
    # https://cloud.google.com/tpu/docs/v5p: 95 GiB HBM2e at 2,765 GB/s, ICI
    # 1,200 GB/s bidirectional per chip; DCN 50 Gbps per chip.
    "v5p": Chip("TPU v5p", 95 * GIB, 2765e9, 1200e9, 50e9 / 8),
    # https://cloud.google.com/tpu/docs/v6e: 32 GiB HBM at 1,638 GB/s, ICI
    # 800 GB/s bidirectional per chip; DCN 25.6 Tbps per 256-chip Pod (four
    # 200 Gbps NICs per 8-chip host): 100 Gbps per chip.
    "v6e": Chip("TPU v6e", 32 * GIB, 1638e9, 800e9, 100e9 / 8),
}
# jax.Device.device_kind -> generation.
_KINDS = {"tpu v4": "v4", "tpu v5 lite": "v5e", "tpu v5e": "v5e",
          "tpu v5": "v5p", "tpu v5p": "v5p", "tpu v6 lite": "v6e",
          "tpu v6e": "v6e"}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute")
GPU_ANSWER = (
    "GPU meshes cannot be compiled here: jax compiles for a GPU without one "
    "only through its CUDA plugin (pip install -e '.[cuda12]') and a GPU "
    "target description, which this mode does not take; compile on a GPU "
    "host instead.")


class DoesNotFit(ValueError):
  """The configuration needs more HBM per chip than the topology's chips."""


def chip_of(device: Any) -> tuple[Chip, float]:
  """``(Chip, peak bf16 FLOP/s)`` of a TPU device."""
  kind = device.device_kind.lower()
  gen = _KINDS.get(kind)
  peak = metrics_lib.peak_flops(device.device_kind)
  if gen is None or peak is None:
    raise ValueError(f"no chip specifications for device kind "
                     f"{device.device_kind!r}; known: {sorted(_KINDS)}.")
  return CHIPS[gen], peak


def topology_devices(topology: str, num_slices: int = 1) -> list[Any]:
  """The compile-only devices of ``num_slices`` slices of ``topology``.

  ``topology``: libtpu's ``GENERATION:SHAPE`` (``v4:2x2x2``, ``v5e:16x16``,
  ``v5p:4x4x8``, ``v6e:16x16``); v4 chips count as one device each (megacore,
  as on a Cloud TPU VM).
  """
  gen = topology.split(":")[0].lower()
  if gen not in CHIPS:
    gpu = gen in ("gpu", "cuda", "rocm") or re.match(
        r"^(h100|h200|h20|b100|b200|gb200|a100|a10g?|l4|l40s?|v100|t4|mi\d+)",
        gen)
    hint = GPU_ANSWER if gpu else (
        "e.g. v4:2x2x1, v5e:4x4, v5p:2x2x2 or v6e:16x16")
    raise ValueError(f"--topology={topology!r}: generation {gen!r} is not "
                     f"one of {sorted(CHIPS)} ({hint}).")
  if num_slices < 1:
    raise ValueError(f"--num_slices={num_slices} must be >= 1.")
  # Several processes (pytest workers, a training job) may load libtpu.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from hypermixer_jax import runtime  # pylint: disable=g-import-not-at-top
  if not runtime.tpu_chips():
    # No TPU here: libtpu's start-up looks for this host's TPU type and
    # workers and prints an error-looking warning per missing one (above a
    # report that is fine). Described, as the topology asked for, they stay
    # quiet; on a TPU VM the runtime's own values are left alone.
    chips = math.prod(int(d) for d in re.findall(r"\d+", topology.split(
        ":", 1)[-1])) if ":" in topology else 1
    accel = {"v4": f"v4-{2 * chips}", "v5e": f"v5litepod-{chips}",
             "v5p": f"v5p-{2 * chips}", "v6e": f"v6e-{chips}"}[gen]
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accel)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  kwargs = {"chip_config_name": "megacore"} if gen == "v4" else {}
  try:
    desc = topologies.get_topology_desc(
        topology_name=topology, platform="tpu", num_slices=num_slices,
        **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    import importlib.util  # pylint: disable=g-import-not-at-top
    fix = ("install the TPU runtime with pip install -e '.[tpu]' -c "
           "constraints.txt" if importlib.util.find_spec("libtpu") is None
           else f"give a {gen} slice shape of Cloud TPU's {gen} page "
           "(v5e:2x4, v5e:16x16, v4:2x2x2, v5p:4x4x8, ...)")
    raise ValueError(
        f"--topology={topology!r} --num_slices={num_slices}: libtpu could "
        f"not describe it ({str(e).splitlines()[0][:200]}); {fix}.") from e
  return list(desc.devices)


def abstract_batch(config: ml_collections.ConfigDict, batch_size: int
                   ) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch of ``config``'s task as shapes (CONTRIBUTING.md)."""
  mc, head = config.model, models.model_facts(config.model).head
  kind = heads.get(head).kind
  s, i32, f32 = jax.ShapeDtypeStruct, np.int32, np.float32
  b = batch_size
  if mc.family == "continuous":
    n = mc.max_len
    out = {"inputs": s((b, n, mc.input_dim), f32)}
  else:
    n = (config.data.synthetic.seq_len if config.data.task == "synthetic_pairs"
         else config.data.seq_len)
    out = {k: s((b, n), i32) for k in ("inputs", "segment_ids", "positions")}
    if mc.get("type_vocab_size", 0) and kind == "classes":
      out["token_type_ids"] = s((b, n), i32)
  if kind == "classes":
    out["label"] = s((b,), i32)
  elif kind == "values":
    out["targets"] = s((b, n, mc.out_dim), f32)
    out["weights"] = s((b, n), f32)
  else:
    out["targets"], out["weights"] = s((b, n), i32), s((b, n), f32)
  if head == "mlm":
    p = data_config.max_predictions(n, config.data.mlm.select_rate)
    out["masked_positions"] = s((b, p), i32)
  return out


@dataclasses.dataclass
class Compiled:
  """The compiled steps and what they were compiled for."""
  train: Any
  eval: Any
  state: Any                   # abstract TrainState (shapes + shardings)
  mesh: jax.sharding.Mesh
  batch_size: int
  # Matmul FLOPs of the traced train step (whole program; loops by trip
  # count: ``flop_count``).
  matmul: flop_count.FlopCount | None = None


def trace_train_step(config: ml_collections.ConfigDict, devices: list[Any],
                     batch_size: int | None = None):
  """``(traced train step, abstract state, mesh, rules, model, facts)`` on
  ``devices``: the loop's own step traced over abstract inputs (no compile;
  ``flop_count.count(traced.jaxpr)`` is its matmul work)."""
  mesh = sharding.build_mesh(config.mesh, devices)
  rules = sharding.get_rules(config.sharding)
  # Inside the target mesh, ``model.dtype='auto'`` resolves for its devices
  # (bfloat16 on TPU), not for this host's CPU.
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    model, facts = models.build_model(config.model), models.model_facts(
        config.model)
  spec = abstract_batch(config, int(batch_size or config.batch_size))
  tx, _ = optim.make_optimizer(config, steps.param_shapes(model, spec))
  state, state_sh = steps.abstract_train_state(model, tx, spec, mesh, rules)
  try:
    batch_sh = sharding.batch_shardings(spec, mesh, rules)
  except ValueError as e:
    raise ValueError(f"batch_size={spec['inputs'].shape[0]}: {e} Set "
                     "--config.batch_size to a multiple of it.") from e
  traced = steps.jit_train_step(
      steps.make_train_step(model, facts.head,
                            loss_weights=facts.loss_weights),
      state_sh, batch_sh, mesh, rules).trace(
          state, ckpt_lib.abstract_like(spec, batch_sh),
          jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                               sharding=jax.NamedSharding(mesh, jax.P())))
  return traced, (state, state_sh), mesh, rules, model, facts


def stderr_progress(start: float | None = None) -> Callable[[str], None]:
  """A progress callback that prints ``compile: <what> (<elapsed> s)`` to
  stderr: compile mode is otherwise silent for minutes."""
  t0 = time.perf_counter() if start is None else start

  def say(what: str) -> None:
    print(f"compile: {what} ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr, flush=True)
  return say


def compile_steps(config: ml_collections.ConfigDict, devices: list[Any], *,
                  batch_size: int | None = None, with_eval: bool = True,
                  progress: Callable[[str], None] | None = None
                  ) -> Compiled:
  """Lowers and compiles the loop's train (and eval) step on ``devices``;
  ``progress(what)`` is told each phase as it begins."""
  say = progress or (lambda _: None)
  b = int(batch_size or config.batch_size)
  say(f"tracing the train step at global batch {b} on {len(devices)} "
      f"{devices[0].device_kind} chips")
  traced, (state, state_sh), mesh, rules, model, facts = trace_train_step(
      config, devices, b)
  if with_eval:
    # Checked before the train step's compile (minutes): an eval batch the
    # mesh cannot split stops now, naming the field.
    espec = abstract_batch(config, int(config.eval_batch_size))
    try:
      esh = sharding.batch_shardings(espec, mesh, rules)
    except ValueError as e:
      raise ValueError(f"eval_batch_size={config.eval_batch_size}: {e} Set "
                       "--config.eval_batch_size to a multiple of it.") from e
  say("lowering the train step to HLO")
  lowered = traced.lower()
  say("compiling the train step with XLA:TPU (minutes for a large model)")
  train = lowered.compile()
  ev = None
  if with_eval:
    say("compiling the eval step")
    try:
      ev = steps.jit_eval_step(
          evaluation.make_eval_step(model, facts.head,
                                    loss_weights=facts.loss_weights),
          state_sh, esh, mesh, rules).lower(
              state, ckpt_lib.abstract_like(espec, esh)).compile()
    except Exception as e:  # pylint: disable=broad-except
      refused = hbm_refusal(e)
      if refused is None:
        raise
      raise DoesNotFit(eval_does_not_fit(
          config, refused[0], refused[1], batch_step(mesh, rules),
          _per_chip_bytes(state.params))) from None
  say("counting matmul FLOPs and HBM traffic")
  return Compiled(train, ev, state, mesh, b,
                  flop_count.count(traced.jaxpr))


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
                "u64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\]")

def shape_bytes(hlo_type: str) -> int:
  """Bytes of an HLO result type (an array or a tuple of arrays)."""
  total = 0
  for dtype, dims in _SHAPE.findall(hlo_type):
    size = _DTYPE_BYTES.get(dtype, 1)
    total += size * math.prod(int(d) for d in dims.split(",") if d)
  return total


_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9, ]*)\}")
_GROUPS_EMPTY = re.compile(r"replica_groups=\{\}")
_OP_LINE = re.compile(r"^\s*(?:ROOT\s+)?(%?\S+) = (.+?) (" + "|".join(COLLECTIVES)
                      + r")(-start|-done)?\(([^)]*)\)(.*)$")


def group_size(attributes: str, devices: int) -> int:
  """Participants of each group of a collective's ``replica_groups``, in
  the forms XLA prints: ``mesh['a'=16,'b'=1] {'a'}`` (the named axes'
  sizes multiplied), ``[groups,size]<=[...]``, ``{{0,1,2,3},...}``, and
  ``{}`` or no attribute (every device)."""
  m = _GROUPS_MESH.search(attributes)
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'",
                                                       m.group(2)))
  m = _GROUPS_IOTA.search(attributes)
  if m:
    return int(m.group(1).split(",")[-1])
  m = _GROUPS_LIST.search(attributes)
  if m:
    return len([x for x in m.group(1).split(",") if x.strip()])
  return devices


def traffic_factor(kind: str, n: int) -> float:
  """Bytes one chip sends per byte of the op's result, for ring-like
  algorithms over a group of ``n``: an all-gather or all-to-all sends the
  (n-1)/n of the result it does not hold, an all-reduce twice that (a
  reduce-scatter, then an all-gather), a reduce-scatter (n-1) times its
  result (the input is n results), a collective-permute its result."""
  if n <= 1:
    return 0.0
  return {"all-gather": (n - 1) / n, "all-to-all": (n - 1) / n,
          "all-reduce": 2 * (n - 1) / n, "reduce-scatter": float(n - 1),
          "collective-permute": 1.0}[kind]


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_WHILE = re.compile(r"^\s*(?:ROOT\s+)?%?\S+ = .* while\(", re.M)
loop_multipliers = hlo_costs.loop_multipliers
trip_count = hlo_costs.trip_count


def _collective_lines(hlo_text: str):
  """``(multiplier, match)`` of each collective op line, the multiplier being
  how often its computation runs per step (``loop_multipliers``)."""
  times, _ = loop_multipliers(hlo_text, "collectives")
  current = None            # lines outside a computation: once
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = header.group(1)
    elif line.startswith("}"):
      current = None
    elif (m := _OP_LINE.match(line)) and (current is None
                                          or current in times):
      # A computation that never runs (a conditional's branch not counted)
      # is not in ``times``.
      yield times.get(current, 1), m


def collective_traffic(hlo_text: str, devices: int) -> dict[str, float]:
  """``{kind: bytes one chip sends}`` of the collectives in an HLO module:
  each op's result bytes times ``traffic_factor`` of its group size
  (``group_size``; an asynchronous pair's group read from its ``-start``),
  times the runs of its computation per step (loops by trip count)."""
  out = {k: 0.0 for k in COLLECTIVES}
  started = {}
  for times, m in _collective_lines(hlo_text):
    name, hlo_type, kind, phase, operands, rest = m.groups()
    if phase == "-start":
      started[name.lstrip("%")] = group_size(rest, devices)
      continue
    n = (started.get(operands.strip().lstrip("%"), devices)
         if phase == "-done" else group_size(rest, devices))
    out[kind] += times * shape_bytes(hlo_type) * traffic_factor(kind, n)
  return out


# Bytes a chip's host sends over the data center network per byte of the
# buffer a cross-slice transfer sends, for ring-like algorithms over ``n``
# slices (``traffic_factor`` counts per byte of the result instead).
_DCN_FACTOR = {"ALL_REDUCE": lambda n: 2 * (n - 1) / n,
               "ALL_GATHER": lambda n: float(n - 1),
               "REDUCE_SCATTER": lambda n: (n - 1) / n,
               "ALL_TO_ALL": lambda n: (n - 1) / n}
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')


def dcn_traffic(hlo_text: str, slices: int) -> float:
  """Bytes one chip's share sends between slices per step: on several
  slices XLA:TPU hands the cross-slice part of a collective to the host as
  a ``send`` marked ``_xla_megascale_transfer_type`` (``ALL_REDUCE`` for the
  gradients' reduction over the slices), whose first operand is the chip's
  buffer; its bytes times ``_DCN_FACTOR`` of the transfer over ``slices``
  (1 for a plain transfer), loops by trip count. 0 on one slice."""
  if slices <= 1:
    return 0.0
  times, _ = loop_multipliers(hlo_text, "collectives")
  mod = hlo_costs.parse(hlo_text)
  total = 0.0
  for comp, body in mod.comps.items():
    for i in body:
      kind = _MEGASCALE.search(i.attrs) if i.opcode == "send" else None
      if kind is None or comp not in times:
        continue
      buffer = _SHAPE.findall(i.type)[0]
      total += times[comp] * shape_bytes(
          f"{buffer[0]}[{buffer[1]}]") * _DCN_FACTOR.get(
              kind.group(1), lambda n: 1.0)(slices)
  return total


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
  """``{kind: (ops run, result bytes)}`` of the collectives in an HLO module
  per step: asynchronous pairs count once (their ``-done`` result), an op in
  a loop body as often as the loop runs (``loop_multipliers``). Kinds are as
  XLA wrote them: on some topologies (v5p-128, v6e-256) XLA:TPU gathers fsdp
  parameters by all-reducing zero-padded shards, so the gathers show under
  ``all-reduce`` (experiments/README.md, pod plan).
  """
  out = {k: (0, 0) for k in COLLECTIVES}
  for times, m in _collective_lines(hlo_text):
    _, hlo_type, op, phase, _, _ = m.groups()
    if phase == "-start":
      continue
    n, size = out[op]
    out[op] = (n + times, size + times * shape_bytes(hlo_type))
  return out


def count_loops(hlo_text: str) -> int:
  """``while`` ops in an HLO module: scanned layers (``model.scan_layers``),
  chunked scans (causal HyperMixing, block-wise attention) and the loops
  XLA's TPU SPMD pass makes of sharded weight-gradient dots (windowed
  dot-general, one step per collective-permute). XLA's cost analysis reads
  each loop body once, whatever its trip count; ``collectives`` and
  ``collective_traffic`` count them by trip count."""
  return len(_WHILE.findall(hlo_text))


def _per_chip_bytes(tree: Any) -> int:
  return sum(
      math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
      for x in jax.tree.leaves(tree))


def _cost_analysis(compiled) -> dict[str, float]:
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  return analysis or {}


def _flops_and_bytes(compiled) -> tuple[float, float]:
  analysis = _cost_analysis(compiled)
  return (float(analysis.get("flops", 0.0)),
          float(analysis.get("bytes accessed", 0.0)))


def _short_op_name(op_name: str) -> str:
  """An op_name without the jit wrapper, module paths from the model."""
  name = re.sub(r"^jit\([^)]*\)/", "", op_name)
  return name if len(name) <= 90 else "..." + name[-87:]


def largest_buffers(hlo_text: str, k: int = 3) -> list[tuple[int, str]]:
  """The ``k`` largest distinct array results in an HLO module (per chip)."""
  found = {}
  for dtype, dims in _SHAPE.findall(hlo_text):
    name = f"{dtype}[{dims}]"
    found[name] = shape_bytes(name)
  return sorted(((b, n) for n, b in found.items()), reverse=True)[:k]


def roofline(flops: float, accessed: float, traffic: float, chip: Chip,
             peak: float, dcn: float | None = None
             ) -> tuple[dict[str, float], float, float]:
  """(seconds of each bound, estimated step seconds, estimated MFU): FLOPs
  at the chip's peak, bytes accessed at its HBM bandwidth, the bytes a chip
  sends in collectives at what it can send over ICI (``Chip.ici_egress``)
  and, given ``dcn`` bytes and where the chip's DCN bandwidth is published,
  the bytes its share sends between slices at that bandwidth; the step is
  the largest."""
  times = {"compute": flops / peak, "hbm": accessed / chip.hbm_bandwidth,
           "collectives": traffic / chip.ici_egress}
  if dcn is not None and chip.dcn_bandwidth:
    times["dcn"] = dcn / chip.dcn_bandwidth
  step = max(times.values())
  return times, step, (flops / peak / step if step else 0.0)


def estimate(r: dict[str, Any], traffic: float | None = None
             ) -> tuple[dict[str, float], float, float]:
  """``roofline`` of a report ``r`` (or a recorded one): the compute term
  from the larger of XLA's FLOPs and the matmul FLOPs (loops by their trip
  counts), the HBM term from the HBM traffic counted once
  (``hlo_costs.traffic``; XLA's ``bytes accessed`` for records without it),
  MFU from the matmul FLOPs (XLA's for records without them); ``traffic``
  replaces the recorded collective bytes. A DCN term where the record has
  several slices and their DCN bytes (``dcn_traffic``); a record compiled
  before they were counted has none (``dcn_uncounted``)."""
  chip = next(c for c in CHIPS.values() if c.name == r["chip"])
  peak = metrics_lib.peak_flops(r["chip"])
  matmul = r.get("matmul_flops") or 0.0
  times, step, _ = roofline(
      max(r["flops"], matmul), r.get("hbm_traffic_bytes",
                                     r["bytes_accessed"]),
      r["collective_traffic_bytes"] if traffic is None else traffic, chip,
      peak, r.get("dcn_traffic_bytes") if r.get("slices", 1) > 1 else None)
  return times, step, ((matmul or r["flops"]) / peak / step if step else 0.0)


def dcn_uncounted(r: dict[str, Any], slices: int | None = None
                  ) -> str | None:
  """Why a record of several slices (``slices``, else its own) has no DCN
  term in its estimate (its compile predates the count, or Cloud TPU
  publishes no DCN bandwidth for its chip); None where it has one or needs
  none."""
  if (slices or r.get("slices", 1)) <= 1:
    return None
  if "dcn_traffic_bytes" not in r:
    return "compiled before the cross-slice transfers were counted"
  chip = next(c for c in CHIPS.values() if c.name == r["chip"])
  if not chip.dcn_bandwidth:
    return f"Cloud TPU publishes no DCN bandwidth for {chip.name}"
  return None


def report(c: Compiled) -> dict[str, Any]:
  """Per-chip figures of the compiled steps (see the module docstring)."""
  chip, _ = chip_of(c.mesh.devices.flat[0])
  mem = c.train.memory_analysis()
  params = _per_chip_bytes(c.state.params)
  opt = _per_chip_bytes(c.state.opt_state)
  # Donated state aliases the outputs: arguments + temporaries + outputs that
  # are not aliased is what the step holds at once.
  total = (mem.argument_size_in_bytes + mem.temp_size_in_bytes
           + mem.output_size_in_bytes - mem.alias_size_in_bytes)
  analysis = _cost_analysis(c.train)
  flops, accessed = _flops_and_bytes(c.train)
  hlo = c.train.as_text()
  coll = collectives(hlo)
  comm = sum(collective_traffic(hlo, c.mesh.size).values())
  slices = len({getattr(d, "slice_index", 0) or 0
                for d in c.mesh.devices.flat})
  dcn = dcn_traffic(hlo, slices)
  hbm = hlo_costs.traffic(hlo)
  # XLA's count reads loop bodies once; the jaxpr's matmul count does not.
  matmul = c.matmul.flops / c.mesh.size if c.matmul else 0.0
  times, step, mfu = estimate(dict(chip=chip.name, flops=flops,
                                   matmul_flops=matmul,
                                   bytes_accessed=accessed,
                                   hbm_traffic_bytes=hbm.hbm_bytes,
                                   collective_traffic_bytes=comm,
                                   slices=slices, dcn_traffic_bytes=dcn))
  optimal = float(analysis.get("optimal_seconds", -1.0))
  out = {
      "chip": chip.name, "chips": c.mesh.size, "slices": slices,
      "mesh": dict(c.mesh.shape),
      "batch_size": c.batch_size,
      "params": sum(x.size for x in jax.tree.leaves(c.state.params)),
      "param_bytes": params, "opt_bytes": opt,
      "argument_bytes": mem.argument_size_in_bytes,
      "temp_bytes": mem.temp_size_in_bytes, "total_bytes": total,
      "hbm_bytes": chip.hbm_bytes, "fits": total <= chip.hbm_bytes,
      "flops": flops, "bytes_accessed": accessed, "matmul_flops": matmul,
      "hbm_traffic_bytes": hbm.hbm_bytes,
      "xla_rule_bytes": hbm.xla_bytes,
      "async_moves_xla_bytes": hbm.moves_xla_bytes,
      # XLA:TPU's own step estimate; negative where it has none.
      "xla_optimal_s": optimal if optimal > 0 else None,
      "hbm_bytes_by_part": {k: v for k, v in hbm.by_part.items() if v},
      "matmul_flops_by_part": {
          k: v / c.mesh.size for k, v in c.matmul.by_part.items() if v}
                              if c.matmul else {},
      "top_instructions": [
          [it.hbm_bytes, it.xla_bytes, it.opcode, it.part,
           _short_op_name(it.op_name), it.runs] for it in hbm.top(8)],
      "collectives": {k: list(v) for k, v in coll.items()},
      "collective_traffic_bytes": comm, "dcn_traffic_bytes": dcn,
      "est_step_s": step, "est_limit": max(times, key=times.get),
      "est_times_s": times, "est_mfu": mfu,
      "largest_buffers": largest_buffers(hlo),
      "loops": count_loops(hlo),
      # The same loops seen in the jaxpr (matmul FLOPs) and in the HLO.
      "uncounted_loops": max(c.matmul.uncounted_loops if c.matmul else 0,
                             loop_multipliers(hlo)[1]),
  }
  if c.eval is not None:
    emem = c.eval.memory_analysis()
    out["eval_total_bytes"] = (emem.argument_size_in_bytes
                               + emem.temp_size_in_bytes
                               + emem.output_size_in_bytes)
    out["eval_flops"] = _flops_and_bytes(c.eval)[0]
  return out


def batch_step(mesh: jax.sharding.Mesh, rules: sharding.Rules) -> int:
  """How many devices share the batch axis: the global batch's granularity."""
  axes = nn.logical_to_mesh_axes(("batch",), rules)[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def largest_batch(fits: Callable[[int], bool], start: int, step: int
                  ) -> int:
  """The largest multiple of ``step`` below ``start`` (which does not fit)
  for which ``fits``.

  Halves until a batch fits, then bisects between it and the smallest that
  did not; 0 when not even ``step`` fits.
  """
  lo, hi = 0, -(-start // step)       # hi * step: known not to fit
  b = hi // 2
  while b >= 1:
    if fits(b * step):
      lo = b
      break
    hi, b = b, b // 2
  if lo == 0:
    return 0
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
  return lo * step


def _gib(x: float) -> str:
  for unit, size in (("GiB", GIB), ("MiB", 2**20)):
    if x >= size:
      return f"{x / size:.2f} {unit}"
  return f"{x / 1024:.1f} KiB"


def breakdown(r: dict[str, Any], k: int = 6) -> list[str]:
  """Where a step's bytes and FLOPs go: HBM traffic counted once beside
  XLA's ``bytes accessed``, by model part, and the largest transfers."""
  if "hbm_traffic_bytes" not in r:
    return []
  lines = [
      f"HBM traffic per chip, each transfer once (loops by trip count): "
      f"{_gib(r['hbm_traffic_bytes'])}; XLA's bytes accessed "
      f"{_gib(r['bytes_accessed'])} counts every operand and result in any "
      f"memory space (async copies and slices into on-chip memory: "
      f"{_gib(r['async_moves_xla_bytes'])} of it) and loop bodies once"]
  if r.get("xla_optimal_s"):
    lines.append(f"XLA:TPU's own step estimate (optimal_seconds; it sums "
                 f"each instruction's bottleneck, phantom copy bytes "
                 f"included): {r['xla_optimal_s'] * 1e3:.2f} ms")
  flops = r.get("matmul_flops_by_part", {})
  hbm = r.get("hbm_bytes_by_part", {})
  parts = sorted(set(flops) | set(hbm), key=lambda p: -hbm.get(p, 0.0))
  lines.append("by part (HBM traffic / matmul FLOPs per chip): " + ", ".join(
      f"{p} {_gib(hbm.get(p, 0.0))} / {flops.get(p, 0.0) / 1e12:.3f} TFLOP"
      for p in parts))
  lines.append("largest HBM transfers (bytes per step, XLA's count, "
               "instruction, part, op_name):")
  for b, xla, opcode, part, name, runs in r["top_instructions"][:k]:
    lines.append(f"  {_gib(b)} (XLA {_gib(xla)}) {opcode}"
                 + (f" x{runs}" if runs > 1 else "")
                 + f" [{part}] {name or '(no op_name)'}")
  return lines


def suggest_batch(r: dict[str, Any]) -> tuple[int, float, float, float]:
  """``(batch, its estimated MFU, the MFU now, the MFU at any batch)``:
  the smallest power-of-two multiple of the global batch that reaches 90%
  of the MFU a larger batch could give (within the batch that fits,
  extrapolated linearly from the temporaries). Assumes the optimizer's HBM
  traffic and the collectives stay fixed while the rest grows with the
  batch (the layers' parameter reads stay fixed too: the gain is at least
  this)."""
  chip = next(c for c in CHIPS.values() if c.name == r["chip"])
  peak = metrics_lib.peak_flops(r["chip"])
  b = r["batch_size"]
  fixed = r.get("hbm_bytes_by_part", {}).get("optimizer", 0.0)
  per_hbm = max(r["hbm_traffic_bytes"] - fixed, 0.0) / b
  per_flops = max(r["flops"], r["matmul_flops"]) / b
  share = r["matmul_flops"] / max(r["flops"], r["matmul_flops"])
  ici = r["collective_traffic_bytes"] / chip.ici_egress
  if r.get("slices", 1) > 1 and chip.dcn_bandwidth:
    ici = max(ici, r.get("dcn_traffic_bytes", 0.0) / chip.dcn_bandwidth)

  def mfu(batch: float) -> float:
    compute = per_flops * batch / peak
    return share * compute / max(compute, (fixed + per_hbm * batch)
                                 / chip.hbm_bandwidth, ici)

  ceiling = share * min(1.0, per_flops / peak / (
      per_hbm / chip.hbm_bandwidth)) if per_hbm else share
  room = chip.hbm_bytes - (r["total_bytes"] - r["temp_bytes"])
  largest = b * room / r["temp_bytes"] if r["temp_bytes"] else 0.0
  best = b
  while best * 2 <= largest and mfu(best) < 0.9 * ceiling:
    best *= 2
  return best, mfu(best), mfu(b), ceiling


def batch_advice(r: dict[str, Any]) -> str | None:
  """A global batch that lifts the estimated MFU where the per-chip batch
  is what holds it down (``suggest_batch``), or what bounds MFU instead
  where a larger batch does not help; None where MFU is not low."""
  if "hbm_traffic_bytes" not in r or not r.get("matmul_flops"):
    return None
  b = r["batch_size"]
  best, better, now, ceiling = suggest_batch(r)
  per_chip = f"{b / r['chips']:g} examples per chip"
  if best > b and better >= 1.25 * now:
    return (f"the per-chip batch ({per_chip}) holds MFU down: the "
            f"optimizer's HBM traffic and the collectives do not grow with "
            f"the batch; --config.batch_size={best} (about "
            f"{best / r['chips']:g} per chip, within the batch estimated to "
            f"fit) gives an estimated MFU of {better:.0%} (now {now:.0%}; "
            f"at most {ceiling:.0%} at any batch)")
  if now < 0.4:
    top = max(r.get("hbm_bytes_by_part", {"other": 0}).items(),
              key=lambda kv: kv[1])[0]
    return (f"not the batch ({per_chip}): the traffic that grows with the "
            f"batch bounds MFU at {ceiling:.0%} whatever the batch (matmul "
            f"FLOPs per HBM byte of this model's width and dtype; most of "
            f"the bytes: {top}); see the breakdown above")
  return None


def _dcn_lines(r: dict[str, Any]) -> list[str]:
  """The cross-slice line of a report of several slices."""
  if r.get("slices", 1) <= 1:
    return []
  chip = next(c for c in CHIPS.values() if c.name == r["chip"])
  why = dcn_uncounted(r)
  return [f"between the {r['slices']} slices (DCN, through the hosts) a "
          f"chip's share sends {_gib(r.get('dcn_traffic_bytes', 0.0))} per "
          "step" + (f"; not in the estimate: {why}" if why else
                    f" at {chip.dcn_bandwidth * 8 / 1e9:g} Gbit/s per chip")]


def format_report(r: dict[str, Any]) -> str:
  """The printed report (one chip)."""
  coll = ", ".join(f"{k} {n} ({_gib(b)})" for k, (n, b) in
                   r["collectives"].items() if n)
  lines = [
      f"{r['chips']} x {r['chip']}, mesh {r['mesh']}, global batch "
      f"{r['batch_size']}, {r['params'] / 1e6:.1f}M parameters",
      f"per chip: parameters {_gib(r['param_bytes'])}, optimizer "
      f"{_gib(r['opt_bytes'])}, arguments {_gib(r['argument_bytes'])}, "
      f"temporaries {_gib(r['temp_bytes'])}",
      f"per chip total {_gib(r['total_bytes'])} of {_gib(r['hbm_bytes'])} "
      f"HBM: {'fits' if r['fits'] else 'DOES NOT FIT'}",
      f"train step per chip: {r['flops'] / 1e12:.3f} TFLOP (XLA), "
      f"{r.get('matmul_flops', 0) / 1e12:.3f} TFLOP of matmuls (jaxpr, loops "
      f"by trip count), {_gib(r['bytes_accessed'])} accessed (XLA)",
      *breakdown(r),
      f"collectives per step (ops run, loop bodies by trip count; result "
      f"bytes): {coll or 'none'}; a chip sends "
      f"{_gib(r['collective_traffic_bytes'])} over ICI",
      *_dcn_lines(r),
      f"estimate (roofline, not a measurement): step {r['est_step_s'] * 1e3:.2f}"
      f" ms, bound by {r['est_limit']}, MFU {r['est_mfu']:.0%} (matmul FLOPs "
      "at the chip's peak over the step; with model.remat the recomputed "
      "ones count too)",
  ]
  advice = batch_advice(r)
  if advice:
    lines.append("MFU: " + advice)
  if r.get("loops"):
    lines.append(
        f"note: the step holds {r['loops']} while loop(s) (scanned layers, "
        "chunked scans, XLA's windowed dot-general loops of sharded weight "
        "gradients, data-dependent loops such as Base Layers' assignment), "
        "whose bodies XLA's cost analysis (FLOPs, bytes "
        "accessed) reads once whatever their trip count; the HBM traffic, "
        "matmul FLOPs, MFU and collectives count each loop by its trip count"
        + (f", except {r['uncounted_loops']} loop(s) of unknown trip count"
           if r.get("uncounted_loops") else "") + ".")
  if "eval_total_bytes" in r:
    lines.append(f"eval step per chip: total {_gib(r['eval_total_bytes'])}, "
                 f"{r['eval_flops'] / 1e12:.3f} TFLOP")
  return "\n".join(lines)


def fit_advice(config: ml_collections.ConfigDict, r: dict[str, Any],
               best: int) -> str:
  """What would fit, for ``DoesNotFit``: the largest batch found (or
  sharding), and remat where the temporaries outweigh the state and the
  state alone leaves room (``r``: the report's byte figures)."""
  state = r["param_bytes"] + r["opt_bytes"]
  fix = (f"--config.batch_size={best} fits (with grad_accum_steps for the "
         "same effective batch)" if best else
         "no batch fits: shard the parameters (--config.sharding.rules=fsdp "
         "--config.mesh.fsdp=-1) or use more chips")
  if state >= r.get("hbm_bytes", math.inf):
    return (fix + f"; the parameters and optimizer state alone "
            f"({_gib(state)} per chip) exceed a chip's HBM")
  if config.model.get("remat", "") == "none" and r["temp_bytes"] > state:
    # Activations dominate: recomputing them is the other way to fit.
    fix += ("; or keep the batch and recompute the layers' activations in "
            "the backward pass: --config.model.remat=full (fewer "
            "temporaries, about a third more matmul work)")
  return fix


_REFUSED = re.compile(
    r"RESOURCE_EXHAUSTED: Ran out of memory on HBM.*?HLO temporaries "
    r"\(([0-9.]+)([KMGT])\) exceeds available HBM \(([0-9.]+)([KMGT])\)")
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def hbm_refusal(error: Exception) -> tuple[float, float] | None:
  """``(total, available HBM)`` bytes when ``error`` is libtpu's refusal to
  compile a program that needs more than a chip's HBM (it gives no buffer
  list then; it calls the total "HLO temporaries", but a bare ``x * 2`` of
  an 8 GiB input is refused at 15.9 GiB: arguments and outputs are in it);
  None for any other error."""
  m = _REFUSED.search(str(error))
  if m is None:
    return None
  return (float(m.group(1)) * _UNIT[m.group(2)],
          float(m.group(3)) * _UNIT[m.group(4)])


def eval_does_not_fit(config: ml_collections.ConfigDict, need: float,
                      hbm: float, step: int, params: float) -> str:
  """``DoesNotFit``'s message where the eval step does not fit: the field
  to lower is ``eval_batch_size``, to about the batch whose activations
  (what grows with it: ``need`` less the ``params``) fill the HBM left
  beside the parameters (a multiple of ``step``)."""
  b = int(config.eval_batch_size)
  per_example = max(need - params, 1.0) / b
  smaller = int(max(hbm - params, 0.0) / per_example) // step * step
  fix = (f"set --config.eval_batch_size to about {smaller} (a multiple of "
         f"{step}, estimated from this compile)" if smaller >= step else
         "the parameters alone leave no room: shard them "
         "(--config.sharding.rules=fsdp --config.mesh.fsdp=-1)")
  return (f"the eval step at eval_batch_size={b} needs {_gib(need)} per "
          f"chip ({_gib(hbm)} HBM, parameters {_gib(params)}): {fix}.")


def try_report(config: ml_collections.ConfigDict, devices: list[Any], **kw
               ) -> tuple[dict[str, Any] | None, tuple[float, float] | None]:
  """``(report, None)`` of ``compile_steps(config, devices, **kw)``, or
  ``(None, hbm_refusal)`` where libtpu refused to compile it; any other
  error propagates."""
  try:
    return report(compile_steps(config, devices, **kw)), None
  except Exception as e:  # pylint: disable=broad-except
    refused = hbm_refusal(e)
    if refused is None:
      raise
    return None, refused


def compile_for_topology(config: ml_collections.ConfigDict, topology: str,
                         num_slices: int = 1,
                         progress: Callable[[str], None] | None = None
                         ) -> dict[str, Any]:
  """Compiles ``config`` for the topology and returns ``report``'s figures,
  saying what it is doing (``progress``; default: ``stderr_progress``).

  The config is validated as training validates it first
  (``config_checks``). Raises ``DoesNotFit`` (largest buffers, the largest
  batch that fits) when the train step needs more HBM than a chip has, also
  where libtpu refuses to compile it at all (its total alone exceeds the
  HBM), and naming ``eval_batch_size`` where only the eval step does not
  fit.
  """
  from hypermixer_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  config_checks.validate(config)
  config_checks.check_model(config.model)
  say = progress or stderr_progress()
  say(f"describing {topology} x {num_slices} slice(s) with libtpu")
  devices = topology_devices(topology, num_slices)
  r, refused = try_report(config, devices, progress=say)
  if refused is None and r["fits"]:
    if r.get("eval_total_bytes", 0) > r["hbm_bytes"]:
      mesh = sharding.build_mesh(config.mesh, devices)
      raise DoesNotFit(eval_does_not_fit(
          config, r["eval_total_bytes"], r["hbm_bytes"],
          batch_step(mesh, sharding.get_rules(config.sharding)),
          r["param_bytes"]))
    return r
  b0 = int(config.batch_size)

  def fits(b):
    say(f"batch {b0} does not fit; trying {b}")
    rb, _ = try_report(config, devices, batch_size=b, with_eval=False,
                       progress=say)
    return rb is not None and rb["fits"]

  best = largest_batch(fits, b0, batch_step(
      sharding.build_mesh(config.mesh, devices),
      sharding.get_rules(config.sharding)))
  head = f"{config.model.family} model at batch {b0} needs "
  if refused is not None:
    total, hbm = refused
    # libtpu's figure holds the arguments (the state) and outputs too; the
    # state's share comes from the abstract state (traced, not compiled).
    _, (state, _), *_ = trace_train_step(config, devices, b0)
    params = _per_chip_bytes(state.params)
    opt = _per_chip_bytes(state.opt_state)
    raise DoesNotFit(
        f"{head}{_gib(total)} per chip on {topology} ({_gib(hbm)} HBM "
        f"available; libtpu's total, which refused to compile it, so there "
        f"is no buffer list): parameters {_gib(params)}, optimizer "
        f"{_gib(opt)}, the rest activations and temporaries. " + fit_advice(
            config, {"temp_bytes": max(total - params - opt, 0.0),
                     "param_bytes": params, "opt_bytes": opt,
                     "hbm_bytes": hbm}, best) + ".")
  bufs = ", ".join(f"{n} ({_gib(b)})" for b, n in r["largest_buffers"])
  raise DoesNotFit(
      f"{head}{_gib(r['total_bytes'])} per chip on {topology} ({_gib(r['hbm_bytes'])}"
      f" HBM): parameters {_gib(r['param_bytes'])}, optimizer "
      f"{_gib(r['opt_bytes'])}, temporaries {_gib(r['temp_bytes'])}; largest "
      f"buffers {bufs}. {fit_advice(config, r, best)}.")
