"""Fine-tuning: a classifier starts from the encoder of an MLM checkpoint."""
import jax
import numpy as np
import pytest

from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import optim
from hypermixer_jax.train import steps
from hypermixer_jax.train.config import base_config

REINIT = ["(?!encoder/)"]  # what configs/glue.py:...,finetune uses


def _state(head, d_model=16, seed=0):
  c = base_config()
  c.model.update(dict(mixer="mlp_mixer", head=head, num_layers=1,
                      d_model=d_model, d_ffn=24, max_len=8, vocab_size=40,
                      num_classes=3, dropout_rate=0.0))
  c.num_train_steps = 10
  mesh = sharding.build_mesh(c.mesh)
  rules = sharding.get_rules(c.sharding)
  batch = {"inputs": jax.ShapeDtypeStruct((8, 8), np.int32),
           "segment_ids": jax.ShapeDtypeStruct((8, 8), np.int32),
           "token_type_ids": jax.ShapeDtypeStruct((8, 8), np.int32)}
  model = models.build_model(c.model)
  tx, _ = optim.make_optimizer(c, steps.param_shapes(model, batch))
  state, _ = steps.create_train_state(model, tx, jax.random.key(seed), batch,
                                      mesh, rules)
  return state


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("mlm")
  state = _state("mlm")
  ck = ckpt_lib.Checkpointer(workdir / "checkpoints", save_every=1)
  ck.save(3, state, {})
  ck.close()
  return workdir, state


def test_classifier_gets_encoder_and_new_head(mlm_run):
  workdir, mlm = mlm_run
  fresh = _state("classify", seed=1)
  params = ckpt_lib.load_pretrained(workdir, fresh.params, REINIT)
  enc = jax.tree_util.tree_leaves_with_path(params["encoder"])
  assert len(enc) > 4
  for (path, a), b in zip(enc, jax.tree.leaves(mlm.params["encoder"])):
    np.testing.assert_array_equal(a, b, err_msg=str(path))
  np.testing.assert_array_equal(params["classifier"]["dense"]["kernel"],
                                fresh.params["classifier"]["dense"]["kernel"])
  assert "mlm_head" not in params


def test_mismatched_checkpoint_fails_loudly(mlm_run):
  workdir, _ = mlm_run
  wider = _state("classify", d_model=32)
  with pytest.raises(ValueError, match="does not fit the model") as e:
    ckpt_lib.load_pretrained(workdir, wider.params, REINIT)
  msg = str(e.value)
  # An error main.py stops with in its own words (no traceback), also when
  # the checkpoint's config.json is gone and nothing checked the fields
  # before.
  from hypermixer_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  assert isinstance(e.value, workdir_lib.user_errors())
  # Every encoder array whose shape changed is named, not just the first.
  for name in ("encoder/token_embed/embedding",
               "encoder/stack/layer_0/feature_mixing/wi/dense/kernel",
               "encoder/stack/final_norm/ln/scale"):
    assert f"shape mismatch: {name} checkpoint" in msg
