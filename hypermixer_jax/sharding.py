"""Device mesh, logical-axis rules and sharded initialisation.

Every parameter is created with logical axis names (``common.partitioned``)
and the main activations are constrained with logical names
(``common.constrain``). This module turns those names into placements:

* ``build_mesh`` makes a 4-axis mesh ``("data", "fsdp", "tensor", "expert")``
  from ``config.mesh`` (one size may be -1: it takes the devices left);
* a rules table (``config.sharding.rules``: a preset name from
  ``RULES_PRESETS`` or an explicit list of ``(logical_name, mesh_axes)``)
  maps logical names to mesh axes, in Flax's priority order: for each array,
  rules are tried top to bottom and a rule only applies if its mesh axes are
  still unused by that array (so ``batch`` claims ``fsdp`` on activations
  before ``embed`` can, while parameters, which have no ``batch`` axis, put
  ``embed`` on ``fsdp``);
* ``config.sharding.indivisible`` says what happens to a parameter dimension
  that its rule's mesh axes do not divide (e.g. a 196 x 196 SGU matrix on
  ``fsdp=256``): ``"replicate"`` tries that logical name's later rules and
  else keeps the dimension replicated (logged at init), ``"error"`` stops
  naming every such dimension; ``"auto"`` (the default) is ``"replicate"``
  for a preset and ``"error"`` for an explicit rules table;
* ``sharded_init`` initialises straight into the sharded layout
  (``jax.eval_shape`` -> specs -> ``jax.jit(init, out_shardings=...)``), so
  the full parameters never sit on one device;
* ``make_global_batch`` assembles the global batch from each host's slice.

Typical use::

  mesh = build_mesh(config.mesh)
  rules = get_rules(config.sharding)
  state, shardings = sharded_init(init_fn, key, mesh, rules)
  with activate(mesh, rules):
    ...
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator, Mapping, Sequence

from absl import logging
import flax.linen as nn
from flax.core import meta
import jax
from jax.experimental import mesh_utils
import numpy as np

from hypermixer_jax.models import common

MESH_AXES = ("data", "fsdp", "tensor", "expert")

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Batch dimension of activations and inputs: split over every axis that is not
# tensor parallel. With the expert preset the expert axis also carries data
# outside the MoE layers (as in MaxText), so no device idles there.
_BATCH_AXES = ("data", "fsdp", "expert")

# What to do with a parameter dimension its mesh axes do not divide.
INDIVISIBLE_CHOICES = ("auto", "replicate", "error")


class RulesTable(tuple):
  """A rules table (a tuple of ``(logical_name, mesh_axes)``) that also
  carries how indivisible parameter dimensions are resolved.

  ``indivisible`` is ``"replicate"`` (try the logical name's later rules,
  else leave the dimension replicated) or ``"error"`` (Flax's resolution,
  checked by ``validate_divisibility``). A plain tuple of rules behaves as
  ``"error"``.
  """
  indivisible: str

  def __new__(cls, rules: Any, indivisible: str) -> "RulesTable":
    if indivisible not in ("replicate", "error"):
      raise ValueError(f"indivisible={indivisible!r} must be 'replicate' or "
                       "'error'.")
    out = super().__new__(cls, rules)
    out.indivisible = indivisible
    return out

  def __getnewargs__(self) -> tuple[Any, ...]:  # copy / pickle
    return tuple(self), self.indivisible

  def __repr__(self) -> str:
    return f"RulesTable({tuple(self)!r}, indivisible={self.indivisible!r})"


def _indivisible(rules: Rules) -> str:
  return getattr(rules, "indivisible", "error")


def _preset(*, fsdp: bool, tensor: bool, expert: bool) -> Rules:
  """Builds a complete rules table (every logical name appears)."""
  rules: list[tuple[str, MeshAxes]] = []
  if expert:
    # Ahead of batch, so that tensors holding both (the MoE's dispatched
    # [B, E, C, d]) put experts on "expert" (all-to-all expert parallelism)
    # and fall back to the batch rule without "expert" below.
    rules.append((common.EXPERT, "expert"))
  rules.append((common.BATCH, _BATCH_AXES))
  if expert:
    rules.append((common.BATCH, ("data", "fsdp")))
  if tensor:
    # Megatron-style: the wide inner dimension of each pair of matmuls.
    rules += [(common.MLP, "tensor"), (common.HEADS, "tensor"),
              (common.HYPER, "tensor"), (common.TOKEN_MLP, "tensor"),
              (common.VOCAB, "tensor")]
  if fsdp:
    # ``embed`` is on nearly every kernel; the weights that have no
    # ``embed`` axis (SGU's N x N, the Mixer token MLP, the hypernetworks'
    # output layer) fall back to their widest axis. Listed in priority order:
    # token_mlp and hyper (usually multiples of 8) before the sequence axes
    # (e.g. 196 patches). A dimension none of them divides stays replicated
    # (the tables are ``indivisible="replicate"``).
    rules += [(common.EMBED, "fsdp"), (common.TOKEN_MLP, "fsdp"),
              (common.HYPER, "fsdp"), (common.SEQ_IN, "fsdp"),
              (common.SEQ_OUT, "fsdp")]
  named = {name for name, _ in rules}
  rules += [(name, None) for name in common.LOGICAL_AXES if name not in named]
  return RulesTable(rules, "replicate")


RULES_PRESETS: dict[str, Rules] = {
    # Parameters and optimizer state replicated; the batch split everywhere.
    "data_parallel": _preset(fsdp=False, tensor=False, expert=False),
    # ZeRO-3 style: parameters and optimizer state split over "fsdp" too.
    "fsdp": _preset(fsdp=True, tensor=False, expert=False),
    # fsdp plus tensor parallelism of the hidden widths over "tensor".
    "fsdp_tensor": _preset(fsdp=True, tensor=True, expert=False),
    # fsdp + tensor plus experts split over the "expert" axis.
    "expert": _preset(fsdp=True, tensor=True, expert=True),
}


# ---------------------------------------------------------------------------
# Mesh.
# ---------------------------------------------------------------------------
def _field(cfg: Any, name: str) -> Any:
  if isinstance(cfg, Mapping):
    return cfg.get(name, 1)
  return getattr(cfg, name, 1)


class MeshError(ValueError):
  """The mesh's axis sizes do not fit the devices: a configuration error
  (``main.py`` stops with its one line)."""


def _fitting_axis(sizes: Sequence[Any], num_devices: int) -> str:
  """An override that fits. With an axis at -1 already, a fixed axis shrunk
  to a size that leaves the -1 axis a whole share; otherwise the first axis
  (data, fsdp, tensor, expert) that can take -1."""
  fixed = {a: s for a, s in zip(MESH_AXES, sizes)
           if isinstance(s, (int, np.integer)) and s > 0}
  if len(fixed) < len(MESH_AXES):          # one axis is -1: keep it
    known = math.prod(fixed.values())
    for a, s in fixed.items():
      others = known // s
      if s > 1 and num_devices % others == 0:
        return (f"pass --config.mesh.{a}="
                f"{math.gcd(s, num_devices // others)}")
  else:
    for a, s in fixed.items():
      if num_devices % (math.prod(fixed.values()) // s) == 0:
        return (f"pass --config.mesh.{a}=-1 (it takes the remaining "
                "devices)")
  return (f"pass --config.mesh.<axis> sizes whose product is {num_devices}, "
          "or one of them -1")


def mesh_shape(mesh_config: Any, num_devices: int) -> tuple[int, ...]:
  """Resolves the axis sizes (one may be -1) for ``num_devices`` devices.

  Raises MeshError naming every size, and an override that fits, when they
  do not fit the devices.
  """
  sizes = [_field(mesh_config, a) for a in MESH_AXES]
  desc = " x ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes))
  for a, s in zip(MESH_AXES, sizes):
    if not isinstance(s, (int, np.integer)) or (s < 1 and s != -1):
      raise MeshError(f"mesh axis {a}={s!r} must be a positive int or -1 "
                      f"(mesh {desc}).")
  fill = [a for a, s in zip(MESH_AXES, sizes) if s == -1]
  if len(fill) > 1:
    raise MeshError(f"at most one mesh axis may be -1, got {fill} "
                    f"(mesh {desc}).")
  known = math.prod(s for s in sizes if s != -1)
  if fill:
    if num_devices % known:
      raise MeshError(
          f"mesh {desc}: the fixed axes multiply to {known}, which does not "
          f"divide the {num_devices} devices, so {fill[0]}=-1 cannot be "
          f"filled; {_fitting_axis(sizes, num_devices)}.")
    sizes = [num_devices // known if s == -1 else s for s in sizes]
  if math.prod(sizes) != num_devices:
    raise MeshError(
        f"mesh {desc} has {math.prod(sizes)} devices but there are "
        f"{num_devices}; the product of data, fsdp, tensor and expert must "
        f"equal the device count: {_fitting_axis(sizes, num_devices)}.")
  return tuple(int(s) for s in sizes)


def dcn_shape(shape: Sequence[int], num_granules: int) -> tuple[int, ...]:
  """Splits ``num_granules`` (hosts or slices) over the mesh axes.

  The slow inter-host network (DCN) should carry the axes that communicate
  least: data first, then fsdp, tensor, expert. Each granule then holds a
  contiguous block of the remaining (fast, ICI/NVLink) axes.
  """
  left, out = num_granules, []
  for size in shape:
    g = math.gcd(left, size)
    out.append(g)
    left //= g
  if left != 1:
    raise ValueError(
        f"cannot spread {num_granules} hosts/slices over mesh "
        f"{dict(zip(MESH_AXES, shape))}: the axes data, fsdp, tensor, expert "
        "must be splittable into per-host blocks (make data a multiple of "
        "the host count).")
  return tuple(out)


def build_mesh(mesh_config: Any, devices: Sequence[Any] | None = None
               ) -> jax.sharding.Mesh:
  """Builds the ``("data", "fsdp", "tensor", "expert")`` mesh.

  Args:
    mesh_config: anything with fields (or keys) ``data``, ``fsdp``,
      ``tensor``, ``expert``; missing ones are 1 and one may be -1.
    devices: defaults to ``jax.devices()`` (all hosts).

  Devices are ordered for the physical topology: ``jax.make_mesh`` on one
  host or one TPU slice, and a hybrid ICI x DCN mesh
  (``mesh_utils.create_hybrid_device_mesh``) when the devices span several
  TPU slices or several GPU hosts, with the inter-host axes on ``data``
  first. All axes are ``AxisType.Auto`` (what Linen's logical constraints
  expect).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_config, len(devices))
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  slices = {getattr(d, "slice_index", 0) for d in devices}
  processes = {d.process_index for d in devices}
  if len(slices) > 1:
    granules, process_is_granule = len(slices), False
  elif len(processes) > 1 and devices[0].platform != "tpu":
    granules, process_is_granule = len(processes), True
  else:
    try:
      return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types,
                           devices=devices)
    except NotImplementedError as e:   # see _split_physical_axes
      grid = _split_physical_axes(
          e, shape, lambda: mesh_utils.create_device_mesh(
              shape, devices, allow_split_physical_axes=True))
      return jax.sharding.Mesh(grid, MESH_AXES, axis_types=axis_types)
  dcn = dcn_shape(shape, granules)
  ici = tuple(s // d for s, d in zip(shape, dcn))
  try:
    grid = mesh_utils.create_hybrid_device_mesh(
        ici, dcn, devices, process_is_granule=process_is_granule)
  except NotImplementedError as e:
    grid = _split_physical_axes(
        e, ici, lambda: mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=process_is_granule,
            allow_split_physical_axes=True))
  return jax.sharding.Mesh(grid, MESH_AXES, axis_types=axis_types)


def _split_physical_axes(error: Exception, shape, build):
  """A mesh whose axes do not each map onto whole physical TPU axes (e.g.
  fsdp 64 x tensor 4 on the 16 x 16 torus of a v6e-256, where JAX's
  ordering without splitting finds no assignment): built again letting an
  axis split a physical one (``allow_split_physical_axes``), which keeps
  each mesh axis on neighbouring chips. Logged, since such an axis's
  collectives cross a ring part way."""
  logging.info("Mesh %s: no assignment of whole physical TPU axes (%s); "
               "splitting a physical axis.", tuple(shape),
               str(error).splitlines()[0])
  return build()


# ---------------------------------------------------------------------------
# Rules.
# ---------------------------------------------------------------------------
def _normalise_mesh_axes(logical: str, axes: Any) -> MeshAxes:
  if axes is None or isinstance(axes, str):
    names = () if axes is None else (axes,)
  else:
    names = tuple(axes)
  for a in names:
    if a not in MESH_AXES:
      raise ValueError(f"sharding rule ({logical!r}, {axes!r}): unknown mesh "
                       f"axis {a!r}; mesh axes are {MESH_AXES}.")
  if len(set(names)) != len(names):
    raise ValueError(f"sharding rule ({logical!r}, {axes!r}) repeats a mesh "
                     "axis.")
  if axes is None or isinstance(axes, str):
    return axes
  return names


def get_rules(sharding_config: Any) -> RulesTable:
  """Returns the validated rules table.

  Args:
    sharding_config: a preset name (see ``RULES_PRESETS``), an explicit
      sequence of ``(logical_name, mesh_axes)`` pairs (``mesh_axes`` is None,
      a mesh axis name or a sequence of them), or a config with a ``rules``
      field holding either and an optional ``indivisible`` field (one of
      ``INDIVISIBLE_CHOICES``; ``"auto"``: ``"replicate"`` for a preset,
      ``"error"`` for an explicit table).

  Raises ValueError for an unknown preset, logical name, mesh axis or
  ``indivisible`` value.
  """
  rules, indivisible = sharding_config, None
  if isinstance(rules, Mapping):
    rules, indivisible = rules["rules"], rules.get("indivisible")
  elif not isinstance(rules, (str, list, tuple)):
    rules, indivisible = rules.rules, getattr(rules, "indivisible", None)
  indivisible = "auto" if indivisible is None else indivisible
  if indivisible not in INDIVISIBLE_CHOICES:
    raise ValueError(
        f"config.sharding.indivisible={indivisible!r} must be one of "
        f"{', '.join(map(repr, INDIVISIBLE_CHOICES))} (\"replicate\" keeps a "
        "parameter dimension that its mesh axes do not divide replicated, "
        "\"error\" stops; \"auto\": replicate for a preset, error for an "
        "explicit rules table).")
  if isinstance(rules, str):
    if rules not in RULES_PRESETS:
      raise ValueError(f"unknown sharding preset {rules!r}; presets are "
                       f"{sorted(RULES_PRESETS)}.")
    rules = RULES_PRESETS[rules]
    return rules if indivisible == "auto" else RulesTable(rules, indivisible)
  out = []
  for rule in rules:
    if len(rule) != 2:
      raise ValueError(f"sharding rule {rule!r} must be a pair "
                       "(logical_name, mesh_axes).")
    logical, axes = rule
    if logical not in common.LOGICAL_AXES:
      raise ValueError(f"sharding rule ({logical!r}, {axes!r}): unknown "
                       f"logical axis name {logical!r}; the names are "
                       f"{common.LOGICAL_AXES} (hypermixer_jax.models.common)."
                       )
    out.append((logical, _normalise_mesh_axes(logical, axes)))
  return RulesTable(out, "error" if indivisible == "auto" else indivisible)


@contextlib.contextmanager
def activate(mesh: jax.sharding.Mesh, rules: Rules) -> Iterator[None]:
  """Context in which logical constraints bind: the mesh plus the rules.

  Use it around eager code and the *first call* of functions jitted without
  ``jit_train_step``; ``jax.set_mesh`` cannot be entered inside ``jax.jit``
  (see ``within``).
  """
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def within(fn: Callable[..., Any], mesh: jax.sharding.Mesh, rules: Rules
           ) -> Callable[..., Any]:
  """Wraps ``fn`` so that it traces with ``mesh`` and ``rules`` active.

  Safe inside ``jax.jit`` (it sets the abstract mesh, not the concrete one),
  so the jitted function carries its sharding context with it: a caller who
  forgets ``activate`` still gets the activation constraints.
  """

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
        nn.logical_axis_rules(rules):
      return fn(*args, **kwargs)

  return wrapped


# ---------------------------------------------------------------------------
# Parameter shardings.
# ---------------------------------------------------------------------------
def _axis_names(axes: MeshAxes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _resolve(names: tuple[str | None, ...], shape: Sequence[int],
             rules: Rules, mesh: jax.sharding.Mesh
             ) -> tuple[jax.P, list[tuple[int, list[MeshAxes]]]]:
  """Flax's priority resolution, skipping rules that do not divide.

  As ``nn.logical_to_mesh_axes``: rules are tried top to bottom and one
  applies to its logical name's dimension if that dimension is still
  unassigned and its mesh axes are unused by the array; in addition a rule
  whose mesh axes do not divide the dimension is skipped, so the name's later
  rules are tried and, when none divides, the dimension stays replicated.

  Returns the spec and ``[(dim, skipped mesh axes)]`` for each dimension
  left replicated after skipping.
  """
  unset = object()
  result: list[Any] = [unset if isinstance(n, str) else n for n in names]
  skipped: dict[int, list[MeshAxes]] = {}
  for logical, axes in rules:
    if logical not in names:
      continue
    pos = names.index(logical)
    used = {a for r in result if r is not unset for a in _axis_names(r)}
    if result[pos] is not unset or used & set(_axis_names(axes)):
      continue
    if shape[pos] % _axes_size(mesh, axes):
      skipped.setdefault(pos, []).append(axes)
      continue
    result[pos] = axes
  spec = jax.P(*(None if r is unset else r for r in result))
  return spec, [(d, a) for d, a in sorted(skipped.items())
                if spec[d] is None]


def _box_mesh_axes(path: str, box: Any, rules: Rules,
                   mesh: jax.sharding.Mesh | None = None
                   ) -> tuple[jax.P, list[tuple[int, list[MeshAxes]]]]:
  """``(spec, replicated fallbacks)`` of one boxed leaf (see ``_resolve``;
  the fallbacks are only looked for with a mesh and ``"replicate"``)."""
  if isinstance(box, nn.LogicallyPartitioned):
    names = tuple(box.names)
    for n in names:
      if n is not None and n not in common.LOGICAL_AXES:
        raise ValueError(
            f"parameter {path} has unknown logical axis name {n!r} (names "
            f"{names}); use the names in hypermixer_jax.models.common."
            "LOGICAL_AXES.")
    dups = sorted({n for n in names if n is not None and names.count(n) > 1})
    if dups:
      raise ValueError(
          f"parameter {path} repeats logical axis names {dups} (names "
          f"{names}); each dimension needs its own name so that the rules "
          "can place it.")
    if mesh is not None and _indivisible(rules) == "replicate":
      return _resolve(names, box.value.shape, rules, mesh)
    return nn.logical_to_mesh_axes(names, rules), []
  if isinstance(box, meta.Partitioned):  # already in mesh axes
    return jax.P(*box.names), []
  raise ValueError(f"parameter {path}: unsupported metadata box "
                   f"{type(box).__name__}.")


def _specs_and_fallbacks(abstract_tree: Any, rules: Rules,
                         mesh: jax.sharding.Mesh | None) -> tuple[Any, list]:
  fallbacks = []

  def spec(path, x):
    if not common.is_box(x):
      return jax.P()
    key = jax.tree_util.keystr(path)
    out, fell = _box_mesh_axes(key, x, rules, mesh)
    fallbacks.extend((key, x, out, d, axes) for d, axes in fell)
    return out
  specs = jax.tree_util.tree_map_with_path(spec, abstract_tree,
                                           is_leaf=common.is_box)
  return specs, fallbacks


def logical_specs(abstract_tree: Any, rules: Rules,
                  mesh: jax.sharding.Mesh | None = None) -> Any:
  """Maps each logically-named box to its mesh ``PartitionSpec``.

  Leaves without a box (step counters, optimizer scalars) are replicated:
  ``P()``. With ``mesh`` and a ``RulesTable`` whose ``indivisible`` is
  ``"replicate"``, a rule whose mesh axes do not divide the dimension is
  skipped (the name's later rules are tried, else the dimension is
  replicated). Raises ValueError naming the parameter for an unknown logical
  name.
  """
  return _specs_and_fallbacks(abstract_tree, rules, mesh)[0]


def replicated_fallbacks(abstract_tree: Any, mesh: jax.sharding.Mesh,
                         rules: Rules) -> list[str]:
  """The dimensions left replicated because no rule's mesh axes divide them.

  One line per dimension: ``path: dim D (logical NAME, size S) not divisible
  by mesh axes A (sizes)``; empty unless ``rules.indivisible`` is
  ``"replicate"``.
  """
  _, fallbacks = _specs_and_fallbacks(abstract_tree, rules, mesh)
  return [f"{key}: dim {d} (logical {box.names[d]!r}, size "
          f"{box.value.shape[d]}) not divisible by mesh axes "
          + ", ".join(f"{a} ({_axes_size(mesh, a)})" for a in axes)
          for key, box, _, d, axes in fallbacks]


_LOG_NAMES = 12  # arrays named in the log line


def _log_fallbacks(abstract_tree: Any, mesh: jax.sharding.Mesh,
                   rules: Rules) -> None:
  """One log line: the arrays kept replicated along an indivisible dim."""
  _, fallbacks = _specs_and_fallbacks(abstract_tree, rules, mesh)
  arrays = {}
  for key, box, spec, _, _ in fallbacks:
    v = box.value
    arrays[key] = (math.prod(v.shape) * np.dtype(v.dtype).itemsize
                   // math.prod(_axes_size(mesh, a) for a in spec))
  if arrays:
    names = list(arrays)[:_LOG_NAMES] + (
        [f"... ({len(arrays) - _LOG_NAMES} more)"]
        if len(arrays) > _LOG_NAMES else [])
    logging.info(
        "sharding: %d arrays (%d bytes per chip) kept replicated along a "
        "dimension that its mesh axes do not divide "
        "(config.sharding.indivisible='replicate'): %s", len(arrays),
        sum(arrays.values()), ", ".join(names))


def logical_shardings(abstract_tree: Any, mesh: jax.sharding.Mesh,
                      rules: Rules) -> Any:
  """``NamedSharding`` tree for ``abstract_tree`` (boxes or plain leaves).

  The result has the structure of ``nn.unbox(abstract_tree)``: one sharding
  where each box (or plain leaf) was.
  """
  return jax.tree.map(lambda s: jax.NamedSharding(mesh, s),
                      logical_specs(abstract_tree, rules, mesh),
                      is_leaf=lambda x: isinstance(x, jax.P))


def _axes_size(mesh: jax.sharding.Mesh, axes: MeshAxes) -> int:
  return math.prod(mesh.shape[a] for a in _axis_names(axes))


def validate_divisibility(abstract_tree: Any, mesh: jax.sharding.Mesh,
                          rules: Rules) -> None:
  """Checks that every sharded dimension divides by its mesh axes.

  Runs on shapes only (after ``jax.eval_shape``), so a bad mesh or rules
  table fails before anything is compiled. Raises ValueError listing each
  offending parameter path, dimension, logical name, mesh axes and sizes
  (never with ``indivisible="replicate"``, whose specs only use dividing
  rules).
  """
  specs = logical_specs(abstract_tree, rules, mesh)
  leaves = jax.tree_util.tree_flatten_with_path(
      abstract_tree, is_leaf=common.is_box)[0]
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.P))
  problems = []
  for (path, x), spec in zip(leaves, spec_leaves):
    names = tuple(x.names) if common.is_box(x) else ()
    value = x.value if common.is_box(x) else x
    shape = getattr(value, "shape", ())
    for dim, axes in enumerate(tuple(spec)):
      size = _axes_size(mesh, axes)
      if size > 1 and shape[dim] % size:
        logical = names[dim] if dim < len(names) else None
        problems.append(
            f"  {jax.tree_util.keystr(path)}: dim {dim} (logical "
            f"{logical!r}, size {shape[dim]}) over mesh axes {axes} of total "
            f"size {size}")
  if problems:
    raise ValueError(
        "sharding rules do not divide these parameter dimensions (mesh "
        f"{dict(mesh.shape)}):\n" + "\n".join(problems) +
        "\nChange the model sizes, the mesh, or map these logical names to "
        "other mesh axes in config.sharding.rules (or set "
        "config.sharding.indivisible='replicate' to keep them replicated).")


def abstract_init(init_fn: Callable[[jax.Array], Any], key: jax.Array,
                  mesh: jax.sharding.Mesh, rules: Rules) -> tuple[Any, Any]:
  """``sharded_init`` without allocating: ``(abstract state, shardings)``.

  The state is the unboxed tree of ``jax.ShapeDtypeStruct``s, each carrying
  its ``NamedSharding`` (what ``.lower`` takes to compile for the mesh).
  """
  # Shapes first, with no rules bound (constraints are no-ops), so that bad
  # names and sizes get our errors, naming the parameter, before tracing
  # with the mesh and before any compilation.
  with nn.logical_axis_rules(()):
    abstract = jax.eval_shape(init_fn, key)
  validate_divisibility(abstract, mesh, rules)
  _log_fallbacks(abstract, mesh, rules)
  shardings = logical_shardings(abstract, mesh, rules)
  state = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      meta.unbox(abstract), shardings)
  return state, shardings


def sharded_init(init_fn: Callable[[jax.Array], Any], key: jax.Array,
                 mesh: jax.sharding.Mesh, rules: Rules) -> tuple[Any, Any]:
  """Initialises ``init_fn(key)`` directly into its sharded layout.

  ``init_fn`` returns a pytree whose leaves may be logical boxes (what
  ``model.init`` gives). Its shapes are traced with ``jax.eval_shape``,
  checked (names, divisibility) and turned into ``NamedSharding``s, then
  ``jax.jit(init_fn, out_shardings=...)`` builds each shard on its own
  device: no device ever holds the full parameters.

  Returns:
    ``(state, shardings)``: the unboxed state (plain arrays) and the
    matching tree of ``NamedSharding``.
  """
  _, shardings = abstract_init(init_fn, key, mesh, rules)
  state = jax.jit(within(lambda k: meta.unbox(init_fn(k)), mesh, rules),
                  out_shardings=shardings)(key)
  return state, shardings


# ---------------------------------------------------------------------------
# Batches.
# ---------------------------------------------------------------------------
def _batch_spec(ndim: int, rules: Rules) -> jax.P:
  names = (common.BATCH, common.LENGTH)[:ndim] + (None,) * max(ndim - 2, 0)
  return nn.logical_to_mesh_axes(names, rules)


def _check_batch_dims(shape: Sequence[int], spec: jax.P,
                      mesh: jax.sharding.Mesh, what: str) -> None:
  for dim, axes in enumerate(tuple(spec)):
    size = _axes_size(mesh, axes)
    if size > 1 and shape[dim] % size:
      raise ValueError(
          f"batch entry {what} has global shape {tuple(shape)}: dim {dim} "
          f"({shape[dim]}) must be divisible by mesh axes {axes} of total "
          f"size {size} (mesh {dict(mesh.shape)}).")


def batch_shardings(batch_or_spec: Any, mesh: jax.sharding.Mesh,
                    rules: Rules) -> Any:
  """``NamedSharding``s for a (global) batch: dim 0 ``batch``, dim 1 ``length``.

  ``batch_or_spec`` is a pytree of arrays or ``jax.ShapeDtypeStruct``s with
  global shapes; scalars are replicated. Raises ValueError when a sharded
  dimension does not divide.
  """
  def one(path, x):
    spec = _batch_spec(len(x.shape), rules)
    _check_batch_dims(x.shape, spec, mesh, jax.tree_util.keystr(path))
    return jax.NamedSharding(mesh, spec)
  return jax.tree_util.tree_map_with_path(one, batch_or_spec)


def batch_shards(mesh: jax.sharding.Mesh, rules: Rules) -> int:
  """How many ways a batch's leading (``batch``) axis is split over the
  mesh: its global size must divide by this."""
  return _axes_size(mesh, tuple(_batch_spec(1, rules))[0])


def global_batch_spec(local_batch: Any) -> Any:
  """Global ``jax.ShapeDtypeStruct``s of a host-local batch (every process
  holds an equal share of the leading axis)."""
  pcount = jax.process_count()
  return jax.tree.map(
      lambda v: jax.ShapeDtypeStruct((v.shape[0] * pcount,) + v.shape[1:],
                                     v.dtype), local_batch)


def make_global_batch(local_batch: Any, mesh: jax.sharding.Mesh,
                      rules: Rules) -> Any:
  """Assembles global arrays from each host's slice of the batch.

  Every process passes only its own examples (leading axis = its share of
  the global batch, in process order); with one host this is simply the
  whole batch placed on the mesh.
  """
  def one(path, x):
    x = np.asarray(x)
    spec = _batch_spec(x.ndim, rules)
    sharding = jax.NamedSharding(mesh, spec)
    if jax.process_count() == 1:
      _check_batch_dims(x.shape, spec, mesh, jax.tree_util.keystr(path))
      return jax.make_array_from_process_local_data(sharding, x, x.shape)
    # Several hosts: JAX infers the global shape from how many distinct
    # slices of the batch axes the hosts hold.
    out = jax.make_array_from_process_local_data(sharding, x)
    _check_batch_dims(out.shape, spec, mesh, jax.tree_util.keystr(path))
    return out
  return jax.tree_util.tree_map_with_path(one, local_batch)
