"""The sMLP family's token mixers come from the registry (``smlp.token_mixer``).

Any registry mixer with a causal mode drops into the family's dense and
sparse blocks; 'sgu' (earlier configs) is the same model as 'gmlp'.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax import models
from hypermixer_jax.models import registry
from hypermixer_jax.models import smlp

COLLECTIONS = ["aux_loss", "moe_metrics"]


def _cfg(mixer, **kw):
  cfg = smlp.smlp_config("tiny")
  cfg.token_mixer = mixer
  cfg.moe.tmoe_router = "switch"
  cfg.update(kw)
  return cfg


def _logits(cfg, tokens, params=None):
  """The model's logits and parameters, each one jitted program (op by op,
  every operation of the model would compile on its own)."""
  model = models.build_model(cfg)
  if params is None:
    params = jax.jit(model.init)(jax.random.key(1), tokens[:1])["params"]
  logits, _ = jax.jit(lambda p, x: model.apply({"params": p}, x,
                                               mutable=COLLECTIONS))(
                                                   params, tokens)
  return np.asarray(logits), params


def test_every_causal_registry_mixer_is_a_token_mixer_of_the_family():
  causal = [m for m in registry.MIXERS
            if registry.can_be_causal(registry.mixer_class(m))]
  assert {"gmlp", "attention", "hypermixer", "linear_attention"} <= set(causal)
  for name in causal:
    if name == "amlp":
      continue
    spec = smlp.token_mixer(name)
    assert spec.mixer == name
    # Only the spatial gating unit has the sMoE form and gMLP's own block.
    assert spec.smoe == (name == "gmlp") and (spec.block == "gmlp") == spec.smoe
  # Positions: none for the unit (position-indexed weights) and HyperMixing
  # (adds its own), sinusoidal for the permutation-equivariant attentions.
  assert [smlp.token_mixer(m).positions for m in
          ("gmlp", "hypermixer", "attention", "linear_attention")] == [
              False, False, True, True]
  assert smlp.token_mixer("sgu") == smlp.token_mixer("gmlp")


@pytest.mark.parametrize("name,message", [
    ("attn", "'attn' is not a registered token mixer; the family is a causal "
             "language model: use one of hypermixer, gmlp"),
    ("fnet", "'fnet' has no causal mode"),
    ("mlp_mixer", "'mlp_mixer' has no causal mode"),
    ("amlp", r"'amlp' presets the spatial gating unit \(\{'tiny_attention_dim': 64\}"),
])
def test_a_mixer_the_family_cannot_use_is_refused_by_name(name, message):
  with pytest.raises(ValueError, match=f"model.token_mixer={message}"):
    models.build_model(_cfg(name))


def test_the_legacy_name_builds_the_same_model():
  tokens = jax.random.randint(jax.random.key(0), (2, 20), 0, 64)
  new, params = _logits(_cfg("gmlp"), tokens)
  old, _ = _logits(_cfg("sgu"), tokens, params)
  np.testing.assert_array_equal(new, old)
  assert "smoe" in params["layer_1"]          # the sparse block's sMoE


@pytest.mark.parametrize("name", ["hypermixer", "linear_attention"])
def test_registry_mixers_in_dense_and_sparse_blocks_are_causal(name):
  cfg = _cfg(name, num_heads=2)
  n, vocab = cfg.max_len, cfg.vocab_size
  tokens = jax.random.randint(jax.random.key(0), (n,), 0, vocab)
  # Row k changes token k; row n is the original.
  rows = jnp.tile(tokens, (n + 1, 1))
  rows = rows.at[jnp.arange(n), jnp.arange(n)].set((tokens + 17) % vocab)
  logits, params = _logits(cfg, rows)
  # The mixer is the registry's, a submodule named after it in the sparse
  # block, beside the token-routed feed-forward.
  assert set(params["layer_1"]) >= {name, "tmoe"}
  for k in range(n):
    np.testing.assert_allclose(logits[k, :k], logits[n, :k], rtol=0,
                               atol=1e-5, err_msg=f"token {k} leaks")
    assert np.abs(logits[k, k] - logits[n, k]).max() > 1e-5
