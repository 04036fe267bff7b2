"""HBM traffic of a compiled TPU program, each transfer counted once, and the
model part each instruction comes from.

What XLA's ``cost_analysis()["bytes accessed"]`` counts: ``HloCostAnalysis``
(xla/service/hlo_cost_analysis.cc) gives every instruction of the scheduled
module the bytes of its operands plus those of its result, in whatever memory
space they live; ``bytes accessed{i}{}`` and ``bytes accessedout{}`` are the
same sums per operand index and for results. On TPU, memory-space assignment
(MSA) then moves buffers into on-chip memory (layouts ``S(1)``, ...; ``S(0)``
or none is HBM) with asynchronous ``copy-start``/``copy-done`` and
``slice-start``/``slice-done`` pairs. Measured on a controlled program (two
chained 2048 x 2048 bf16 matmuls with tanh, one v5e chip; the test file
recomputes it): XLA reports 14 matrices of bytes where the chip moves 4
to or from HBM. A prefetch of one matrix counts 4 times (its operand, the
``copy-start`` result tuple's destination and source, the ``copy-done``
result) and the fusions reading the prefetched copy count it again although
they read on-chip memory. With MSA off (``compiler_options={"xla_msa_enable":
"false"}``) XLA's count is 6 matrices, which is that program's HBM traffic
(the intermediate goes to HBM and back). ``optimal_seconds`` is a sum of each
instruction's bottleneck time, so it inherits the phantom bytes (265 us with
MSA, 174.5 us = FLOPs at peak without); libtpu gives no positive figure for
most train steps.

``traffic`` counts instead the bytes each instruction moves to or from HBM:
operands and results whose layout is in HBM, a fusion's parameter read only
as far as its fused slices reach (as ``HloCostAnalysis`` does) and an
in-place ``dynamic-update-slice`` as its update, an asynchronous copy or
slice once per HBM side, ``while`` bodies times their trip counts
(``loop_multipliers``), and nothing for the bookkeeping instructions. Each
instruction gets a model part from its ``op_name`` metadata (the Flax module
path: mixer, feed-forward, ...) or the source files of its stack frames
(optax: optimizer; the heads: loss); XLA's own copies take their consumer's.
Array bytes include the padding of the layout's first tile (``T(8,128)``
pads the most-minor dimensions, as XLA:TPU's shape sizes do).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
                "u64": 8, "c64": 8, "c128": 16}
# An array type with its optional layout: dtype, dims, layout.
_ARRAY = re.compile(
    r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9]\w*)?)\[([0-9,]*)\](\{[^{}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_LAYOUT = re.compile(r"\{([0-9,]*)(?::T\(([0-9,]+)\))?")


def _array_bytes(dtype: str, dims: str, layout: str = "") -> int:
  """Bytes of one array as it lies in memory: its first tile (``T(8,128)``)
  pads the most-minor dimensions, as XLA:TPU's shape sizes do."""
  shape = [int(d) for d in dims.split(",") if d]
  m = _LAYOUT.match(layout or "")
  if m and shape:
    order = [int(d) for d in m.group(1).split(",") if d]
    tile = [int(t) for t in m.group(2).split(",") if t] if m.group(2) else []
    if tile and len(order) == len(shape):
      physical = [shape[d] for d in reversed(order)]    # major to minor
      k = min(len(tile), len(physical))
      for j in range(1, k + 1):
        physical[-j] = -(-physical[-j] // tile[-j]) * tile[-j]
      shape = physical
    elif tile and not shape:
      shape = [math.prod(tile)]
  elif m and m.group(2) and not shape:
    shape = [math.prod(int(t) for t in m.group(2).split(","))]
  return _DTYPE_BYTES.get(dtype, 1) * math.prod(shape)


def shape_bytes(hlo_type: str) -> int:
  """Bytes of an HLO type (an array or a tuple of arrays), tiles' padding
  included where the type has a layout."""
  return sum(_array_bytes(*a) for a in _ARRAY.findall(hlo_type))


def arrays(hlo_type: str) -> list[tuple[int, bool]]:
  """``(bytes, in HBM)`` of each array of a type, in order: HBM is memory
  space 0 (no ``S(n)`` in the layout)."""
  out = []
  for dtype, dims, layout in _ARRAY.findall(hlo_type):
    space = _SPACE.search(layout or "")
    out.append((_array_bytes(dtype, dims, layout),
                space is None or space.group(1) == "0"))
  return out


def hbm_bytes(hlo_type: str) -> int:
  return sum(b for b, hbm in arrays(hlo_type) if hbm)


@dataclasses.dataclass(frozen=True)
class Instr:
  name: str
  type: str
  opcode: str
  operands: tuple[str, ...]
  attrs: str
  raw: str = ""          # the operand text (a parameter's number)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CONSTANT = re.compile(r"\bconstant\((\d+)\)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")


def _split_call(rest: str) -> tuple[str, str]:
  """``(operands, attributes)`` of the text after an opcode's ``(``."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rest[:i], rest[i + 1:]
  return rest, ""


@dataclasses.dataclass
class Module:
  """A parsed HLO module: computations of instructions, the entry, every
  instruction by name, and the source file names of each stack frame."""
  comps: dict[str, list[Instr]]
  entry: str
  by_name: dict[str, Instr]
  frame_files: dict[str, tuple[str, ...]]


def _frames(hlo_text: str) -> dict[str, tuple[str, ...]]:
  """``{stack_frame_id: file names of the frame and its callers}`` from the
  module's ``FileNames`` / ``FileLocations`` / ``StackFrames`` tables."""
  tables = collections.defaultdict(dict)
  section = None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = line
    elif section and (m := re.match(r"^(\d+) (.*)$", line)):
      tables[section][m.group(1)] = m.group(2)
    elif section:
      section = None
  files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
  loc_file = {k: re.search(r"file_name_id=(\d+)", v).group(1)
              for k, v in tables["FileLocations"].items()}
  frames = {}
  for k, v in tables["StackFrames"].items():
    loc = re.search(r"file_location_id=(\d+)", v).group(1)
    parent = re.search(r"parent_frame_id=(\d+)", v)
    frames[k] = (files.get(loc_file.get(loc, ""), ""),
                 parent.group(1) if parent else None)
  out = {}
  for k in frames:
    chain, seen, cur = [], set(), k
    while cur in frames and cur not in seen:
      seen.add(cur)
      chain.append(frames[cur][0])
      cur = frames[cur][1]
    out[k] = tuple(chain)
  return out


@functools.lru_cache(maxsize=4)  # one module is read by several functions
def parse(hlo_text: str) -> Module:
  """The computations and instructions of an HLO module's text."""
  comps, entry, current, by_name = {}, "", None, {}
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      current = m.group(1)
      comps[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None:
      if line.startswith("}"):
        current = None
      elif im := _INSTR.match(line):
        name, typ, opcode, rest = im.groups()
        operands, attrs = _split_call(rest)
        instr = Instr(name.lstrip("%"), typ, opcode,
                      tuple(_OPERAND.findall(operands)), attrs, operands)
        comps[current].append(instr)
        by_name[instr.name] = instr
  return Module(comps, entry or next(iter(comps), ""), by_name,
                _frames(hlo_text))


def trip_count(condition: list[str]) -> int | None:
  """A loop's trip count from its condition computation: the one integer
  constant a counter from 0 is compared with (``lax.scan`` and XLA's
  windowed dot-general loops have this form); None where it is not."""
  consts = {int(c) for line in condition for c in _CONSTANT.findall(line)}
  compares = [line for line in condition if " compare(" in line]
  if len(consts) == 1 and len(compares) == 1 and "direction=LT" in compares[0]:
    return consts.pop()
  return None


def _lines(i: Instr) -> str:
  return f"{i.type} {i.opcode}({i.raw}){i.attrs}"


def _trips(mod: Module, instr: Instr, callees: dict[str, str]) -> int | None:
  """A ``while`` instruction's trip count (``trip_count`` of its
  condition); 1 for any other instruction."""
  if "body" not in callees or instr.opcode != "while":
    return 1
  return trip_count([_lines(i) for i in mod.comps.get(
      callees.get("condition", ""), [])])


def _branches(instr: Instr) -> list[str]:
  return [b.strip().lstrip("%") for group in _BRANCHES.findall(instr.attrs)
          for b in group.split(",") if b.strip()]


# What ``loop_multipliers`` weighs a conditional's branches by.
WEIGHTS = ("traffic", "collectives")


def _own_costs(mod: Module, weigh: str) -> dict[str, float]:
  """Each computation's own cost (its instructions, not its callees'):
  the HBM bytes ``traffic`` counts, or the result bytes of its collectives
  (and of the cross-slice ``send``s)."""
  if weigh not in WEIGHTS:
    raise ValueError(f"weigh={weigh!r}: one of {WEIGHTS}.")
  out = {}
  f = _Fused(mod)
  # A fusion's bytes are its instruction's in the computation that calls
  # it (as ``traffic`` counts them), not its fused body's.
  fused = {c for body in mod.comps.values() for i in body
           for k, c in _CALLEE.findall(i.attrs)
           if k in ("calls", "to_apply") and i.opcode != "call"}
  for name, body in mod.comps.items():
    if name in fused:
      out[name] = 0.0
    elif weigh == "traffic":
      out[name] = float(sum(_instr_traffic(mod, f, i)[0] for i in body))
    else:
      out[name] = float(sum(
          shape_bytes(i.type) for i in body
          if (_COLLECTIVE.match(i.opcode) and not i.opcode.endswith("-start"))
          or (i.opcode == "send" and "megascale" in i.attrs)))
  return out


@functools.lru_cache(maxsize=8)  # collectives and traffic read one module
def loop_multipliers(hlo_text: str, weigh: str = "traffic"
                     ) -> tuple[dict[str, int], int]:
  """``({computation: times it runs per step}, loops of unknown trip
  count)``: the entry once, a ``while`` body its trip count times its
  caller's (``trip_count``; once where unknown), other callees as often as
  their caller, and of a ``conditional``'s branches only the costliest by
  ``weigh`` (``WEIGHTS``; its callees included), as ``flop_count`` counts a
  ``cond``: a step runs one branch, and this one bounds it (the others
  are left out)."""
  mod = parse(hlo_text)
  own = _own_costs(mod, weigh)
  memo: dict[str, float] = {}

  def inclusive(name: str, depth: int = 0) -> float:
    if name in memo:
      return memo[name]
    if name not in mod.comps or depth > 64:
      return 0.0
    total = own.get(name, 0.0)
    for instr in mod.comps[name]:
      callees = dict(_CALLEE.findall(instr.attrs))
      trips = _trips(mod, instr, callees) or 1
      for kind, callee in callees.items():
        total += inclusive(callee, depth + 1) * (
            trips if kind == "body" else 1)
      branches = _branches(instr)
      if branches:
        total += max(inclusive(b, depth + 1) for b in branches)
    memo[name] = total
    return total

  times, unknown = {}, set()
  # Every call site adds its runs (a body shared by two loops runs for
  # both); computations with callees are few and called once, reducers
  # (``to_apply``) many times but call nothing.
  stack = [(mod.entry, 1)]
  while stack:
    name, n = stack.pop()
    if name not in mod.comps:
      continue
    times[name] = times.get(name, 0) + n
    for k, instr in enumerate(mod.comps[name]):
      callees = dict(_CALLEE.findall(instr.attrs))
      trips = _trips(mod, instr, callees)
      if trips is None:
        trips = 1
        unknown.add((name, k))
      for kind, callee in callees.items():
        stack.append((callee, n * (trips if kind == "body" else 1)))
      branches = _branches(instr)
      if branches:
        # The first of equal branches, as ``max`` keeps it.
        stack.append((max(branches, key=inclusive), n))
  return times, len(unknown)


# Instructions that move no data themselves (aliases, control flow whose
# bodies are counted where they run, the second half of asynchronous pairs).
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple",
               "bitcast", "while", "conditional", "call", "after-all",
               "partition-id", "replica-id", "add-dependency",
               "opt-barrier", "optimization-barrier", "async-update",
               "async-done", "copy-done", "slice-done"}
_ASYNC_MOVES = ("copy-start", "slice-start")
_COLLECTIVE = re.compile(r"^(all-gather|all-reduce|reduce-scatter|all-to-all"
                         r"|collective-permute|ragged-all-to-all)(-start|-done)?$")
# Fused users that read only part of their operand 0.
_PARTIAL_READS = ("slice", "dynamic-slice", "gather")


def _callee(instr: Instr) -> str | None:
  m = re.search(r"\bcalls=%?([\w.\-]+)", instr.attrs)
  return m.group(1) if m else None


class _Fused:
  """What a fusion reads of each operand and writes of its result, from its
  fused computation (as ``HloCostAnalysis::FusionParameterReadBytes``)."""

  def __init__(self, mod: Module):
    self.mod = mod
    self._index = {}

  def _comp(self, comp: str):
    if comp not in self._index:
      users, params = collections.defaultdict(list), {}
      for i in self.mod.comps.get(comp, []):
        for o in i.operands:
          users[o].append(i)
        if i.opcode == "parameter":
          params[int(i.raw.strip() or 0)] = i.name
      self._index[comp] = (users, params)
    return self._index[comp]

  def read(self, comp: str, index: int, full: int, depth: int = 0) -> int:
    """Bytes of parameter ``index`` (``full`` bytes) that ``comp`` reads."""
    users, params = self._comp(comp)
    if index not in params or depth > 8:
      return full
    return min(full, self._reads(comp, params[index], full, depth, users))

  def _reads(self, comp, name, full, depth, users) -> int:
    if not users.get(name) or self.mod.comps[comp][-1].name == name:
      return full                      # the fusion's result: read whole
    total = 0
    for u in users.get(name, []):
      if u.opcode in _PARTIAL_READS and u.operands[0] == name:
        total += shape_bytes(u.type)
      elif u.opcode == "dynamic-update-slice" and u.operands[0] == name:
        continue                       # updated in place, not read
      elif u.opcode == "bitcast":
        total += self._reads(comp, u.name, full, depth, users)
      elif u.opcode == "fusion" and (inner := _callee(u)):
        total += sum(self.read(inner, k, full, depth + 1)
                     for k, o in enumerate(u.operands) if o == name)
      else:
        return full
    return total

  def written(self, comp: str, result_type: str, hbm_only: bool = True
              ) -> int:
    """Bytes a fusion writes (to HBM only: ``hbm_only``): its result, an
    in-place ``dynamic-update-slice`` root (or tuple element) as its
    update."""
    body = self.mod.comps.get(comp, [])
    parts = [(b, h or not hbm_only) for b, h in arrays(result_type)]
    everything = sum(b for b, hbm in parts if hbm)
    if not body:
      return everything
    names = {i.name: i for i in body}
    root = body[-1]
    elems = ([names.get(o) for o in root.operands] if root.opcode == "tuple"
             else [root])
    if len(elems) != len(parts):
      return everything
    total = 0
    for (size, hbm), e in zip(parts, elems):
      if hbm and e is not None and e.opcode == "dynamic-update-slice":
        size = shape_bytes(names[e.operands[1]].type) if e.operands[1] in (
            names) else size
      total += size if hbm else 0
    return total


# The model part of an instruction, from the Flax module path in its
# op_name (first match wins; paths below ``Model)/``).
_PARTS = (
    ("moe", re.compile(r"/(smoe|tmoe|moe|router|experts?)\b")),
    ("mixer", re.compile(r"/(token_mixing|sgu|spatial|tiny_attention|"
                         r"attention|mixer)\b")),
    ("feed-forward", re.compile(r"/(feature_mixing|proj_in|proj_out|ffn|"
                                r"mlp|wi|wo)\b")),
    ("norm & dropout", re.compile(r"/stack/|/layers?(_\d+)?/")),
    ("head", re.compile(r"_head\b|/head\b|\.attend|/pooler\b|/classifier\b")),
    ("embedding", re.compile(r"embed|/stem\b|patch")),
)
# The model's root module under autodiff: ``jvp(Model)/...``,
# ``transpose(jvp(SmlpLM))/...``; the path after it names the module.
_ROOT = re.compile(r"jvp\(([A-Z]\w*)\)\)*/|\bModel\)\)*/")
PARTS = ("embedding", "mixer", "feed-forward", "moe", "norm & dropout",
         "head", "loss", "optimizer", "collectives", "other")


def part_of(op_name: str, files: tuple[str, ...] = ()) -> str | None:
  """The model part named by an instruction's ``op_name`` and the source
  files of its stack frames; None where neither says."""
  op_name = op_name.replace("\\", "")
  if op_name.startswith(("state.params", "state.opt_state", "batch[")):
    # An argument of the step: the train state's leaf paths name modules.
    if not op_name.startswith("state.params"):
      return "optimizer" if op_name.startswith("state.") else "other"
    op_name = "Model)/" + "/".join(re.findall(r"\['([^']+)'\]", op_name))
  root = _ROOT.search(op_name)
  if root:
    path = op_name[root.end() - 1:]
    for part, pattern in _PARTS:
      if pattern.search(path):
        return part
    return "other"
  joined = " ".join(files)
  if re.search(r"optax/losses|/heads\.py", joined):
    return "loss"
  if re.search(r"optax/|train_state\.py|/optim\.py", joined):
    return "optimizer"
  return None


@dataclasses.dataclass
class Item:
  """One instruction's share of a step (per chip)."""
  hbm_bytes: float          # bytes to or from HBM, times its runs per step
  xla_bytes: float          # what HloCostAnalysis counts for it, same runs
  name: str
  opcode: str
  part: str
  op_name: str
  runs: int


@dataclasses.dataclass
class Traffic:
  """The HBM traffic of one program (per chip, per step)."""
  hbm_bytes: float          # each transfer to or from HBM once
  xla_bytes: float          # XLA's rule (operands + results), same loops
  moves_xla_bytes: float    # XLA's count of the async copies and slices
  by_part: dict[str, float]
  items: list[Item]         # every counted instruction, largest first

  def top(self, k: int = 8) -> list[Item]:
    return self.items[:k]


def _op_name(instr: Instr) -> str:
  m = _OP_NAME.search(instr.attrs)
  return m.group(1) if m else ""


def _instr_traffic(mod: Module, fused: _Fused, i: Instr) -> tuple[int, int]:
  """``(HBM bytes, HloCostAnalysis bytes)`` of one scheduled instruction."""
  ops = [mod.by_name.get(o) for o in i.operands]
  if i.opcode in ("copy-done", "slice-done"):
    return 0, shape_bytes(i.type)      # XLA counts the result only
  if i.opcode in _NO_TRAFFIC or _COLLECTIVE.match(i.opcode) and (
      i.opcode.endswith("-done")):
    return 0, 0
  if i.opcode in _ASYNC_MOVES:
    # copy-start: (destination, source alias, context); slice-start:
    # ((source aliases), destination, context). One read, one write.
    parts = arrays(i.type)
    dest = parts[0] if i.opcode == "copy-start" else parts[len(ops)]
    src_hbm = bool(ops and ops[0] and all(h for _, h in arrays(ops[0].type)))
    return dest[0] * (int(src_hbm) + int(dest[1])), shape_bytes(i.type) + sum(
        shape_bytes(o.type) for o in ops if o)
  hbm = xla = 0
  callee = _callee(i) if i.opcode == "fusion" else None
  for k, o in enumerate(ops):
    if o is None:
      continue
    size = shape_bytes(o.type)
    if callee and size:
      size = fused.read(callee, k, size)
    xla += size
    hbm += size if all(h for _, h in arrays(o.type)) else 0
  if callee:
    xla += fused.written(callee, i.type, hbm_only=False)
    hbm += fused.written(callee, i.type)
  elif _COLLECTIVE.match(i.opcode) and i.type.startswith("("):
    # An asynchronous collective's result tuple carries its operand first,
    # then its result; a collective-permute-start's ends in u32[] context
    # words, so its result is the second element, not the last.
    parts = arrays(i.type)
    dest = parts[1:2] if i.opcode.startswith("collective-permute") else (
        parts[-1:])
    xla += shape_bytes(i.type)
    hbm += sum(b for b, h in dest if h)
  else:
    xla += shape_bytes(i.type)
    hbm += hbm_bytes(i.type)
  return hbm, xla


def _resolve_parts(mod: Module, scheduled: list[Instr]) -> dict[str, str]:
  """``{instruction: part}``; XLA's copies and unnamed instructions take
  the part of their first user that has one."""
  users = collections.defaultdict(list)
  for i in scheduled:
    for o in i.operands:
      users[o].append(i.name)
  own = {}
  for i in scheduled:
    if _COLLECTIVE.match(i.opcode):
      own[i.name] = "collectives"
      continue
    frame = _FRAME.search(i.attrs)
    own[i.name] = part_of(_op_name(i), mod.frame_files.get(
        frame.group(1), ()) if frame else ())

  @functools.lru_cache(maxsize=None)
  def resolve(name: str, depth: int = 0) -> str:
    if own.get(name):
      return own[name]
    instr = mod.by_name.get(name)
    if depth < 6 and instr is not None:
      # An argument's copy is the argument's; other unnamed instructions
      # (XLA's copies of intermediates) serve their users.
      for o in instr.operands:
        if mod.by_name.get(o) and mod.by_name[o].opcode == "parameter" and (
            own.get(o)):
          return own[o]
      for u in users.get(name, []):
        p = resolve(u, depth + 1)
        if p != "other":
          return p
      # The step's outputs (the new state) serve no user: their producer's.
      for o in instr.operands:
        p = resolve(o, depth + 1)
        if p != "other":
          return p
    return "other"

  return {i.name: resolve(i.name) for i in scheduled}


@functools.lru_cache(maxsize=4)
def traffic(hlo_text: str) -> Traffic:
  """``Traffic`` of a compiled module's text (``compiled.as_text()``)."""
  mod = parse(hlo_text)
  times, _ = loop_multipliers(hlo_text)
  fused = set()
  for body in mod.comps.values():
    for i in body:
      fused.update(c for k, c in _CALLEE.findall(i.attrs)
                   if k in ("calls", "to_apply") and i.opcode != "call")
  scheduled = [(name, i) for name, body in mod.comps.items()
               if name not in fused and name in times for i in body]
  parts = _resolve_parts(mod, [i for _, i in scheduled])
  f = _Fused(mod)
  items, moves = [], 0.0
  by_part = {p: 0.0 for p in PARTS}
  for comp, i in scheduled:
    runs = times[comp]
    hbm, xla = _instr_traffic(mod, f, i)
    if i.opcode in _ASYNC_MOVES or i.opcode in ("copy-done", "slice-done"):
      moves += xla * runs
    if hbm or xla:
      items.append(Item(hbm * runs, xla * runs, i.name, i.opcode,
                        parts[i.name], _op_name(i), runs))
      by_part[parts[i.name]] += hbm * runs
  items.sort(key=lambda it: -it.hbm_bytes)
  return Traffic(sum(it.hbm_bytes for it in items),
                 sum(it.xla_bytes for it in items), moves, by_part, items)


def instruction_parts(hlo_text: str) -> dict[str, tuple[str, str, str]]:
  """``{instruction: (model part, opcode, op_name)}`` for every instruction
  of a compiled module's text, the parts resolved as ``traffic`` resolves
  them (a profile's per-instruction times are attributed with it)."""
  mod = parse(hlo_text)
  instrs = [i for body in mod.comps.values() for i in body]
  parts = _resolve_parts(mod, instrs)
  return {i.name: (parts[i.name], i.opcode, _op_name(i)) for i in instrs}
