"""Token mixers, blocks, encoders and the model factory of hypermixer-jax.

``build_model(config.model)`` is the entry point (``config.model.family``
picks the builder, ``FAMILIES``); ``model_facts(config.model)`` says what
training needs to know about the model; ``get_model_config(name)`` gives the
papers' named configurations (see ``zoo.py``).
"""
from hypermixer_jax.models.common import ModelFacts
from hypermixer_jax.models.attention import LinearAttention
from hypermixer_jax.models.attention import SelfAttention
from hypermixer_jax.models.blocks import FeedForward
from hypermixer_jax.models.blocks import MixerBlock
from hypermixer_jax.models.encoders import ContinuousEncoder
from hypermixer_jax.models.encoders import LayerStack
from hypermixer_jax.models.encoders import MlmHead
from hypermixer_jax.models.encoders import Model
from hypermixer_jax.models.encoders import TextEncoder
from hypermixer_jax.models.encoders import patchify
from hypermixer_jax.models.fnet import FourierMixing
from hypermixer_jax.models.fnet import IdentityMixing
from hypermixer_jax.models.gmlp import GmlpBlock
from hypermixer_jax.models.gmlp import SpatialGatingUnit
from hypermixer_jax.models.gmlp import TinyAttention
from hypermixer_jax.models.hypermixer import HyperMixing
from hypermixer_jax.models.mlp_mixer import MlpMixerTokenMixing
from hypermixer_jax.models.zoo import FAMILIES
from hypermixer_jax.models.zoo import MIXERS
from hypermixer_jax.models.zoo import build_model
from hypermixer_jax.models.zoo import causal_mixer_kwargs
from hypermixer_jax.models.zoo import count_params
from hypermixer_jax.models.zoo import default_model_config
from hypermixer_jax.models.zoo import get_model_config
from hypermixer_jax.models.zoo import model_facts
from hypermixer_jax.models.zoo import model_names
from hypermixer_jax.models.zoo import unpacked_mixer_kwargs

__all__ = [
    "ContinuousEncoder", "FAMILIES", "FeedForward", "FourierMixing", "GmlpBlock",
    "HyperMixing", "IdentityMixing", "LayerStack", "LinearAttention",
    "MIXERS", "MixerBlock", "MlmHead", "MlpMixerTokenMixing", "Model",
    "ModelFacts",
    "SelfAttention", "SpatialGatingUnit", "TextEncoder", "TinyAttention",
    "build_model", "causal_mixer_kwargs", "count_params",
    "default_model_config", "get_model_config", "model_facts", "model_names",
    "patchify", "unpacked_mixer_kwargs",
]
