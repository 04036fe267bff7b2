"""Matmul FLOPs of a traced program, loops counted by their trip counts.

XLA's cost analysis (``compiled.cost_analysis()``) reads the body of every
``while`` loop once: a scanned layer stack (``model.scan_layers``), a chunked
scan, and the loops XLA's TPU SPMD pass makes of sharded weight-gradient dots
(windowed dot-general) are all under-counted. This module counts on the
jaxpr instead, before XLA rewrites anything:

* ``dot_general``: 2 x (output elements) x (contracted size);
  ``conv_general_dilated``: 2 x (output elements) x (kernel input features x
  kernel window);
* ``scan`` bodies times their ``length``; ``cond``: the costliest branch;
* ``shard_map`` bodies (per-shard shapes) times the devices over its manual
  axes, so that the total is the whole program's;
* any other sub-jaxpr (``jit``, ``remat``, custom derivatives) once, as it
  runs; a ``while_loop``'s body once, its trip count being unknown (reported
  in ``FlopCount.uncounted_loops``).

Elementwise work is not counted: the figure is the matmul FLOPs as they run,
recomputation under ``remat`` included (hardware FLOPs; a model-FLOPs MFU
would leave the recomputed forward out). ``FlopCount.by_part`` splits them by
the model part of each equation's name stack (``hlo_costs.part_of``: the Flax
module path, forward and backward together).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.extend import core as jex_core

from hypermixer_jax.train import hlo_costs


@dataclasses.dataclass(frozen=True)
class FlopCount:
  flops: float                 # matmul FLOPs of the whole program
  uncounted_loops: int = 0     # while loops whose body was counted once
  by_part: dict[str, float] = dataclasses.field(default_factory=dict)

  def __add__(self, other: "FlopCount") -> "FlopCount":
    parts = dict(self.by_part)
    for k, v in other.by_part.items():
      parts[k] = parts.get(k, 0.0) + v
    return FlopCount(self.flops + other.flops,
                     self.uncounted_loops + other.uncounted_loops, parts)

  def scaled(self, factor: float) -> "FlopCount":
    return FlopCount(self.flops * factor, self.uncounted_loops,
                     {k: v * factor for k, v in self.by_part.items()})


def _jaxpr(x: Any):
  return x.jaxpr if isinstance(x, jex_core.ClosedJaxpr) else x


def _dot_flops(eqn) -> float:
  (contract, _), _ = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval.shape
  out = eqn.outvars[0].aval.shape
  return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contract)


def _conv_flops(eqn) -> float:
  rhs = eqn.invars[1].aval.shape
  spec = eqn.params["dimension_numbers"].rhs_spec   # (out, in, *window)
  out = eqn.outvars[0].aval.shape
  return 2.0 * math.prod(out) * rhs[spec[1]] * math.prod(
      rhs[d] for d in spec[2:])


def _manual_devices(params: dict) -> int:
  mesh = params.get("mesh")
  axes = (params.get("newly_manual_axes") or params.get("manual_axes")
          or params.get("axis_names") or ())
  if mesh is None:
    return 1
  shape = dict(mesh.shape)
  return math.prod(shape[a] for a in axes) if axes else math.prod(
      shape.values())


def _matmul(flops: float, scope: str) -> FlopCount:
  return FlopCount(flops, 0, {hlo_costs.part_of(scope) or "other": flops})


def count(jaxpr: Any, scope: str = "") -> FlopCount:
  """Matmul FLOPs of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``); ``scope``:
  the name stack of the equation that holds it."""
  total = FlopCount(0.0)
  for eqn in _jaxpr(jaxpr).eqns:
    name = eqn.primitive.name
    params = eqn.params
    inner = "/".join(s for s in (scope, str(eqn.source_info.name_stack)) if s)
    if name == "dot_general":
      total += _matmul(_dot_flops(eqn), inner)
    elif name == "conv_general_dilated":
      total += _matmul(_conv_flops(eqn), inner)
    elif name == "scan":
      total += count(params["jaxpr"], inner).scaled(params["length"])
    elif name == "while":
      total += count(params["body_jaxpr"], inner) + count(
          params["cond_jaxpr"], inner)
      total += FlopCount(0.0, 1)
    elif name == "cond":
      total += max((count(b, inner) for b in params["branches"]),
                   key=lambda c: c.flops)
    elif name == "shard_map":
      total += count(params["jaxpr"], inner).scaled(_manual_devices(params))
    else:
      for value in params.values():
        if isinstance(value, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
          total += count(value, inner)
  return total


def count_fn(fn, *args, **kwargs) -> FlopCount:
  """``count`` of ``jax.make_jaxpr(fn)(*args, **kwargs)`` (abstract
  ``jax.ShapeDtypeStruct`` arguments are enough: nothing runs)."""
  import jax  # pylint: disable=g-import-not-at-top
  return count(jax.make_jaxpr(fn)(*args, **kwargs))
