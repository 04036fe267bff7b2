"""Fingerprints of a checkpoint's arrays, checked when it is read back.

Orbax keeps no checksums: a bit flipped in a data file restores silently
(an optimiser moment turns NaN a few steps later, far from the cause). So
each checkpoint records, beside its arrays, one fingerprint per array:

    fingerprint(x) = (sum_i  b_i * w_i,  sum_i  mix(b_i ^ g * i))   mod 2^32

where ``b_i`` are the raw bits of element ``i`` (``x`` bit-cast to unsigned
integers), ``i`` its row-major index, ``w_i = g * (2 i + 1)`` odd, ``g`` the
golden-ratio constant and ``mix`` a 32-bit integer finaliser. The first sum
changes under any single flipped bit (an odd weight times ``2^k`` is never
0 mod 2^32), the second under reorderings and most multi-bit damage. Both
are wrapping sums, so they do not depend on how the array is split across
devices: a checkpoint written on 8 devices checks on 1. They are computed
by ``jax.jit`` over each global array (each device reduces its shards; only
the 12-byte result leaves the devices), so no host copy of the state is
made and every process gets the same values; arrays in host memory already
(NumPy, CPU devices) are reduced with NumPy, with nothing to compile. Only
the primary process writes the record (Orbax's ``JsonCheckpointHandler``).

When a checkpoint is read, the same code recomputes the fingerprints of the
restored arrays and checks that every floating-point value is finite;
``problems`` lists what differs. A checkpoint written before fingerprints
existed has no record: it is checked for finiteness only.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from hypermixer_jax.models import common

PyTree = Any
# The record's item name in a checkpoint step and its format version.
ITEM = "fingerprints"
VERSION = 1
_GOLDEN = 0x9E3779B1


def _bits(x: jax.Array) -> jax.Array:
  """The raw bits of ``x`` as uint32 (8-byte types: a trailing axis of 2)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}
  bits = jax.lax.bitcast_convert_type(x, unsigned[x.dtype.itemsize])
  return bits.astype(jnp.uint32)


def _mix(v):
  """A 32-bit integer finaliser (every input bit reaches every output bit);
  of a uint32 ``jax.Array`` or NumPy array."""
  v = v ^ (v >> 16)
  v = v * np.uint32(0x7FEB352D)
  v = v ^ (v >> 15)
  v = v * np.uint32(0x846CA68B)
  return v ^ (v >> 16)


def _digest(x: jax.Array) -> jax.Array:
  """``[2]`` uint32: the two wrapping sums of the module docstring."""
  bits = _bits(x)
  # The row-major index from per-axis iotas: no reshape, so a sharded array
  # is reduced where it lies.
  index = jnp.zeros(bits.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(bits.ndim)):
    index = index + (jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
                     * jnp.uint32(stride % 2**32))
    stride *= bits.shape[axis]
  g = jnp.uint32(_GOLDEN)
  weighted = jnp.sum(bits * ((index * jnp.uint32(2) + jnp.uint32(1)) * g),
                     dtype=jnp.uint32)
  mixed = jnp.sum(_mix(bits ^ (index * g)), dtype=jnp.uint32)
  return jnp.stack([weighted, mixed])


def _finite(x: jax.Array) -> jax.Array:
  """True unless a floating-point ``x`` holds a NaN or an Inf."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.all(jnp.isfinite(x))
  return jnp.ones((), jnp.bool_)


def _on_host(x) -> bool:
  """Whether ``x`` is in this host's memory already: a NumPy array, or a
  CPU ``jax.Array`` whose shards are all this process's."""
  if isinstance(x, np.ndarray):
    return True
  return x.is_fully_addressable and all(
      d.platform == "cpu" for d in x.sharding.device_set)


def _host_summary(x, chunk: int = 1 << 22) -> np.ndarray:
  """``_digest`` and ``_finite`` of an array in host memory, with NumPy
  (no program to compile), ``chunk`` elements at a time."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  x = np.asarray(x)
  finite = (not jnp.issubdtype(x.dtype, jnp.inexact)
            or bool(np.isfinite(x).all()))
  if x.dtype == np.bool_:
    x = x.astype(np.uint8)
  unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}
  bits = np.ascontiguousarray(x).view(unsigned[x.dtype.itemsize]).reshape(-1)
  g = np.uint32(_GOLDEN)
  weighted = mixed = 0
  for start in range(0, bits.size, chunk):
    b = bits[start:start + chunk].astype(np.uint32)
    # Indices mod 2^32, as the devices' uint32 iotas wrap.
    index = np.arange(start, start + b.size, dtype=np.uint64).astype(
        np.uint32)
    weighted += int(np.sum(b * ((index * np.uint32(2) + np.uint32(1)) * g),
                           dtype=np.uint32))
    mixed += int(np.sum(_mix(b ^ (index * g)), dtype=np.uint32))
  return np.array([weighted % 2**32, mixed % 2**32, finite], np.uint32)


@functools.lru_cache(maxsize=None)
def _summarise(out_sharding):
  """The jitted ``array -> [3] uint32`` (the two sums, then 1 if finite).

  One array per call: jit then compiles once per shape, dtype and sharding,
  and a model's layers, their optimiser moments and every later save share
  those few small programs (one program over the whole tree compiled anew
  for each tree and layout, seconds for a few hundred arrays).
  """
  return jax.jit(
      lambda x: jnp.append(_digest(x), _finite(x).astype(jnp.uint32)),
      out_shardings=out_sharding)


def _replicated(x) -> jax.sharding.Sharding | None:
  """A replicated sharding on the array's mesh, so every process can read
  the result; None (jit's choice) for an array without a mesh."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  return jax.sharding.NamedSharding(sharding.mesh,
                                    jax.sharding.PartitionSpec())


def _host(x: jax.Array) -> np.ndarray:
  """A replicated result on this host (its first addressable copy)."""
  if isinstance(x, jax.Array):
    return np.asarray(x.addressable_data(0))
  return np.asarray(x)


def summarise(tree: PyTree, *, on_host: bool | None = None
              ) -> tuple[dict[str, str], dict[str, bool]]:
  """``(fingerprints, finite)`` of every array of ``tree``, by ``/``-path.

  A fingerprint is ``'<dtype>[<shape>]:<hex>-<hex>'``; ``finite`` is False
  for a floating-point array holding a NaN or an Inf. ``on_host``: reduce
  the arrays with NumPy (True) or on their devices (False); by default,
  those already in this host's memory (NumPy, CPU devices) with NumPy, the
  others on their devices. Both give the same bits.
  """
  flat = [(common.path_str(p), x) for p, x in
          jax.tree_util.tree_flatten_with_path(tree)[0]
          if isinstance(x, (jax.Array, np.ndarray))]
  # One array's program at a time: many multi-device programs in flight
  # at once can starve XLA:CPU's collectives of threads (a deadlock).
  results = [_host_summary(x)
             if (_on_host(x) if on_host is None else on_host)
             else _host(_summarise(_replicated(x))(x)) for _, x in flat]
  prints, flags = {}, {}
  for (path, x), r in zip(flat, results):
    a, b, finite = (int(v) for v in r)
    shape = ",".join(str(n) for n in x.shape)
    prints[path] = f"{x.dtype}[{shape}]:{a:08x}-{b:08x}"
    flags[path] = bool(finite)
  return prints, flags


def record(tree: PyTree, where: str) -> dict[str, Any]:
  """The JSON record saved beside a checkpoint of ``tree``; refused with
  FloatingPointError (naming the arrays and ``where``) when an array of
  ``tree`` holds NaN/Inf: a state that is not finite is never saved,
  whatever the loss said."""
  prints, finite = summarise(tree)
  bad = [path for path, ok in finite.items() if not ok]
  if bad:
    raise FloatingPointError(
        f"{where}: {len(bad)} array(s) of the state hold NaN/Inf ("
        + ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
        + "); not saved, stopping.")
  return {"version": VERSION, "arrays": prints}


def problems(tree: PyTree, saved: Mapping[str, Any] | None, *,
             prefix: str = "", complete: bool = False) -> list[str]:
  """What is wrong with ``tree`` as read back from a checkpoint.

  ``saved``: the checkpoint's ``record`` (None: it has none, so only
  finiteness is checked). ``prefix``: the path of ``tree`` inside the saved
  tree (``'params/'`` for parameters read alone). Arrays the record does not
  hold, or read with another dtype (a cast on restore), are not compared,
  unless ``complete``: ``tree`` is the whole saved tree read at its saved
  dtypes (``--mode=verify``), so an array the record lacks, a record entry
  without its array and a dtype other than the recorded one are problems
  (the record or the arrays were altered) rather than skipped.
  Returns one short description per kind of problem (empty: all good).
  """
  prints, finite = summarise(tree)
  recorded = (saved or {}).get("arrays", {})
  differ = sorted(p for p, fp in prints.items()
                  if prefix + p in recorded and recorded[prefix + p] != fp
                  and _same_type(recorded[prefix + p], fp))
  out = []
  if differ:
    out.append(f"fingerprint mismatch in {_some(prefix, differ)}")
  if complete and saved is not None:
    out += _uncovered(prints, recorded, prefix)
  bad = sorted(p for p, ok in finite.items() if not ok)
  if bad:
    out.append(f"NaN/Inf in {_some(prefix, bad)}")
  return out


def _uncovered(prints: Mapping[str, str], recorded: Mapping[str, str],
               prefix: str) -> list[str]:
  """What of ``prints`` the record ``recorded`` does not vouch for."""
  out = []
  unrecorded = sorted(p for p in prints if prefix + p not in recorded)
  if unrecorded:
    out.append(f"no fingerprint recorded for {_some(prefix, unrecorded)}")
  retyped = sorted(p for p, fp in prints.items() if prefix + p in recorded
                   and not _same_type(recorded[prefix + p], fp))
  if retyped:
    out.append(f"dtype or shape other than recorded in "
               f"{_some(prefix, retyped)}")
  orphans = sorted(k[len(prefix):] for k in recorded
                   if k.startswith(prefix) and k[len(prefix):] not in prints)
  if orphans:
    out.append(f"recorded arrays missing from the checkpoint: "
               f"{_some(prefix, orphans)}")
  return out


def _same_type(a: str, b: str) -> bool:
  return a.split(":", 1)[0] == b.split(":", 1)[0]


def _some(prefix: str, paths: list[str], shown: int = 3) -> str:
  names = ", ".join(prefix + p for p in paths[:shown])
  more = len(paths) - shown
  return names + (f" and {more} more array(s)" if more > 0 else "")
