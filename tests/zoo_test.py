"""Named configurations reproduce the papers' sizes (counted abstractly)."""
from absl.testing import parameterized
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.models import common
from hypermixer_jax.models import zoo

GLUE = [n for n in models.model_names() if n.startswith("glue_")]


# Each named model is traced once for this module: its tests count the same
# models again and again (paper sizes, token-mixing budgets, logical axes).
pytestmark = pytest.mark.usefixtures("models_traced_once")


def params_of(name, under=None):
  return models.count_params(models.get_model_config(name), under)


class ZooTest(parameterized.TestCase):

  @parameterized.parameters(
      # The gMLP / Mixer papers round to 0.1M / 1M: allow 2% (Mixer-S/16's
      # "18M" is 18.5M counted; 3%).
      ("gmlp_ti", 0.02), ("gmlp_s", 0.02), ("gmlp_b", 0.02),
      ("mixer_b16", 0.02), ("mixer_b32", 0.02), ("mixer_s16", 0.03),
      # DeiT-Ti's 5.7M (ours pools, DeiT has a [CLS] token): 1%.
      ("vit_ti16", 0.01),
      # HyperMixer paper: every model ~11M, FNet 9.5M.
      *[(n, 0.10) for n in GLUE])
  def test_matches_paper_size(self, name, rel_tol):
    got, want = params_of(name), zoo.PAPER_PARAMS[name]
    self.assertLess(abs(got - want) / want, rel_tol,
                    f"{name}: {got:,} parameters vs {want:,.0f} in the paper")

  def test_glue_models_differ_only_in_token_mixing(self):
    # The paper's controlled comparison: same embeddings and feature mixing;
    # FNet has no token-mixing parameters, so it is the shared part alone.
    shared = {n: params_of(n) - params_of(n, "token_mixing") for n in GLUE}
    self.assertLen(set(shared.values()), 1, shared)
    self.assertEqual(params_of("glue_fnet", "token_mixing"), 0)
    self.assertEqual(params_of("glue_fnet"), shared["glue_fnet"])
    # Equal token-mixing budgets: within 1% of the Transformer's 4d^2 + 4d.
    budget = params_of("glue_attention", "token_mixing")
    self.assertEqual(budget, 6 * (4 * 256 * 256 + 4 * 256))
    for n in GLUE:
      if n != "glue_fnet":
        tm = params_of(n, "token_mixing")
        self.assertLess(abs(tm - budget) / budget, 0.01, f"{n}: {tm:,}")

  def test_mixer_b16_by_hand(self):
    # Tolstikhin et al.: S=196, C=768, D_S=384, D_C=3072, 12 layers.
    s, c, ds, dc, p = 196, 768, 384, 3072, 16 * 16 * 3
    layer = 4 * c + (2 * s * ds + ds + s) + (2 * c * dc + dc + c)
    want = (p * c + c) + 12 * layer + 2 * c + (c * 1000 + 1000)
    self.assertEqual(params_of("mixer_b16"), want)

  def test_gmlp_ti_by_hand(self):
    # Liu et al.: S=196, d=128, d_ffn=768, 30 layers, no FFN, split SGU.
    s, d, f, p = 196, 128, 768, 16 * 16 * 3
    layer = 2 * d + (d * f + f) + f + (s * s + s) + (f // 2 * d + d)
    want = (p * d + d) + 30 * layer + 2 * d + (d * 1000 + 1000)
    self.assertEqual(params_of("gmlp_ti"), want)

  def test_every_name_builds(self):
    for name in models.model_names():
      cfg = models.get_model_config(name)
      self.assertIsInstance(models.build_model(cfg), models.Model)
      self.assertEqual(set(cfg), set(models.default_model_config()))

  def test_every_parameter_has_valid_logical_axes(self):
    # Names from common.LOGICAL_AXES, one per dimension, never repeated in
    # one tensor (a repeated name would map two dims to one mesh axis), and
    # resolvable by every sharding preset.
    for name in models.model_names():
      abstract = zoo.abstract_variables(models.get_model_config(name))
      boxes = jax.tree.leaves(
          abstract, is_leaf=lambda x: isinstance(x, nn.Partitioned))
      for box in boxes:
        self.assertIsInstance(box, nn.Partitioned, name)
        self.assertLen(box.names, box.value.ndim, name)
        named = [n for n in box.names if n is not None]
        self.assertLen(set(named), len(named), f"{name}: {box.names}")
        self.assertContainsSubset(named, common.LOGICAL_AXES, name)
      for rules in sharding.RULES_PRESETS.values():
        sharding.logical_specs(abstract, rules)

  def test_unknown_name(self):
    with self.assertRaisesRegex(ValueError, "gmlp_ti, gmlp_s"):
      models.get_model_config("gmlp_xl")

  def test_default_config_has_the_contract_fields(self):
    cfg = models.default_model_config()
    for field in ("family", "mixer", "block", "head", "num_layers", "d_model",
                  "d_ffn", "dropout_rate", "max_len", "vocab_size",
                  "num_classes", "input_dim", "position_embeddings", "dtype",
                  "param_dtype", "mixer_kwargs"):
      self.assertIn(field, cfg)

  def test_bfloat16_count_is_unchanged(self):
    cfg = models.get_model_config("glue_hypermixer")
    cfg.dtype = "bfloat16"
    self.assertEqual(models.count_params(cfg), params_of("glue_hypermixer"))
    self.assertIs(common.DTYPES[cfg.dtype], jnp.bfloat16)

  def test_a_counted_config_changed_in_place_is_counted_again(self):
    # The counts are kept per config contents, not per object: a config
    # counted, then changed, gives its new model's count (as traced anew).
    cfg = models.get_model_config("glue_hypermixer")
    cfg.num_layers, cfg.d_model, cfg.d_ffn = 1, 16, 32
    cfg.mixer_kwargs.hyper_dim = 8
    small = models.count_params(cfg)
    cfg.d_ffn = 64
    wider = models.count_params(cfg)
    traced = nn.unbox(zoo.abstract_variables(cfg))["params"]
    self.assertEqual(wider, sum(x.size for x in jax.tree.leaves(traced)))
    # Each layer's two d_model x d_ffn matrices and the d_ffn bias grow.
    self.assertEqual(wider - small, 16 * 32 * 2 + 32)
    self.assertEqual(models.count_params(cfg, "token_embed"),
                     cfg.vocab_size * cfg.d_model)


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()
