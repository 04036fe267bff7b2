"""A token mixer added the documented way (CONTRIBUTING.md, "Add a token
mixer"): one module with the mixer contract and its defaults, one registry
line, its tests; then it trains in the real loop like any other mixer."""
import importlib
import importlib.util
import os

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax import models
from hypermixer_jax.models import common
from hypermixer_jax.models import registry
from hypermixer_jax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, N, D, V = 2, 7, 12, 31


class SegmentMean(nn.Module):
  """Example mixer: ``y_i = W_o GELU(W_i mean_{j ~ i} x_j)``, the mean over
  the tokens that token i may read (its own segment, real tokens, j <= i
  when causal)."""
  hidden: int
  causal: bool = False
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @classmethod
  def model_defaults(cls, model):
    return {"hidden": model["d_model"] // 2}

  @nn.compact
  def __call__(self, x, *, mask=None, segment_ids=None, positions=None,
               deterministic=True):
    del positions, deterministic
    n = x.shape[1]
    mask = common.resolve_mask(x, mask, segment_ids)
    read = common.pair_mask(mask, segment_ids, self.causal, n, n)
    read = jnp.ones((1, n, n), bool) if read is None else read
    weights = read / jnp.maximum(read.sum(-1, keepdims=True), 1)
    mean = jnp.einsum("bij,bjd->bid", weights.astype(x.dtype), x)
    h = common.Dense(self.hidden, (common.EMBED, common.MLP), dtype=self.dtype,
                     param_dtype=self.param_dtype, name="wi")(mean)
    return common.Dense(x.shape[-1], (common.MLP, common.EMBED),
                        dtype=self.dtype, param_dtype=self.param_dtype,
                        name="wo")(nn.gelu(h))


@pytest.fixture
def registered(monkeypatch):
  """The registry line, as it would stand in ``models/registry.py``."""
  monkeypatch.setitem(registry.MIXERS, "segment_mean",
                      registry.Mixer(__name__, "SegmentMean"))
  return "segment_mean"


def _text_config(mixer, **overrides):
  cfg = models.default_model_config()
  cfg.update(mixer=mixer, head="pair_classify", num_layers=1, d_model=D,
             d_ffn=17, max_len=N, vocab_size=V, num_classes=3,
             dropout_rate=0.0)
  cfg.update(overrides)
  return cfg


def _mixer_params(cfg):
  params = nn.unbox(models.zoo.abstract_variables(cfg))["params"]
  return params["encoder"]["stack"]["layer_0"]["token_mixing"]


def test_the_registry_line_is_the_only_place_that_names_it(registered):
  assert importlib.import_module(registry.MIXERS[registered].module) is (
      importlib.import_module(__name__))
  # Its own default (hidden = d_model // 2), then the user's mixer_kwargs.
  assert _mixer_params(_text_config(registered))["wi"]["dense"]["kernel"].shape == (
      D, D // 2)
  cfg = _text_config(registered, mixer_kwargs=dict(hidden=5))
  assert _mixer_params(cfg)["wo"]["dense"]["kernel"].shape == (5, D)
  with pytest.raises(ValueError, match=r"\['width'\] for mixer "
                     r"'segment_mean' \(SegmentMean\); valid: .*hidden"):
    models.build_model(_text_config(registered, mixer_kwargs=dict(width=5)))
  # A causal head finds its causal field; gMLP's block refuses it.
  models.build_model(_text_config(registered, head="causal_lm"))
  with pytest.raises(ValueError, match="needs mixer 'gmlp' or 'amlp', got "
                     "'segment_mean'"):
    models.build_model(_text_config(registered, block="gmlp"))


def test_configs_take_the_mixers_declared_options(registered):
  # The example declares none of the optional attributes.
  assert models.unpacked_mixer_kwargs(_text_config(registered)) == {}
  assert models.causal_mixer_kwargs(_text_config(registered)) == {}
  glue = models.get_model_config
  assert models.unpacked_mixer_kwargs(glue("glue_linear_attention")) == {
      "packed": False}
  assert models.causal_mixer_kwargs(glue("glue_hypermixer")) == {
      "causal_chunk_size": models.HyperMixing.causal_chunk_size}
  # HyperMixing adds positions itself: its models add none.
  assert [glue(f"glue_{m}").position_embeddings for m in (
      "hypermixer", "hypermixer_untied", "attention", "fnet")] == [
          "none", "none", "sinusoidal", "sinusoidal"]


def test_without_the_line_the_name_is_unknown():
  with pytest.raises(ValueError, match="unknown mixer 'segment_mean'; valid "
                     "mixers: hypermixer, mlp_mixer"):
    models.build_model(_text_config("segment_mean"))


def test_example_mixer_keeps_packed_examples_apart_and_is_causal():
  x = jax.random.normal(jax.random.key(0), (1, N, D))
  seg = jnp.array([[1, 1, 1, 2, 2, 2, 0]])
  mixer = SegmentMean(hidden=5, causal=True)
  params = mixer.init(jax.random.key(1), x)
  packed = mixer.apply(params, x, segment_ids=seg)
  for lo, hi in ((0, 3), (3, 6)):
    alone = mixer.apply(params, x[:, lo:hi])
    chex.assert_trees_all_close(packed[:, lo:hi], alone, atol=1e-5)
  # Each output reads no later token: the Jacobian is block lower-triangular.
  jac = jax.jit(jax.jacfwd(lambda v: mixer.apply(params, v[None])[0]))(x[0])
  reads = np.abs(np.asarray(jac)).sum((1, 3)) > 0            # [N out, N in]
  assert not np.triu(reads, 1).any() and reads[2, 0]


@pytest.mark.slow
def test_trains_one_step_in_the_loop(registered, tmp_path):
  spec = importlib.util.spec_from_file_location(
      "default_config", os.path.join(ROOT, "configs", "default.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("none")
  c.model.update(mixer=registered, num_layers=1, d_model=16, d_ffn=32,
                 max_len=40)
  c.data.synthetic.update(seq_len=40, num_eval_examples=16)
  c.update(batch_size=8, eval_batch_size=16, num_train_steps=1,
           warmup_steps=0, eval_every=1, checkpoint_every=1, log_every=1)
  c.evals.pseudo_attention.every = -1
  result = loop.train_and_evaluate(c, str(tmp_path))
  assert result.step == 1 and np.isfinite(result.eval_metrics["loss"])
  # The step's gradients reached the new mixer: Adam's first moments of its
  # weights are the (scaled) gradients, nonzero.
  moments = [leaf for path, leaf in
             jax.tree_util.tree_leaves_with_path(result.state.opt_state)
             if "token_mixing" in jax.tree_util.keystr(path)
             and "wi" in jax.tree_util.keystr(path)]
  assert moments and all(np.abs(np.asarray(m)).max() > 0 for m in moments)
