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
inside one ``jax.jit`` over the global arrays (each device reduces its
shards; only the 8-byte results leave the devices), so no host copy of the
state is made and every process gets the same values; only the primary
process writes the record (Orbax's ``JsonCheckpointHandler``).

When a checkpoint is read, the same jit recomputes the fingerprints of the
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


def _mix(v: jax.Array) -> jax.Array:
  """A 32-bit integer finaliser (every input bit reaches every output bit)."""
  v = v ^ (v >> 16)
  v = v * jnp.uint32(0x7FEB352D)
  v = v ^ (v >> 15)
  v = v * jnp.uint32(0x846CA68B)
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
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.all(jnp.isfinite(x))
  return jnp.ones((), jnp.bool_)


@functools.lru_cache(maxsize=None)
def _summarise(out_sharding):
  """The jitted ``tree -> (digests, finite flags)`` (one per mesh)."""
  return jax.jit(lambda tree: (jax.tree.map(_digest, tree),
                               jax.tree.map(_finite, tree)),
                 out_shardings=out_sharding)


def _replicated(leaves) -> jax.sharding.Sharding | None:
  """A replicated sharding on the leaves' mesh, so every process can read
  the results; None (jit's choice) for unsharded or mixed leaves."""
  meshes = {x.sharding.mesh for x in leaves
            if isinstance(getattr(x, "sharding", None),
                          jax.sharding.NamedSharding)}
  if len(meshes) != 1:
    return None
  return jax.sharding.NamedSharding(meshes.pop(), jax.sharding.PartitionSpec())


def _host(x: jax.Array) -> np.ndarray:
  """A replicated result on this host (its first addressable copy)."""
  if isinstance(x, jax.Array):
    return np.asarray(x.addressable_data(0))
  return np.asarray(x)


def summarise(tree: PyTree) -> tuple[dict[str, str], dict[str, bool]]:
  """``(fingerprints, finite)`` of every array of ``tree``, by ``/``-path.

  A fingerprint is ``'<dtype>[<shape>]:<hex>-<hex>'``; ``finite`` is False
  for a floating-point array holding a NaN or an Inf.
  """
  flat = [(common.path_str(p), x) for p, x in
          jax.tree_util.tree_flatten_with_path(tree)[0]
          if isinstance(x, (jax.Array, np.ndarray))]
  if not flat:
    return {}, {}
  arrays = [x for _, x in flat]
  digests, finite = _summarise(_replicated(arrays))(arrays)
  prints, flags = {}, {}
  for (path, x), d, f in zip(flat, digests, finite):
    a, b = (int(v) for v in _host(d))
    shape = ",".join(str(n) for n in x.shape)
    prints[path] = f"{x.dtype}[{shape}]:{a:08x}-{b:08x}"
    flags[path] = bool(_host(f))
  return prints, flags


def record(tree: PyTree) -> dict[str, Any]:
  """The JSON record saved beside a checkpoint of ``tree``."""
  prints, _ = summarise(tree)
  return {"version": VERSION, "arrays": prints}


def problems(tree: PyTree, saved: Mapping[str, Any] | None, *,
             prefix: str = "") -> list[str]:
  """What is wrong with ``tree`` as read back from a checkpoint.

  ``saved``: the checkpoint's ``record`` (None: it has none, so only
  finiteness is checked). ``prefix``: the path of ``tree`` inside the saved
  tree (``'params/'`` for parameters read alone). Arrays the record does not
  hold, or read with another dtype (a cast on restore), are not compared.
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
  bad = sorted(p for p, ok in finite.items() if not ok)
  if bad:
    out.append(f"NaN/Inf in {_some(prefix, bad)}")
  return out


def _same_type(a: str, b: str) -> bool:
  return a.split(":", 1)[0] == b.split(":", 1)[0]


def _some(prefix: str, paths: list[str], shown: int = 3) -> str:
  names = ", ".join(prefix + p for p in paths[:shown])
  more = len(paths) - shown
  return names + (f" and {more} more array(s)" if more > 0 else "")
