"""Token mixers and layer blocks by name: the one registry every family reads.

A token mixer is a Linen module with the mixer contract (CONTRIBUTING.md)
registered below by one line, ``name: Mixer(module, class[, preset])``. The
mixer's class owns its defaults; the registry knows no mixer by name:

* a field named like a model field (``max_len``, ``d_ffn``,
  ``approximate_gelu``) takes the model's value;
* ``model_defaults(model) -> dict`` (a classmethod, optional) derives the
  others from the model config, e.g. HyperMixing's ``hyper_dim = d_model``;
* the registry line's ``preset`` fixes fields for that name (``amlp`` is the
  gMLP unit with tiny attention);
* ``causal_by_construction`` (a class attribute, optional) marks a mixer
  that never reads a later position without a ``causal`` field;
* ``unpacked_kwargs`` (a class attribute, optional) are the options for
  rows that hold one example each (``unpacked_mixer_kwargs``);
* ``causal_options`` (a class attribute, optional) names the fields a
  causal config sets explicitly, at their defaults, so that the command line
  can change them (``causal_mixer_kwargs``);
* ``adds_positions`` (a class attribute, optional) marks a mixer that adds
  positions itself, so that a model on it needs none in its residual stream;
  ``position_aware`` one whose weights are indexed by position (the spatial
  gating unit, the MLP-Mixer token MLP), which the sMLP family therefore
  gives no positions either.

The user's ``mixer_kwargs`` override all of them. A block (``BLOCKS``) wraps
a mixer factory into one layer of the stack.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import types
from typing import Any, Callable, Mapping, NamedTuple

import flax.linen as nn

from hypermixer_jax.models import blocks


class Mixer(NamedTuple):
  """A registry line: ``module`` (relative to ``hypermixer_jax.models`` when
  it starts with a dot), the class in it, and fields fixed for this name."""
  module: str
  cls: str
  preset: Mapping[str, Any] = types.MappingProxyType({})


MIXERS = {
    "hypermixer": Mixer(".hypermixer", "HyperMixing"),
    "mlp_mixer": Mixer(".mlp_mixer", "MlpMixerTokenMixing"),
    "gmlp": Mixer(".gmlp", "SpatialGatingUnit"),
    # aMLP: gMLP with one attention head of size 64 (gMLP paper, Sec. 4.3).
    "amlp": Mixer(".gmlp", "SpatialGatingUnit", {"tiny_attention_dim": 64}),
    "attention": Mixer(".attention", "SelfAttention"),
    "linear_attention": Mixer(".attention", "LinearAttention"),
    "fnet": Mixer(".fnet", "FourierMixing"),
    "none": Mixer(".fnet", "IdentityMixing"),
}
# The model fields a mixer field of the same name takes by default.
_SHARED_FIELDS = ("max_len", "d_ffn", "approximate_gelu")


def choice(kind: str, value: str, valid) -> str:
  """``value`` if it is one of ``valid``, else a ValueError listing them."""
  if value not in valid:
    raise ValueError(f"unknown {kind} {value!r}; valid {kind}s: "
                     f"{', '.join(valid)}.")
  return value


def fields(cls) -> tuple[str, ...]:
  """The dataclass fields a module class takes (without Linen's own)."""
  return tuple(f.name for f in dataclasses.fields(cls)
               if f.name not in ("parent", "name"))


def mixer_class(name: str) -> type[nn.Module]:
  """The token-mixer class registered under ``name``."""
  entry = MIXERS[choice("mixer", name, tuple(MIXERS))]
  module = importlib.import_module(entry.module, package=__package__)
  return getattr(module, entry.cls)


def options(name: Any) -> tuple[type[nn.Module], tuple[str, ...]] | None:
  """``(class, its fields)`` of registered mixer ``name``; None for any
  other value (a config's checks name the problem in their own words)."""
  if not isinstance(name, str) or name not in MIXERS:
    return None
  cls = mixer_class(name)
  return cls, fields(cls)


def can_be_causal(cls) -> bool:
  return (getattr(cls, "causal_by_construction", False)
          or "causal" in fields(cls))


def mixer_defaults(name: str, model: Mapping[str, Any]) -> dict[str, Any]:
  """The keyword arguments mixer ``name`` takes from a model config
  (``model`` needs ``d_model`` and the shared fields), before the user's."""
  cls = mixer_class(name)
  names = fields(cls)
  kwargs = {k: model[k] for k in _SHARED_FIELDS if k in names and k in model}
  if hasattr(cls, "model_defaults"):
    kwargs.update(cls.model_defaults(model))
  kwargs.update(MIXERS[name].preset)
  return kwargs


def mixer_kwargs(name: str, model: Mapping[str, Any], user: Mapping[str, Any],
                 *, causal: bool, **fixed) -> dict[str, Any]:
  """Validated keyword arguments of mixer ``name``: its defaults from
  ``model``, the ``user``'s ``mixer_kwargs`` over them, then ``fixed``
  (e.g. dtypes) and ``causal=True`` when ``causal``."""
  cls = mixer_class(name)
  names = fields(cls)
  user = dict(user or {})
  unknown = sorted(set(user) - set(names))
  if unknown:
    raise ValueError(
        f"unknown mixer_kwargs {unknown} for mixer {name!r} "
        f"({cls.__name__}); valid: {', '.join(sorted(names))}.")
  kwargs = {**mixer_defaults(name, model), **user}
  if causal:
    if "causal" in names:
      if user.get("causal") is False:
        raise ValueError("head 'causal_lm' needs a causal mixer but "
                         "mixer_kwargs sets causal=False.")
      kwargs["causal"] = True
    elif not getattr(cls, "causal_by_construction", False):
      capable = [m for m in MIXERS if can_be_causal(mixer_class(m))]
      raise ValueError(
          f"head 'causal_lm' needs a causal token mixer, but mixer "
          f"{name!r} ({cls.__name__}) has no causal mode (every output "
          "would read later tokens); causal mixers: "
          f"{', '.join(capable)}.")
  heads = kwargs.get("num_heads")
  if heads and model["d_model"] % heads:
    raise ValueError(
        f"d_model={model['d_model']} is not divisible by num_heads={heads} of "
        f"mixer {name!r}; choose num_heads dividing d_model.")
  kwargs.update(fixed)
  return kwargs


def unpacked_mixer_kwargs(name: str) -> dict[str, Any]:
  """Mixer ``name``'s options for rows of one example each (a config that
  turns ``data.packing`` off sets them; empty for most mixers)."""
  return dict(getattr(mixer_class(name), "unpacked_kwargs", {}))


def causal_mixer_kwargs(name: str) -> dict[str, Any]:
  """Mixer ``name``'s ``causal_options`` at their defaults (empty for most
  mixers), for a causal config to set (a locked config takes command-line
  overrides only of the fields it has)."""
  cls = mixer_class(name)
  defaults = {f.name: f.default for f in dataclasses.fields(cls)}
  return {k: defaults[k] for k in getattr(cls, "causal_options", ())}


def adds_positions(name: str) -> bool:
  return bool(getattr(mixer_class(name), "adds_positions", False))


# ---------------------------------------------------------------------------
# Blocks: name -> builder(mixer name, mixer kwargs, model config, dtype,
# param_dtype) -> the layer factory ``layer(name=...)`` of the stack.
# ---------------------------------------------------------------------------
def _mixer_block(name, kwargs, model, dtype, param_dtype):
  return functools.partial(
      blocks.MixerBlock, functools.partial(mixer_class(name), **kwargs),
      d_ffn=model["d_ffn"], layout=model["block"],
      dropout_rate=model["dropout_rate"],
      approximate_gelu=model["approximate_gelu"], dtype=dtype,
      param_dtype=param_dtype)


def _gmlp_block(name, kwargs, model, dtype, param_dtype):
  """gMLP's own block, around a spatial gating unit (no separate FFN); the
  unit's dropout defaults to the model's."""
  gmlp = importlib.import_module(".gmlp", package=__package__)
  sgu = lambda m: issubclass(mixer_class(m), gmlp.SpatialGatingUnit)
  if not sgu(name):
    units = " or ".join(repr(m) for m in MIXERS if sgu(m))
    raise ValueError(f"block 'gmlp' is gMLP's own block and needs mixer "
                     f"{units}, got {name!r}; use block 'pre_ln' "
                     "or 'post_ln' for other mixers.")
  kwargs = dict(kwargs)
  kwargs.setdefault("dropout_rate", model["dropout_rate"])
  return functools.partial(
      gmlp.GmlpBlock, functools.partial(mixer_class(name), **kwargs),
      dropout_rate=kwargs["dropout_rate"], dtype=dtype,
      param_dtype=param_dtype)


BLOCKS: dict[str, Callable[..., Callable[..., nn.Module]]] = {
    "pre_ln": _mixer_block,
    "post_ln": _mixer_block,
    "gmlp": _gmlp_block,
}
