"""Fine-tuning from a checkpoint works for every head with the default
``init_reinit``, and parameters exported alone load like a full checkpoint."""
import functools
import json

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest

from hypermixer_jax import models
from hypermixer_jax.train import artifacts
from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import config as config_lib

DEFAULT_REINIT = config_lib.base_config().init_reinit.split(",")


def _text(head):
  return ml_collections.ConfigDict(dict(
      family="text", mixer="hypermixer", block="pre_ln", head=head,
      num_layers=1, d_model=16, d_ffn=24, max_len=12, vocab_size=40,
      num_classes=3, dropout_rate=0.0, type_vocab_size=2,
      mixer_kwargs=dict(hyper_dim=8)))


def _continuous(head):
  return ml_collections.ConfigDict(dict(
      family="continuous", mixer="mlp_mixer", block="pre_ln", head=head,
      num_layers=1, d_model=16, d_ffn=24, max_len=9, input_dim=5,
      num_classes=3, out_dim=2, dropout_rate=0.0, type_vocab_size=0,
      position_embeddings="none", mixer_kwargs=dict(token_mlp_dim=7)))


def _init(cfg, seed):
  """A model's parameters, built once per config and seed for the module (the pretrained source is the same in most tests)."""
  return _init_cached(cfg.to_json(), seed)


@functools.lru_cache(maxsize=None)
def _init_cached(cfg_json, seed):
  cfg = ml_collections.ConfigDict(json.loads(cfg_json))
  model = models.build_model(cfg)
  x = models.zoo.dummy_inputs(cfg, batch=2)
  return nn.unbox(jax.jit(model.init)(jax.random.key(seed),
                                      np.zeros(x.shape, x.dtype))["params"])


def _flat(tree):
  return {"/".join(str(k.key) for k in p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  """``written(cfg)``: a folder holding ``_init(cfg, 0)`` saved as step 7,
  written once per model config for the module (loading only reads it)."""
  folders = {}

  def written(cfg):
    key = cfg.to_json()
    if key not in folders:
      folders[key] = tmp_path_factory.mktemp("pretrained")
      artifacts.write_params(folders[key], _init(cfg, 0), step=7)
    return folders[key]
  return written


def _check(source_cfg, target_cfg, pretrained, *reinit):
  source = _init(source_cfg, 0)
  fresh = _init(target_cfg, 1)
  loaded = ckpt_lib.load_pretrained(pretrained(source_cfg), fresh, *reinit)
  src, new, out = _flat(source), _flat(fresh), _flat(loaded)
  assert set(out) == set(new)
  encoder = [k for k in out if k.startswith("encoder/")]
  assert encoder
  for k in out:
    want = src[k] if k.startswith("encoder/") else new[k]
    np.testing.assert_array_equal(out[k], want, err_msg=k)


@pytest.mark.parametrize("head", ["mlm", "causal_lm", "classify",
                                  "pair_classify"])
def test_mlm_checkpoint_fine_tunes_every_text_head(head, pretrained):
  _check(_text("mlm"), _text(head), pretrained, DEFAULT_REINIT)


def test_load_pretrained_default_reinitialises_the_heads(pretrained):
  # Called as a library function without ``reinit``: the same default as
  # config.init_reinit (the heads' own modules), not a pattern matching none.
  _check(_text("mlm"), _text("classify"), pretrained)


@pytest.mark.parametrize("head", ["image", "classify", "regression"])
def test_image_checkpoint_fine_tunes_every_continuous_head(head, pretrained):
  _check(_continuous("image"), _continuous(head), pretrained, DEFAULT_REINIT)


def test_other_encoder_still_fails_naming_the_paths(pretrained):
  bigger = _text("classify")
  bigger.d_ffn = 32
  with pytest.raises(ValueError, match="shape mismatch: encoder/stack/layer_0/"
                     "feature_mixing/wi/dense/kernel checkpoint"):
    ckpt_lib.load_pretrained(pretrained(_text("mlm")), _init(bigger, 1),
                             DEFAULT_REINIT)


def test_export_holds_params_only_and_reloads(tmp_path):
  """A training checkpoint (params + optimiser state) exported to params
  alone: smaller, and the same parameters come back."""
  import optax  # pylint: disable=g-import-not-at-top
  cfg = config_lib.base_config()
  cfg.model = _text("mlm")
  # No vocabulary to copy: the default is T5's on GCS, which an offline
  # machine waits on before giving up (the copy is tested with the export
  # command's own tests).
  cfg.data.vocab_path = ""
  params = _init(cfg.model, 3)
  opt_state = jax.jit(optax.adamw(1e-3).init)(params)
  ck = ckpt_lib.Checkpointer(tmp_path / "run" / "checkpoints", save_every=0,
                             async_save=False)
  ck.save(5, {"step": np.int32(5), "params": params, "opt_state": opt_state},
          {"epoch": 0}, force=True)
  ck.close()
  artifacts.export_params(cfg, str(tmp_path / "run"), str(tmp_path / "out"))
  restored, step = artifacts.load_params(cfg, str(tmp_path / "out"))
  assert step == 5
  for k, v in _flat(params).items():
    np.testing.assert_array_equal(_flat(restored)[k], v, err_msg=k)

  # What was written: the parameters, nothing else.
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  meta = ocp.PyTreeCheckpointer().metadata(tmp_path / "out" / "5" / "state")
  meta = getattr(meta, "item_metadata", meta)
  meta = getattr(meta, "tree", meta)
  assert set(meta) == {"params"}
  with pytest.raises(FileNotFoundError, match=r"no checkpoint step 9 .*\[5\]"):
    artifacts.load_params(cfg, str(tmp_path / "run"), step=9)
