"""Shared building blocks and conventions for every hypermixer-jax model.

Conventions (all models follow them, so any token mixer drops into any block):

* Token mixers are Linen modules called as
  ``mixer(x, *, mask=None, segment_ids=None, positions=None,
  deterministic=True) -> y`` with
  ``x, y: [B, N, d]``; ``mask: [B, N]`` bool, True for real tokens;
  ``segment_ids: [B, N]`` int, 0 for padding and 1, 2, ... for the packed
  examples of a row. When ``segment_ids`` is given, a mixer never mixes tokens
  of different segments. ``positions: [B, N]`` (default ``arange(N)``) is
  each token's position inside its own segment, so that mixers whose weights
  depend on absolute position restart at 0 in every packed example.
  Causality is a module attribute (``causal=True``).
* Every parameter carries logical axis names at creation
  (``nn.with_logical_partitioning``) and the main activations are constrained
  with ``nn.with_logical_constraint``; the rules mapping logical names to mesh
  axes live in the config (see ``hypermixer_jax.sharding``). The logical names
  are the constants below; use them, do not invent new spellings.
* ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
Dtype = Any
Initializer = Callable[..., Array]

# ---------------------------------------------------------------------------
# Logical axis names.
# ---------------------------------------------------------------------------
BATCH = "batch"        # examples
LENGTH = "length"      # tokens / patches of the activations
EMBED = "embed"        # model width d
MLP = "mlp"            # feed-forward hidden width (d_ffn), gMLP channels
HEADS = "heads"        # attention heads / HyperMixer heads
KV = "kv"              # per-head width
HYPER = "hyper"        # HyperMixer hidden width d' (TM-MLP hidden units)
SEQ_IN = "seq_in"      # token-mixing weights indexed by input position (SGU W, Mixer MLP)
SEQ_OUT = "seq_out"    # token-mixing weights indexed by output position
TOKEN_MLP = "token_mlp"  # MLP-Mixer token-mixing hidden width D_S
VOCAB = "vocab"        # vocabulary
PATCH = "patch"        # flattened patch features P*P*3
CLASSES = "classes"    # classifier outputs
EXPERT = "expert"      # MoE experts
NORM = "norm"          # LayerNorm scale / bias (replicated by every preset)
LAYERS = "layers"      # the stacked layers of a scanned stack (scan_layers)

LOGICAL_AXES = (BATCH, LENGTH, EMBED, MLP, HEADS, KV, HYPER, SEQ_IN, SEQ_OUT,
                TOKEN_MLP, VOCAB, PATCH, CLASSES, EXPERT, NORM, LAYERS)

default_kernel_init = nn.initializers.lecun_normal()

def is_box(x: Any) -> bool:
  """A Flax metadata box (``nn.Partitioned``, ``LogicallyPartitioned``...)."""
  return isinstance(x, nn.meta.AxisMetadata)


def path_names(path: tuple[Any, ...]) -> tuple[str, ...]:
  """A pytree key path as plain names: dict keys, attributes, indices."""
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
               for k in path)


def path_str(path: tuple[Any, ...]) -> str:
  """A pytree key path as ``'a/b/0'`` (the form used in logs and errors)."""
  return "/".join(path_names(path))


# Config spellings of the compute / storage dtypes.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}
# The precision policy, ``model.dtype = "auto"`` (every config's default):
# activations and matmul inputs in bfloat16 where the matrix units take it
# natively, float32 on CPUs (where XLA emulates bf16 matmuls, slower than
# float32). Parameters and optimizer state stay float32 (``param_dtype``);
# router and attention softmaxes, LayerNorm statistics and the loss compute
# in float32 whatever the compute dtype.
AUTO = "auto"
AUTO_DTYPES = {"tpu": jnp.bfloat16, "gpu": jnp.bfloat16, "cpu": jnp.float32}


def dtype(value: Any) -> Dtype:
  """A dtype from its config spelling (``'bfloat16'``) or a dtype itself.

  ``'auto'`` is the compute dtype of the platform being built for
  (``AUTO_DTYPES[target_platform()]``): build the model inside the target
  mesh (``jax.sharding.use_abstract_mesh``) to resolve it for devices other
  than the host's.
  """
  if not isinstance(value, str):
    return value
  if value == AUTO:
    return AUTO_DTYPES.get(target_platform(), jnp.bfloat16)
  if value not in DTYPES:
    raise ValueError(f"unknown dtype {value!r}; valid dtypes: "
                     f"{', '.join((AUTO,) + tuple(DTYPES))} ('auto': "
                     "bfloat16 on TPU / GPU, float32 on CPU).")
  return DTYPES[value]


@dataclasses.dataclass(frozen=True)
class ModelFacts:
  """What training needs to know about a model, said by the model's family.

  Attributes:
    head: the model's head, a name of ``hypermixer_jax.heads.HEADS``.
    loss_start: predictions before this position of a full-length row carry
      no loss (sMLP's partial-prediction routing reads the first 20% of each
      row to route); 0: every position counts.
    loss_weights: when ``loss_start``: ``(weights [B, N], segment_ids) ->
      weights`` zeroing, row by row, the positions whose prediction carries
      no loss (the prefix depends on each row's length); else None.
    packing_error: why rows packed with several examples would train on the
      wrong signal, naming the fix; None when packing is fine.
    packing_options: the model options that decide whether it can pack, with
      their values (a config may expose them for the command line).
  """
  head: str
  loss_start: int = 0
  loss_weights: Callable[..., Array] | None = None
  packing_error: str | None = None
  packing_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def partitioned(init: Initializer, axes: Sequence[str | None]) -> Initializer:
  """Wraps ``init`` so the created parameter carries logical axis ``axes``."""
  return nn.with_logical_partitioning(init, tuple(axes))


def constrain(x: Array, axes: Sequence[str | None]) -> Array:
  """Logical sharding constraint on an activation (no-op outside a mesh)."""
  return nn.with_logical_constraint(x, tuple(axes))


def target_platform() -> str:
  """The platform the code is being traced for: ``cpu``, ``gpu`` or ``tpu``.

  The platform of the devices of the mesh in context, else
  ``jax.default_backend()``. The mesh is read from
  ``jax.sharding.get_abstract_mesh()``, which ``jax.set_mesh``,
  ``jax.sharding.use_abstract_mesh`` and ``sharding.within`` (the train and
  eval steps) set and which is readable inside ``jax.jit``; an abstract mesh
  made from a concrete one records its devices' platform. So a step compiled
  for TPU devices from a CPU host (``--mode=compile --topology=...``,
  compile-only devices) is traced for ``tpu``, and an ordinary run for its
  own devices. Automatic implementation choices (block-wise attention,
  chunked HyperMixing) ask this, never the host's backend. Code jitted for
  other devices without a mesh in context (explicit shardings only) gets the
  default backend.
  """
  device = jax.sharding.get_abstract_mesh().abstract_device
  return jax.default_backend() if device is None else device.platform


class Dense(nn.Module):
  """``nn.Dense`` whose kernel and bias carry logical axis names.

  Attributes:
    features: output width.
    axes: logical names of the kernel, ``(in_axis, out_axis)``; the bias
      takes ``out_axis``.
  """
  features: int
  axes: tuple[str | None, str | None]
  use_bias: bool = True
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  kernel_init: Initializer = default_kernel_init
  bias_init: Initializer = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return nn.Dense(
        self.features,
        use_bias=self.use_bias,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=partitioned(self.kernel_init, self.axes),
        bias_init=partitioned(self.bias_init, (self.axes[1],)),
        name="dense")(x)


class DenseGeneral(nn.Module):
  """Dense layer over several axes, with an unflattened, logically named kernel.

  ``nn.DenseGeneral`` creates its kernel flat and reshapes it afterwards, so a
  rank-3 logical annotation meets a rank-2 array under a mesh; this module
  creates the kernel in its real shape instead.

  Attributes:
    features: output shape (trailing axes of the result).
    in_axes: how many trailing input axes are contracted.
    axes: logical names of the kernel ``[*in_shape, *features]``; the bias
      takes the names of ``features``.
  """
  features: tuple[int, ...]
  in_axes: int
  axes: tuple[str | None, ...]
  use_bias: bool = True
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    in_shape = x.shape[x.ndim - self.in_axes:]
    n_in, n_out = len(in_shape), len(self.features)
    init = nn.initializers.lecun_normal(
        in_axis=tuple(range(n_in)),
        out_axis=tuple(range(n_in, n_in + n_out)))
    kernel = self.param("kernel", partitioned(init, self.axes),
                        tuple(in_shape) + tuple(self.features),
                        self.param_dtype)
    x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
    y = jax.lax.dot_general(
        x, kernel, (((tuple(range(x.ndim - n_in, x.ndim))),
                     tuple(range(n_in))), ((), ())))
    if self.use_bias:
      bias = self.param("bias", partitioned(nn.initializers.zeros_init(),
                                            self.axes[n_in:]),
                        tuple(self.features), self.param_dtype)
      y = y + jnp.asarray(bias, self.dtype)
    return y


class LayerNorm(nn.Module):
  """``nn.LayerNorm`` over the last axis, scale and bias named ``axis``."""
  axis: str = NORM
  epsilon: float = 1e-6
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    return nn.LayerNorm(
        epsilon=self.epsilon,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        scale_init=partitioned(nn.initializers.ones_init(), (self.axis,)),
        bias_init=partitioned(nn.initializers.zeros_init(), (self.axis,)),
        name="ln")(x)


def gelu(x: Array, approximate: bool = False) -> Array:
  """Exact (erf) GELU, as in the papers' reference code; ``approximate``:
  the tanh form (Flax's default, used by the official MLP-Mixer release).

  The exact form is ``erf_gelu``: PyTorch's formula with a derivative rule
  that reuses the forward's Phi(x), about 2x cheaper on CPU than
  ``jax.nn.gelu(approximate=False)`` (which evaluates erfc).
  """
  if approximate:
    return nn.gelu(x, approximate=True)
  return erf_gelu(x)


_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


@jax.custom_jvp
def erf_gelu(x: Array) -> Array:
  """``x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))`` (PyTorch's GELU formula).

  Same function as ``jax.nn.gelu(x, approximate=False)``, which computes
  ``0.5 x erfc(-x / sqrt 2)``: erfc costs an exp plus two polynomials and a
  select per element on XLA's CPU backend, erf one polynomial, which made the
  GELUs ~7% of a GLUE-size HyperMixer train step (a one-off profile on one
  CPU core; docs/performance.md, Train-step efficiency, says how to profile).
  The two differ by at most
  ~1e-6 in absolute value (float32 roundings of the same function; in the
  negative tail, where 1 + erf cancels, the erf form keeps that absolute
  accuracy but not a relative one: |GELU(x)| < 0.02 for x < -2). The
  derivative ``Phi(x) + x phi(x)`` reuses the forward's Phi(x).
  """
  return x * _phi_cdf(x)


def _phi_cdf(x: Array) -> Array:
  return 0.5 * (1.0 + jax.lax.erf(x * jnp.asarray(_SQRT_HALF, x.dtype)))


@erf_gelu.defjvp
def _erf_gelu_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  cdf = _phi_cdf(x)
  pdf = jnp.exp(-0.5 * x * x) * jnp.asarray(_INV_SQRT_2PI, x.dtype)
  return x * cdf, dx * (cdf + x * pdf)


def sinusoidal_positions(length: int, dim: int, dtype: Dtype = jnp.float32
                         ) -> Array:
  """Fixed sinusoidal position table ``[length, dim]`` (Vaswani et al.)."""
  pos = jnp.arange(length, dtype=jnp.float32)[:, None]
  half = dim // 2
  freq = jnp.exp(-jnp.log(10000.0) * jnp.arange(half, dtype=jnp.float32)
                 / max(half, 1))
  angles = pos * freq[None, :]
  table = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  if dim % 2:
    table = jnp.pad(table, ((0, 0), (0, 1)))
  return table.astype(dtype)


def resolve_mask(x: Array, mask: Array | None, segment_ids: Array | None
                 ) -> Array | None:
  """Checks and combines the padding mask and the segment ids.

  Returns a ``[B, N]`` bool mask (True = real token) or None when the
  sequence has no padding. Raises ValueError naming the argument when a shape
  does not match ``x``'s ``[B, N]``.
  """
  b, n = x.shape[0], x.shape[1]

  def check(name, value, what):
    if value.shape != (b, n):
      raise ValueError(
          f"{name} has shape {tuple(value.shape)} but x is [B, N, d] = "
          f"{tuple(x.shape)}; pass {what.format(bn=(b, n))}.")

  if mask is not None:
    check("mask", mask, "a [B, N] = {bn} boolean padding mask (True for "
          "real tokens)")
    mask = mask.astype(bool)
  if segment_ids is not None:
    check("segment_ids", segment_ids, "[B, N] = {bn} integer segment ids "
          "(0 for padding)")
    seg_mask = segment_ids > 0
    mask = seg_mask if mask is None else jnp.logical_and(mask, seg_mask)
  return mask


def pair_mask(mask: Array | None, segment_ids: Array | None,
              causal: bool, n_q: int, n_k: int) -> Array | None:
  """``[B or 1, Nq, Nk]`` bool: may query i read key j.

  Combines the key padding mask, segment equality and causality. Returns
  None when nothing is masked.
  """
  out = None
  if mask is not None:
    out = mask[:, None, :n_k]
  if segment_ids is not None:
    same = segment_ids[:, :n_q, None] == segment_ids[:, None, :n_k]
    out = same if out is None else jnp.logical_and(out, same)
  if causal:
    tri = jnp.tril(jnp.ones((n_q, n_k), dtype=bool))[None]
    out = tri if out is None else jnp.logical_and(out, tri)
  return out


def check_width(x: Array, expected: int | None, module: str) -> None:
  """Raises ValueError if ``x``'s feature width differs from ``expected``."""
  if x.ndim != 3:
    raise ValueError(f"{module}: x must be [B, N, d], got shape {x.shape}.")
  if expected is not None and x.shape[-1] != expected:
    raise ValueError(
        f"{module}: x has feature width d={x.shape[-1]} but the module was "
        f"built for d={expected}; set the model's d_model to {x.shape[-1]} or "
        "project the input first.")
