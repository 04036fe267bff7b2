"""Model factory and the papers' named configurations.

``build_model(config)`` turns a model ``ConfigDict`` (CONTRIBUTING.md) into a
Linen ``Model``; ``get_model_config(name)`` returns the configuration of a
named model; ``count_params(config)`` counts its parameters abstractly
(``jax.eval_shape``: nothing is materialised).

Named configurations; in parentheses the paper's parameter count, then ours
(``count_params``; ``tests/zoo_test.py`` checks them against the papers'):

* gMLP image models (Liu et al. 2021, 224x224 images, 16x16 patches, 30
  layers): ``gmlp_ti`` d=128/d_ffn=768 (5.9M; 5.87M), ``gmlp_s`` 256/1536
  (19.5M; 19.42M), ``gmlp_b`` 512/3072 (73.4M; 73.08M).
* MLP-Mixer (Tolstikhin et al. 2021, Table 1): ``mixer_s16`` 8 layers
  C=512 D_S=256 D_C=2048 (18M; 18.53M), ``mixer_b32`` 12/768/384/3072 on 49
  patches (60M; 60.29M), ``mixer_b16`` 12/768/384/3072 on 196 patches (59M;
  59.88M); ``mixer_cifar`` is the small from-scratch setting for 32x32 images
  (P=4, S=64, C=256, D_C=1024, D_S=256; the depth, 8, is our choice; 4.49M).
* ViT-style Transformers on patches (pre-LN attention blocks, learned
  positions, global average pooling): ``vit_ti16`` the DeiT-Ti layout that
  the gMLP paper sets against gMLP-Ti, 12 layers d=192, 3 heads, d_ffn=768,
  224x224 / 16x16 (DeiT-Ti 5.7M; 5.72M); ``vit_cifar`` 6 layers d=256, 4
  heads, d_ffn=1024 on 32x32 / 4x4 (ours; 4.77M, beside ``mixer_cifar``'s
  4.49M and gMLP-Ti laid out for 32x32, ``configs/cifar10.py:gmlp_ti``,
  4.61M).
* HyperMixer paper's equal-size GLUE classifiers (Mai et al. 2023, ~11M
  parameters, FNet 9.5M), ``glue_<mixer>`` for ``hypermixer``,
  ``hypermixer_untied``, ``mlp_mixer``, ``gmlp``, ``attention`` (Transformer),
  ``linear_attention`` (Linear Transformer), ``fnet``. The paper text at hand
  gives only the totals (11M; FNet 9.5M, i.e. 1.5M of token-mixing
  parameters); we reconstruct the shared part as 6 pre-LN layers, d=256,
  d_ffn=512, the BERT uncased WordPiece vocabulary (30,522) and sinusoidal
  positions (none for HyperMixer, whose hypernetworks add them), which gives 9.40M for FNet and 10.98M for the Transformer
  (3-class head), and size every other token mixer to the Transformer's
  ~263k parameters per layer (hyper_dim, token_mlp_dim, gMLP d_ffn): 10.98M
  each.
* ``synthetic_<mixer>`` (``none``, ``mlp_mixer``, ``hypermixer``,
  ``attention``): small per-token regressors for the HyperMixer paper's
  synthetic task (§4.7); sizes are our choice.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from hypermixer_jax import heads
from hypermixer_jax.models import common
from hypermixer_jax.models import encoders
from hypermixer_jax.models import registry
from hypermixer_jax.models.registry import BLOCKS
from hypermixer_jax.models.registry import MIXERS
from hypermixer_jax.models.registry import mixer_class

_choice = registry.choice
_fields = registry.fields


def default_model_config() -> ml_collections.ConfigDict:
  """Every field of the encoder families' config (CONTRIBUTING.md), with
  defaults (``family='text'`` or ``'continuous'``).

  Beyond the contract: ``type_vocab_size`` (token types of sentence pairs, 0
  for none), ``pooling`` (``mean`` over real tokens | ``first`` token) for the
  classification heads, ``patch_size`` (to cut raw ``[B, H, W, C]`` images),
  ``out_dim`` (regression head width), ``conv_stem`` (continuous family:
  kernel sizes of 1-d convolutions + GELU over the sequence after the stem,
  ``()`` for none), ``scale_embeddings`` (text family: token embeddings
  N(0, 1/d) multiplied by sqrt(d), as in the Transformer; False gives BERT's
  unscaled N(0, 0.02^2)), ``approximate_gelu`` (tanh GELU in the blocks'
  MLPs and mixers that take it, as the official MLP-Mixer checkpoints were
  trained), ``scan_layers`` (the layers as one ``nn.scan`` over a layer with
  stacked ``[L, ...]`` parameters: one compiled layer body instead of L, for
  deep models on pods; ``encoders.LayerStack``), ``remat`` (each layer
  rematerialised in the backward pass: ``none`` | ``full`` | ``save_dots`` |
  ``save_dots_no_batch``, ``encoders.REMAT_POLICIES``; the same parameters).
  """
  return ml_collections.ConfigDict(dict(
      family="text",
      mixer="hypermixer",
      block="pre_ln",
      head="mlm",
      num_layers=2,
      d_model=128,
      d_ffn=512,
      dropout_rate=0.1,
      max_len=128,
      vocab_size=30522,
      num_classes=2,
      input_dim=0,
      position_embeddings="sinusoidal",
      dtype="auto",
      param_dtype="float32",
      mixer_kwargs=ml_collections.ConfigDict(),
      type_vocab_size=2,
      pooling="mean",
      patch_size=0,
      out_dim=1,
      conv_stem=(),
      scale_embeddings=True,
      approximate_gelu=False,
      scan_layers=False,
      remat="none",
  ))


def _as_dict(config: Mapping[str, Any]) -> dict[str, Any]:
  return config.to_dict() if hasattr(config, "to_dict") else dict(config)


# ---------------------------------------------------------------------------
# Model families: name -> the builder that owns the family's fields.
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its config fields, its builder and its facts.

  ``module`` (in ``hypermixer_jax.models``) defines ``default_config()``
  (every field the family reads, with defaults), ``build(cfg)`` (the Linen
  module) and ``facts(cfg)`` (``common.ModelFacts``), ``cfg`` a plain dict
  of the defaults updated with the given config.
  """
  module: str

  def _get(self, name: str):
    return getattr(importlib.import_module(
        f"hypermixer_jax.models.{self.module}"), name)

  def default_config(self) -> ml_collections.ConfigDict:
    return self._get("default_config")()

  def build(self, cfg: dict[str, Any]) -> nn.Module:
    return self._get("build")(cfg)

  def facts(self, cfg: dict[str, Any]) -> common.ModelFacts:
    return self._get("facts")(cfg)


# ``text`` and ``continuous`` share the encoder stack of ``encoders.py`` (this
# module builds it: token mixer + block + head); ``smlp`` is the sparse
# all-MLP language model with its own stack.
FAMILIES = {
    "text": Family("zoo"),
    "continuous": Family("zoo"),
    "smlp": Family("smlp"),
}


def _resolve(config: Mapping[str, Any]) -> tuple[Family, dict[str, Any]]:
  """The config's family and its fields (defaults filled in, unknown ones
  refused)."""
  given = _as_dict(config)
  name = _choice("model family", given.get("family", "text"), tuple(FAMILIES))
  family = FAMILIES[name]
  cfg = _as_dict(family.default_config())
  unknown = sorted(set(given) - set(cfg))
  if unknown:
    raise ValueError(
        f"model config fields {unknown} are not fields of model family "
        f"{name!r}; its fields: {', '.join(sorted(cfg))}.")
  cfg.update(given)
  return family, cfg


def build_model(config: Mapping[str, Any]) -> nn.Module:
  """Builds the Linen module described by a model config.

  ``config.family`` names the family (``FAMILIES``) whose builder reads the
  other fields; missing fields take the family's defaults, and a field the
  family does not have is an error. Encoder families raise ValueError,
  listing the valid choices, for an unknown mixer, block, head, dtype or
  mixer kwarg, for ``d_model`` not divisible by the heads, for
  ``block='gmlp'`` around a mixer that is no spatial gating unit, and for a
  ``causal_lm`` head over a mixer that cannot be causal.
  """
  family, cfg = _resolve(config)
  return family.build(cfg)


def model_facts(config: Mapping[str, Any]) -> common.ModelFacts:
  """What training needs to know about ``config``'s model (its head, where
  its loss starts, whether it can train on packed rows)."""
  family, cfg = _resolve(config)
  return family.facts(cfg)


# ---------------------------------------------------------------------------
# The encoder families (``text``, ``continuous``).
# ---------------------------------------------------------------------------
def default_config() -> ml_collections.ConfigDict:
  """The encoder families' fields (``default_model_config``)."""
  return default_model_config()


def build(cfg: dict[str, Any]) -> encoders.Model:
  """The encoder families' builder (see ``build_model``)."""
  family = cfg["family"]
  head = _choice("head", cfg["head"], heads.names_for(family))
  block = _choice("block", cfg["block"], tuple(BLOCKS))
  mixer = _choice("mixer", cfg["mixer"], tuple(MIXERS))
  dtype = common.dtype(cfg["dtype"])
  param_dtype = common.dtype(cfg["param_dtype"])
  causal = head == "causal_lm"
  conv_stem = tuple(int(k) for k in (cfg.get("conv_stem") or ()))
  if conv_stem and family != "continuous":
    raise ValueError(f"conv_stem is only available for the continuous "
                     f"family, got family {family!r}.")
  if any(k < 1 for k in conv_stem):
    raise ValueError(f"conv_stem kernel sizes must be >= 1, got {conv_stem}.")

  kwargs = registry.mixer_kwargs(mixer, cfg, cfg.get("mixer_kwargs"),
                                 causal=causal, dtype=dtype,
                                 param_dtype=param_dtype)
  layer = BLOCKS[block](mixer, kwargs, cfg, dtype, param_dtype)

  return encoders.Model(
      family=family, head=head, layer=layer,
      num_layers=cfg["num_layers"], d_model=cfg["d_model"],
      max_len=cfg["max_len"], vocab_size=cfg["vocab_size"],
      num_classes=cfg["num_classes"], out_dim=cfg["out_dim"],
      input_dim=cfg["input_dim"] or None,
      patch_size=cfg["patch_size"] or None,
      position_embeddings=_choice("position_embeddings",
                                  cfg["position_embeddings"],
                                  encoders.POSITION_EMBEDDINGS),
      type_vocab_size=cfg["type_vocab_size"],
      pooling=_choice("pooling", cfg["pooling"], encoders.POOLINGS),
      final_norm=block != "post_ln", embed_norm=block == "post_ln",
      dropout_rate=cfg["dropout_rate"], conv_stem=conv_stem, dtype=dtype,
      param_dtype=param_dtype, scale_embeddings=bool(cfg["scale_embeddings"]),
      scan_layers=bool(cfg["scan_layers"]),
      remat=_choice("remat", cfg["remat"], tuple(encoders.REMAT_POLICIES)))


def facts(cfg: dict[str, Any]) -> common.ModelFacts:
  """The encoder families' facts.

  Linear attention declared on unpacked rows (``mixer_kwargs.packed=False``)
  cannot train on packed ones. HyperMixing and the MLP-Mixer token MLP, when not causal, give each packed
  example its own hidden layer (one of ``mixer_kwargs.max_segments`` slots);
  with one slot a packed row would mix its examples through one layer.
  """
  head = _choice("head", cfg["head"], heads.names_for(cfg["family"]))
  mixer = _choice("mixer", cfg["mixer"], tuple(MIXERS))
  fields = _fields(mixer_class(mixer))
  if "packed" in fields:
    packed = dict(cfg.get("mixer_kwargs") or {}).get("packed", True)
    return common.ModelFacts(head=head, packing_error=None if packed else (
        f"model.mixer={mixer!r} has mixer_kwargs.packed=False (one example "
        "per row), and tokens of a second packed example would give NaN; "
        "set --config.data.packing=False, or "
        "--config.model.mixer_kwargs.packed=True."),
        packing_options={"packed": packed})
  if "max_segments" not in fields or head == "causal_lm":
    return common.ModelFacts(head=head)
  slots = dict(cfg.get("mixer_kwargs") or {}).get(
      "max_segments", {f.name: f.default for f in dataclasses.fields(
          mixer_class(mixer))}["max_segments"])
  error = None
  if slots < 2:
    error = (
        f"model.mixer={mixer!r} mixes a packed row through one hidden layer "
        f"per example, up to mixer_kwargs.max_segments (now {slots}), and a "
        "row with more examples would give NaN; set "
        "--config.data.packing=False, or "
        "--config.model.mixer_kwargs.max_segments=K with K at least the "
        "examples per row (compute grows with K).")
  return common.ModelFacts(head=head, packing_error=error,
                           packing_options={"max_segments": slots})


def unpacked_mixer_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
  """The options of ``config``'s token mixer for rows of one example each,
  for a config that turns ``data.packing`` off (``registry``)."""
  _, cfg = _resolve(config)
  return registry.unpacked_mixer_kwargs(cfg["mixer"]) if "mixer" in cfg else {}


def causal_mixer_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
  """The options of ``config``'s token mixer that a causal config sets, at
  their defaults, so that the command line can change them (``registry``)."""
  _, cfg = _resolve(config)
  return registry.causal_mixer_kwargs(cfg["mixer"]) if "mixer" in cfg else {}


def token_mixer(name: str, length: int) -> tuple[nn.Module, int]:
  """``(module, d_model)``: the token mixer of zoo config ``name`` alone,
  built for rows of ``length`` tokens (a mixer with weights per position
  takes ``max_len=length``)."""
  cfg = get_model_config(name)
  cls = mixer_class(cfg.mixer)
  kwargs = dict(cfg.mixer_kwargs)
  if "max_len" in {f.name for f in dataclasses.fields(cls)}:
    kwargs["max_len"] = length
  return cls(**kwargs), int(cfg.d_model)


def dummy_inputs(config: Mapping[str, Any], batch: int = 1,
                 length: int | None = None) -> jax.Array | jax.ShapeDtypeStruct:
  """Abstract inputs of the right shape and dtype for ``config``."""
  n = length or config["max_len"]
  if config["family"] != "continuous":
    return jax.ShapeDtypeStruct((batch, n), jnp.int32)
  return jax.ShapeDtypeStruct((batch, n, config["input_dim"]), jnp.float32)


def abstract_variables(config: Mapping[str, Any]):
  """``jax.eval_shape`` of the model's init: shapes only, no memory."""
  model = build_model(config)
  x = dummy_inputs(config)
  return jax.eval_shape(
      lambda k, x: model.init(k, jnp.zeros(x.shape, x.dtype)),
      jax.random.key(0), x)


# Parameter sizes per counted config (its JSON): a study's report counts
# each model twice (total, then outside the embedding), and tracing a
# paper-size init is the slow part.
_SIZES: dict[str, list[tuple[frozenset[str], int]]] = {}


def count_params(config: Mapping[str, Any], under: str | None = None) -> int:
  """Number of parameters of ``config``'s model, counted abstractly.

  With ``under``, counts only parameters whose path contains a module named
  ``under`` (e.g. ``'token_mixing'``).
  """
  key = ml_collections.ConfigDict(config).to_json(sort_keys=True)
  if key not in _SIZES:
    if len(_SIZES) >= 512:
      _SIZES.clear()
    params = nn.unbox(abstract_variables(config))["params"]
    _SIZES[key] = [(frozenset(common.path_names(path)),
                    int(np.prod(leaf.shape)))
                   for path, leaf in jax.tree_util.tree_leaves_with_path(params)]
  return sum(n for names, n in _SIZES[key] if under is None or under in names)


# ---------------------------------------------------------------------------
# Named configurations.
# ---------------------------------------------------------------------------
def _config(**overrides) -> ml_collections.ConfigDict:
  cfg = default_model_config()
  mixer_kwargs = overrides.pop("mixer_kwargs", {})
  cfg.update(overrides)
  cfg.mixer_kwargs = ml_collections.ConfigDict(mixer_kwargs)
  return cfg


def _image(image_size: int, patch: int, num_classes: int = 1000, **kw
           ) -> ml_collections.ConfigDict:
  return _config(**{**dict(
      family="continuous", head="image", num_classes=num_classes,
      max_len=(image_size // patch) ** 2, input_dim=patch * patch * 3,
      patch_size=patch, position_embeddings="none", type_vocab_size=0,
      dropout_rate=0.0), **kw})


def _vit_image(image_size, patch, layers, d, heads, d_ffn, num_classes=1000):
  """A ViT-style pre-LN Transformer on patches: learned positions, global
  average pooling and the final LN before the head (as our gMLP and Mixer;
  ViT/DeiT read a [CLS] token instead)."""
  return _image(image_size, patch, mixer="attention", block="pre_ln",
                num_layers=layers, d_model=d, d_ffn=d_ffn,
                num_classes=num_classes, position_embeddings="learned",
                mixer_kwargs=dict(num_heads=heads))


def _gmlp_image(d: int, d_ffn: int) -> ml_collections.ConfigDict:
  return _image(224, 16, mixer="gmlp", block="gmlp", num_layers=30,
                d_model=d, d_ffn=d_ffn)


def _mixer_image(image_size, patch, layers, c, d_s, d_c, num_classes=1000):
  return _image(image_size, patch, mixer="mlp_mixer", block="pre_ln",
                num_layers=layers, d_model=c, d_ffn=d_c,
                num_classes=num_classes,
                mixer_kwargs=dict(token_mlp_dim=d_s))


# HyperMixer paper (§4.3): shared part of every GLUE model; token mixers are
# sized to the Transformer's 4 d^2 + 4 d = 263,168 parameters per layer.
_GLUE_MIXERS = {
    # Tied hypernetworks are the paper's default (§2.3); untied its ablation.
    "hypermixer": ("hypermixer", dict(hyper_dim=768, tied=True)),
    "hypermixer_untied": ("hypermixer", dict(hyper_dim=256)),
    "mlp_mixer": ("mlp_mixer", dict(token_mlp_dim=512)),
    "gmlp": ("gmlp", dict(d_ffn=512)),
    "attention": ("attention", dict(num_heads=4)),
    "linear_attention": ("linear_attention", dict(num_heads=4)),
    "fnet": ("fnet", {}),
}


def _glue(mixer_name: str) -> ml_collections.ConfigDict:
  mixer, kwargs = _GLUE_MIXERS[mixer_name]
  # A mixer that adds positions itself (HyperMixing's hypernetworks) gets
  # none in the residual stream; the other models add sinusoids.
  positions = "none" if registry.adds_positions(mixer) else "sinusoidal"
  return _config(family="text", mixer=mixer, block="pre_ln",
                 head="pair_classify", num_layers=6, d_model=256, d_ffn=512,
                 dropout_rate=0.1, max_len=256, vocab_size=30522,
                 num_classes=3, position_embeddings=positions,
                 mixer_kwargs=kwargs)


_SYNTHETIC_MIXERS = {
    "none": {},
    "mlp_mixer": dict(token_mlp_dim=64),
    "hypermixer": dict(hyper_dim=64),
    "attention": dict(num_heads=1),
}


def _synthetic(mixer: str) -> ml_collections.ConfigDict:
  return _config(family="continuous", mixer=mixer, block="pre_ln",
                 head="regression", num_layers=2, d_model=64, d_ffn=128,
                 dropout_rate=0.0, max_len=100, input_dim=1, out_dim=1,
                 position_embeddings="none", type_vocab_size=0,
                 conv_stem=(5, 5), mixer_kwargs=_SYNTHETIC_MIXERS[mixer])


_NAMED = {
    "gmlp_ti": lambda: _gmlp_image(128, 768),
    "gmlp_s": lambda: _gmlp_image(256, 1536),
    "gmlp_b": lambda: _gmlp_image(512, 3072),
    "mixer_s16": lambda: _mixer_image(224, 16, 8, 512, 256, 2048),
    "mixer_b32": lambda: _mixer_image(224, 32, 12, 768, 384, 3072),
    "mixer_b16": lambda: _mixer_image(224, 16, 12, 768, 384, 3072),
    "mixer_cifar": lambda: _mixer_image(32, 4, 8, 256, 256, 1024, 10),
    "vit_ti16": lambda: _vit_image(224, 16, 12, 192, 3, 768),
    "vit_cifar": lambda: _vit_image(32, 4, 6, 256, 4, 1024, 10),
    **{f"glue_{m}": functools.partial(_glue, m) for m in _GLUE_MIXERS},
    **{f"synthetic_{m}": functools.partial(_synthetic, m)
       for m in _SYNTHETIC_MIXERS},
}

# Parameter counts the papers report (for the tests and the smoke table).
PAPER_PARAMS = {
    "gmlp_ti": 5.9e6, "gmlp_s": 19.5e6, "gmlp_b": 73.4e6,
    "mixer_s16": 18e6, "mixer_b32": 60e6, "mixer_b16": 59e6,
    "vit_ti16": 5.7e6,  # DeiT-Ti (Touvron et al. 2021), the gMLP paper's peer
    **{f"glue_{m}": 11e6 for m in _GLUE_MIXERS if m != "fnet"},
    "glue_fnet": 9.5e6,
}


def model_names() -> tuple[str, ...]:
  """Names accepted by ``get_model_config``."""
  return tuple(_NAMED)


def get_model_config(name: str) -> ml_collections.ConfigDict:
  """The model config of a named configuration (see the module docstring)."""
  return _NAMED[_choice("model name", name, tuple(_NAMED))]()
