"""Sharding tests on 8 fake CPU devices (tests/conftest.py).

The sharded results are compared with the same model run unsharded on one
device, and the placements of real arrays are asserted (``.sharding.spec``
and shard shapes), since a constraint outside a mesh silently does nothing.
"""
import copy
import functools
import math
import pickle
import re
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.models import common
from hypermixer_jax.models.moe import MoeFeedForward
from hypermixer_jax.train import steps

P = jax.P
B, N, D, F, V = 8, 8, 16, 32, 64   # batch, length, d_model, d_ffn, vocab
PRESETS = tuple(sharding.RULES_PRESETS)
MIXERS = tuple(models.MIXERS)
# One mesh per preset (data, fsdp, tensor, expert): every axis the preset
# uses has size 2, so a split shows up in every shard shape.
PRESET_MESH = {"data_parallel": (2, 2, 2, 1), "fsdp": (2, 2, 2, 1),
               "fsdp_tensor": (2, 2, 2, 1), "expert": (1, 2, 2, 2)}
MIXER_KWARGS = {"hypermixer": dict(hyper_dim=8),
                "attention": dict(num_heads=2),
                "linear_attention": dict(num_heads=2),
                "amlp": dict(tiny_attention_dim=8)}


def _mesh(shape):
  return sharding.build_mesh(dict(zip(sharding.MESH_AXES, shape)))


def _model_config(mixer):
  cfg = models.default_model_config()
  cfg.update(dict(
      mixer=mixer, block="gmlp" if mixer in ("gmlp", "amlp") else "pre_ln",
      head="mlm", num_layers=1, d_model=D, d_ffn=F, max_len=N, vocab_size=V,
      dropout_rate=0.1, position_embeddings="learned"))
  cfg.mixer_kwargs = ml_collections.ConfigDict(MIXER_KWARGS.get(mixer, {}))
  return cfg


@functools.lru_cache(maxsize=None)
def _model(mixer):
  return models.build_model(_model_config(mixer))


def _batch(N=N):  # noqa: N803
  rng = np.random.default_rng(0)
  lengths = rng.integers(N // 2, N + 1, size=B)
  real = np.arange(N)[None, :] < lengths[:, None]
  targets = rng.integers(1, V, size=(B, N)).astype(np.int32)
  inputs = np.where(rng.random((B, N)) < 0.3, 3, targets) * real
  return {
      "inputs": inputs.astype(np.int32),
      "targets": targets,
      "weights": (real & (rng.random((B, N)) < 0.5)).astype(np.float32),
      "segment_ids": real.astype(np.int32),
      "positions": np.broadcast_to(np.arange(N, dtype=np.int32), (B, N)),
  }


BATCH = _batch()
KEY = jax.random.key(42)
TX = optax.adam(1e-2)


def _loss_fn(model):
  def loss(params, batch):
    inputs, kwargs = heads.model_inputs(batch, "mlm")
    out = model.apply({"params": params}, inputs, deterministic=True,
                      **kwargs)
    return heads.compute_loss("mlm", out, batch)[0]
  return loss


@functools.lru_cache(maxsize=None)
def _reference(mixer):
  """Single-device params, loss and grads, computed without any mesh."""
  model = _model(mixer)
  params_rng, dropout_rng = jax.random.split(KEY)
  inputs, kwargs = heads.model_inputs(BATCH, "mlm")
  params = nn.unbox(model.init({"params": params_rng, "dropout": dropout_rng},
                               inputs, deterministic=True, **kwargs))["params"]
  loss, grads = jax.jit(jax.value_and_grad(_loss_fn(model)))(params, BATCH)
  return jax.device_get((params, loss, grads))


@functools.lru_cache(maxsize=None)
def _abstract_params(mixer):
  """The model's boxed parameters as shapes (traced once per mixer)."""
  inputs, kwargs = heads.model_inputs(BATCH, "mlm")
  return jax.eval_shape(
      lambda k: _model(mixer).init(k, inputs, **kwargs)["params"], KEY)


def _grad_fn(mixer, mesh, rules, param_shardings):
  return jax.jit(
      sharding.within(jax.value_and_grad(_loss_fn(_model(mixer))), mesh,
                      rules),
      in_shardings=(param_shardings,
                    sharding.batch_shardings(BATCH, mesh, rules)),
      out_shardings=(jax.NamedSharding(mesh, P()), param_shardings))


def _sharded(mixer, preset, shape):
  """Sharded init of the train state, the sharded grad function, the batch."""
  mesh, rules = _mesh(shape), sharding.get_rules(preset)
  state, shardings = steps.create_train_state(_model(mixer), TX, KEY, BATCH,
                                              mesh, rules)
  grad_fn = _grad_fn(mixer, mesh, rules, shardings.params)
  batch = sharding.make_global_batch(BATCH, mesh, rules)
  return mesh, rules, state, shardings, grad_fn, batch


def _find(tree, suffix):
  """The leaves whose path ends with ``suffix`` (a '/'-joined key path)."""
  out = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    name = "/".join(str(getattr(k, "key", getattr(k, "name", getattr(
        k, "idx", k)))) for k in path)
    if name.endswith(suffix):
      out.append((name, leaf))
  return out


def _assert_split(x, spec, mesh):
  """``x`` is placed as ``spec`` and each device holds the expected shard."""
  assert x.sharding.spec == spec, (x.sharding.spec, spec)
  shard = list(x.shape)
  for dim, axes in enumerate(spec):
    axes = (axes,) if isinstance(axes, str) else (axes or ())
    shard[dim] //= math.prod(mesh.shape[a] for a in axes)
  for s in x.addressable_shards:
    assert s.data.shape == tuple(shard), (s.data.shape, shard)


def _check_all_shards(tree, expected, mesh):
  """Every array is placed as ``expected`` (a tree of the same structure
  of NamedShardings: what the logical axis names and the rules give), and
  its shards have that spec's shapes (no silent replication)."""
  leaves, want = jax.tree.leaves(tree), jax.tree.leaves(expected)
  assert len(leaves) == len(want), (len(leaves), len(want))
  for x, s in zip(leaves, want):
    _assert_split(x, s.spec, mesh)


# Hand-written placements of representative parameters, per preset.
_T = {"data_parallel": None, "fsdp": None, "fsdp_tensor": "tensor",
      "expert": "tensor"}
_FS = {"data_parallel": None, "fsdp": "fsdp", "fsdp_tensor": "fsdp",
       "expert": "fsdp"}


def _expected(preset):
  t, f = _T[preset], _FS[preset]
  return {
      "token_embed/embedding": P(t, f),                         # vocab, embed
      "feature_mixing/wi/dense/kernel": P(f, t),                # embed, mlp
      "feature_mixing/wo/dense/kernel": P(t, f),                # mlp, embed
      "final_norm/ln/scale": P(None),                           # norm
      "sgu/spatial/kernel": P(None, f),                         # seq_out, seq_in
      "sgu/proj_in/dense/kernel": P(f, t),
      # seq_in, token_mlp / token_mlp, seq_out: tensor takes token_mlp
      # first, else fsdp does (token_mlp precedes the sequence axes).
      "token_mixing/kernel_in": P(f, t) if t else P(None, f),
      "token_mixing/kernel_out": P(t, f) if t else P(f, None),
      # mlp, hyper: tensor takes mlp, hyper falls back to fsdp.
      "hypernetwork_in/out/dense/kernel": P(t, f),
      "token_mixing/query/kernel": P(f, t, None),               # embed, heads, kv
  }


# ---------------------------------------------------------------------------
# Equality with the single-device model.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("mixer", MIXERS)
def test_sharded_loss_and_grads_equal_single_device(mixer, preset):
  """Every mixer x every preset on its mesh (params placed, not initialised:
  sharded initialisation is tested on every mesh below, compiles are slow)."""
  ref_params, ref_loss, ref_grads = _reference(mixer)
  mesh, rules = _mesh(PRESET_MESH[preset]), sharding.get_rules(preset)
  abstract = _abstract_params(mixer)
  sharding.validate_divisibility(abstract, mesh, rules)
  shardings = sharding.logical_shardings(abstract, mesh, rules)
  params = jax.device_put(ref_params, shardings)
  batch = sharding.make_global_batch(BATCH, mesh, rules)
  loss, grads = _grad_fn(mixer, mesh, rules, shardings)(params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  chex.assert_trees_all_close(jax.device_get(grads), ref_grads, rtol=2e-5,
                              atol=1e-6)
  # The placements are real: representative parameters have the specs of
  # the preset and every array's shards have the matching shapes.
  checked = 0
  for suffix, spec in _expected(preset).items():
    for _, x in _find(params, suffix):
      _assert_split(x, spec, mesh)
      checked += 1
  assert checked >= 3
  _check_all_shards((params, grads), (shardings, shardings), mesh)


# (8, 1) would be data parallelism alone: the data_parallel cases of
# test_sharded_loss_and_grads_equal_single_device cover it.
@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("second", ["fsdp", "tensor"])
def test_meshes(shape, second):
  """gMLP (the N x N SGU) on data x fsdp (fsdp) and data x tensor meshes."""
  sizes = dict(data=shape[0], fsdp=1, tensor=1, expert=1)
  sizes[second] = shape[1]
  mesh_shape = tuple(sizes[a] for a in sharding.MESH_AXES)
  preset = "fsdp" if second == "fsdp" else "fsdp_tensor"
  ref_params, ref_loss, ref_grads = _reference("gmlp")
  mesh, _, state, shardings, grad_fn, batch = _sharded("gmlp", preset,
                                                       mesh_shape)
  assert dict(mesh.shape) == sizes
  # Sharded initialisation gives the single-device values.
  chex.assert_trees_all_close(jax.device_get(state.params), ref_params,
                              rtol=1e-6, atol=1e-7)
  loss, grads = grad_fn(state.params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  chex.assert_trees_all_close(jax.device_get(grads), ref_grads, rtol=2e-5,
                              atol=1e-6)
  [(_, sgu)] = _find(state.params, "sgu/spatial/kernel")
  [(_, wi)] = _find(state.params, "sgu/proj_in/dense/kernel")
  # Axes of size 1 stay in the specs; the shard shapes show the real split.
  _assert_split(sgu, P(None, "fsdp"), mesh)
  _assert_split(wi, P("fsdp", None if second == "fsdp" else "tensor"), mesh)
  assert wi.addressable_shards[0].data.size == wi.size // shape[1]
  _assert_split(batch["inputs"], P(("data", "fsdp", "expert"), None), mesh)
  _check_all_shards((state.params, state.opt_state),
                    (shardings.params, shardings.opt_state), mesh)
  # Adam's moments follow their parameters; its count is replicated.
  [(_, mu)] = _find(state.opt_state, "0/mu/encoder/stack/layer_0/sgu/proj_in/"
                    "dense/kernel")
  assert mu.sharding.spec == wi.sharding.spec
  [(_, count)] = _find(shardings.opt_state, "0/count")
  assert count.spec == P()


def test_train_step_equals_single_device_and_constraints_bind():
  """Full step (dropout, Adam) sharded == unsharded; the state is donated."""
  # SGD with momentum, not Adam: Adam's first step is ~lr * sign(g), which
  # turns float noise on a zero gradient into a full-size difference.
  model, preset = _model("mlp_mixer"), "fsdp_tensor"
  mesh, rules = _mesh(PRESET_MESH[preset]), sharding.get_rules(preset)
  state, shardings = steps.create_train_state(
      model, optax.sgd(0.1, momentum=0.9), KEY, BATCH, mesh, rules)
  batch = sharding.make_global_batch(BATCH, mesh, rules)
  step = steps.make_train_step(model, "mlm")
  rng = jax.random.key(7)
  ref_state = jax.device_get(state)
  ref_new, ref_metrics = jax.jit(step)(ref_state, BATCH, rng)

  jitted = steps.jit_train_step(step, shardings,
                                sharding.batch_shardings(BATCH, mesh, rules),
                                mesh, rules)
  text = jitted.lower(state, batch, rng).as_text()
  # The model's activation constraints reached the compiled program.
  assert text.count("sdy.sharding_constraint") >= 5
  assert '{"data", "fsdp", "expert"}' in text
  old_leaf = jax.tree.leaves(state.params)[0]
  new, metrics = jitted(state, batch, rng)
  assert old_leaf.is_deleted()
  chex.assert_trees_all_close(jax.device_get(new.params), ref_new.params,
                              rtol=2e-5, atol=1e-6)
  for k in ("loss", "accuracy", "grad_norm"):
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=2e-5)
  assert bool(metrics["is_finite"])
  _check_all_shards(new.params, shardings.params, mesh)
  for x, s in zip(jax.tree.leaves(new), jax.tree.leaves(shardings)):
    assert x.sharding.spec == s.spec


# ---------------------------------------------------------------------------
# Mesh, rules, batches.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,shape", [
    (dict(data=-1), (8, 1, 1, 1)),
    (dict(data=2, fsdp=-1), (2, 4, 1, 1)),
    (dict(data=1, fsdp=2, tensor=2, expert=-1), (1, 2, 2, 2)),
    (ml_collections.ConfigDict(dict(data=4, fsdp=1, tensor=2, expert=1)),
     (4, 1, 2, 1)),
])
def test_build_mesh(cfg, shape):
  mesh = sharding.build_mesh(cfg)
  assert mesh.axis_names == sharding.MESH_AXES
  assert tuple(mesh.shape.values()) == shape
  assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


@pytest.mark.parametrize("cfg,match", [
    (dict(data=3, fsdp=2), r"data=3 x fsdp=2 x tensor=1 x expert=1 has 6 .*"
                           r"count: pass --config.mesh.data=-1 \(it takes"),
    (dict(data=4, fsdp=4), r"data=4 x fsdp=4 .* has 16 devices but there "
                           r"are 8.*: pass --config.mesh.data=-1 \(it takes"),
    # A run saved on 8 devices, restored on a host with 1.
    (dict(data=1, fsdp=2, tensor=2, expert=2), r"has 8 devices but there are "
     r"1; .*: pass --config.mesh.<axis> sizes whose product is 1, or one of "
     r"them -1.$"),
    (dict(data=-1, fsdp=-1), r"at most one mesh axis may be -1"),
    (dict(data=3, fsdp=-1), r"multiply to 3, which does not divide the 8 .*"
                            r"filled; pass --config.mesh.data=1.$"),
    (dict(data=-1, tensor=2, expert=3), r"multiply to 6, which .* filled; "
                                        r"pass --config.mesh.expert=1.$"),
    (dict(data=0), r"data=0 must be a positive int"),
])
def test_bad_mesh(cfg, match):
  from hypermixer_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  devices = jax.devices()[:1] if cfg.get("expert") == 2 else None
  with pytest.raises(sharding.MeshError, match=match) as e:
    sharding.build_mesh(cfg, devices=devices)
  assert isinstance(e.value, workdir_lib.user_errors())


def test_dcn_shape_puts_hosts_on_data_first():
  assert sharding.dcn_shape((8, 2, 1, 1), 4) == (4, 1, 1, 1)
  assert sharding.dcn_shape((2, 4, 1, 1), 4) == (2, 2, 1, 1)
  with pytest.raises(ValueError, match="cannot spread 3 hosts"):
    sharding.dcn_shape((2, 4, 1, 1), 3)


def test_rules_presets_are_complete_and_valid():
  for name, rules in sharding.RULES_PRESETS.items():
    assert sharding.get_rules(name) == rules
    assert set(n for n, _ in rules) == set(common.LOGICAL_AXES), name
    assert dict(rules)[common.NORM] is None
  # Expert parallelism: dispatched MoE tensors put experts on "expert" and
  # the batch on the rest; other activations use "expert" for the batch.
  ep = sharding.RULES_PRESETS["expert"]
  assert nn.logical_to_mesh_axes(("batch", "expert", "length", "embed"),
                                 ep) == P(("data", "fsdp"), "expert", None,
                                          None)
  assert nn.logical_to_mesh_axes(("batch", "length", "mlp"), ep) == P(
      ("data", "fsdp", "expert"), None, "tensor")
  assert all(a is None for n, a in sharding.RULES_PRESETS["data_parallel"]
             if n != common.BATCH)


def test_get_rules_explicit_and_from_config():
  rules = sharding.get_rules([("batch", ["data", "fsdp"]), ("embed", "fsdp"),
                              ("mlp", None)])
  assert rules == (("batch", ("data", "fsdp")), ("embed", "fsdp"),
                   ("mlp", None))
  cfg = ml_collections.ConfigDict(dict(rules="fsdp"))
  assert sharding.get_rules(cfg) == sharding.RULES_PRESETS["fsdp"]
  # indivisible: "auto" (or absent) replicates under a preset and stops under
  # an explicit table; either can be chosen.
  assert rules.indivisible == "error"
  assert sharding.get_rules(cfg).indivisible == "replicate"
  assert sharding.get_rules("fsdp").indivisible == "replicate"
  for table, choice in (("fsdp", "error"), (list(rules), "replicate")):
    chosen = sharding.get_rules(dict(rules=table, indivisible=choice))
    assert chosen.indivisible == choice
    assert chosen == sharding.get_rules(table)


@pytest.mark.parametrize("rules,match", [
    ("fsdb", r"unknown sharding preset 'fsdb'"),
    ([("embedding", "fsdp")], r"unknown logical axis name 'embedding'"),
    ([("embed", "model")], r"unknown mesh axis 'model'"),
    ([("batch", ("data", "data"))], r"repeats a mesh axis"),
])
def test_bad_rules(rules, match):
  with pytest.raises(ValueError, match=match):
    sharding.get_rules(rules)


def test_indivisible_parameter_fails_before_compiling(monkeypatch):
  """d_model=12 on fsdp=8: a clear error, raised before any jax.jit."""
  cfg = _model_config("gmlp")
  cfg.d_model = 12
  model = models.build_model(cfg)
  mesh = _mesh((1, 8, 1, 1))
  rules = sharding.get_rules(dict(rules="fsdp", indivisible="error"))

  def no_jit(*args, **kwargs):
    raise AssertionError("compiled before validating the shardings")
  monkeypatch.setattr(jax, "jit", no_jit)
  with pytest.raises(ValueError) as err:
    steps.create_train_state(model, TX, KEY, BATCH, mesh, rules)
  msg = str(err.value)
  assert "['encoder']['token_embed']['embedding']: dim 1 (logical 'embed', " \
         "size 12) over mesh axes fsdp of total size 8" in msg
  assert "'fsdp': 8" in msg
  assert "config.sharding.indivisible='replicate'" in msg
  # An explicit rules table defaults to the error too.
  with pytest.raises(ValueError, match=r"\['embedding'\]: dim 1 \(logical "
                     r"'embed', size 12\) over mesh axes fsdp"):
    steps.create_train_state(model, TX, KEY, BATCH, mesh,
                             sharding.get_rules(list(rules)))


# (mixer, preset, mesh, config changes, {param: (spec, kept replicated
# along an indivisible dim)}, arrays in the log line (params + moments),
# one fallback line). N=6 everywhere.
_FALLBACK_CASES = {
    # fsdp=8 divides neither N=6 nor D_S=12: the token MLP stays replicated.
    "mlp_mixer-fsdp": (
        "mlp_mixer", "fsdp", (1, 8, 1, 1), dict(token_mlp_dim=12), {
            "token_embed/embedding": (P(None, "fsdp"), False),
            "token_mixing/kernel_in": (P(None, None), True),
            "token_mixing/bias_in": (P(None), True),
            "token_mixing/kernel_out": (P(None, None), True),
            "token_mixing/bias_out": (P(None), True),
            "feature_mixing/wi/dense/kernel": (P("fsdp", None), False)},
        8, "['token_mixing']['kernel_in']: dim 0 (logical 'seq_in', size 6) "
           "not divisible by mesh axes fsdp (8)"),
    "gmlp-fsdp": (
        "gmlp", "fsdp", (1, 8, 1, 1), {}, {
            "token_embed/embedding": (P(None, "fsdp"), False),
            "sgu/spatial/kernel": (P(None, None), True),
            "sgu/spatial/bias": (P(None), True),
            "sgu/proj_in/dense/kernel": (P("fsdp", None), False)},
        4, "['sgu']['spatial']['kernel']: dim 1 (logical 'seq_in', size 6) "
           "not divisible by mesh axes fsdp (8)"),
    # d_ffn=10 on tensor=4: U and V keep mlp replicated (their embed is
    # still on fsdp), while the activations' mlp constraint on tensor is
    # uneven (XLA pads it): the values must not change.
    "gmlp-fsdp_tensor": (
        "gmlp", "fsdp_tensor", (1, 2, 4, 1), dict(d_ffn=10), {
            "token_embed/embedding": (P("tensor", "fsdp"), False),
            "sgu/spatial/kernel": (P(None, "fsdp"), False),
            "sgu/proj_in/dense/kernel": (P("fsdp", None), True),
            "sgu/proj_in/dense/bias": (P(None), True),
            "sgu/proj_out/dense/kernel": (P(None, "fsdp"), True)},
        6, "['sgu']['proj_out']['dense']['kernel']: dim 0 (logical 'mlp', "
           "size 5) not divisible by mesh axes tensor (4)"),
}


@pytest.mark.parametrize("case", list(_FALLBACK_CASES))
def test_indivisible_dims_are_replicated_and_train(case, caplog):
  """Token-mixing sizes (N=6, D_S=12) or widths (d_ffn=10) that the preset's
  mesh axes do not divide: those dimensions stay replicated, the rest is
  split, it is logged, and a train step equals the unsharded one."""
  mixer, preset, shape, changes, expected, count, line = _FALLBACK_CASES[case]
  n = 6
  cfg = _model_config(mixer)
  cfg.max_len = n
  for k, v in changes.items():
    if k == "d_ffn":
      cfg.d_ffn = v
    else:
      cfg.mixer_kwargs[k] = v
  model, batch = models.build_model(cfg), _batch(n)
  mesh, rules = _mesh(shape), sharding.get_rules(
      ml_collections.ConfigDict(dict(rules=preset, indivisible="auto")))
  assert rules.indivisible == "replicate"
  caplog.set_level("INFO")
  state, shardings = steps.create_train_state(
      model, optax.sgd(0.1, momentum=0.9), KEY, batch, mesh, rules)
  logged = [r.getMessage() for r in caplog.records
            if "kept replicated" in r.getMessage()]
  assert len(logged) == 1, logged
  # The log line counts and names the replicated arrays, only them.
  assert logged[0].startswith(f"sharding: {count} arrays ("), logged[0]
  for suffix, (spec, fell_back) in expected.items():
    [(_, x)] = _find(state.params, suffix)
    _assert_split(x, spec, mesh)
    key = "".join(f"['{k}']" for k in suffix.split("/")) + ","
    assert (key in logged[0] + ",") == fell_back, (suffix, logged[0])
  _check_all_shards((state.params, state.opt_state),
                    (shardings.params, shardings.opt_state), mesh)
  inputs, kwargs = heads.model_inputs(batch, "mlm")
  lines = sharding.replicated_fallbacks(jax.eval_shape(
      lambda k: model.init(k, inputs, **kwargs), KEY), mesh, rules)
  assert any(x.endswith(line) for x in lines), lines

  step = steps.make_train_step(model, "mlm")
  rng = jax.random.key(7)
  ref_new, ref_metrics = jax.jit(step)(jax.device_get(state), batch, rng)
  new, metrics = steps.jit_train_step(
      step, shardings, sharding.batch_shardings(batch, mesh, rules), mesh,
      rules)(state, sharding.make_global_batch(batch, mesh, rules), rng)
  chex.assert_trees_all_close(jax.device_get(new.params), ref_new.params,
                              rtol=2e-5, atol=1e-6)
  for k in ("loss", "accuracy", "grad_norm"):
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=2e-5)
  for x, sh in zip(jax.tree.leaves(new), jax.tree.leaves(shardings)):
    assert x.sharding.spec == sh.spec


def test_indivisible_tries_the_names_later_rules():
  """A rule that does not divide is skipped for the name's next rule; the
  axis it would have used stays free for the other dimensions."""
  mesh = _mesh((1, 2, 4, 1))
  table = [("mlp", "tensor"), ("mlp", "fsdp"), ("embed", "fsdp"),
           ("embed", "tensor")]
  boxed = {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((16, 6),
                                                             jnp.float32),
                                        ("embed", "mlp")),
           "v": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((16, 5),
                                                             jnp.float32),
                                        ("embed", "mlp"))}
  rep = sharding.get_rules(dict(rules=table, indivisible="replicate"))
  # mlp=6: tensor (4) skipped, fsdp (2) divides; embed then takes tensor.
  # mlp=5: neither divides, so it is replicated and embed takes fsdp.
  assert sharding.logical_specs(boxed, rep, mesh) == {
      "w": P("tensor", "fsdp"), "v": P("fsdp", None)}
  sharding.validate_divisibility(boxed, mesh, rep)
  assert sharding.replicated_fallbacks(boxed, mesh, rep) == [
      "['v']: dim 1 (logical 'mlp', size 5) not divisible by mesh axes "
      "tensor (4), fsdp (2)"]
  # Without a mesh, or with "error": Flax's resolution, and the error.
  err = sharding.get_rules(table)
  assert err.indivisible == "error"
  assert sharding.logical_specs(boxed, rep) == sharding.logical_specs(
      boxed, err, mesh) == {"w": P("fsdp", "tensor"),
                            "v": P("fsdp", "tensor")}
  with pytest.raises(ValueError, match=re.escape(
      "  ['v']: dim 1 (logical 'mlp', size 5) over mesh axes tensor of total "
      "size 4\n  ['w']: dim 1 (logical 'mlp', size 6) over mesh axes tensor "
      "of total size 4\n")):
    sharding.validate_divisibility(boxed, mesh, err)
  assert sharding.replicated_fallbacks(boxed, mesh, err) == []
  # The option travels with copies of the table.
  assert copy.deepcopy(rep).indivisible == "replicate"
  assert pickle.loads(pickle.dumps(rep)) == rep


@pytest.mark.parametrize("cfg", [dict(rules="fsdp", indivisible="replicated"),
                                 dict(rules=[("embed", "fsdp")],
                                      indivisible=True),
                                 dict(rules="fsdp", indivisible="")])
def test_bad_indivisible_option(cfg):
  with pytest.raises(ValueError, match=re.escape(
      f"config.sharding.indivisible={cfg['indivisible']!r} must be one of "
      "'auto', 'replicate', 'error'")):
    sharding.get_rules(ml_collections.ConfigDict(cfg))


class _Named(nn.Module):
  names: tuple
  init_fn: Any = nn.initializers.ones_init()

  @nn.compact
  def __call__(self, x):
    w = self.param("w", common.partitioned(self.init_fn, self.names),
                   (x.shape[-1], 8))
    return x @ w


@pytest.mark.parametrize("names,match", [
    (("embed", "embedd"), r"parameter \['params'\]\['w'\] has unknown "
                          r"logical axis name 'embedd'"),
    (("embed", "embed"), r"parameter \['params'\]\['w'\] repeats logical "
                         r"axis names \['embed'\]"),
])
def test_bad_parameter_names(names, match):
  mesh, rules = _mesh((2, 4, 1, 1)), sharding.get_rules("fsdp")
  init = lambda k: _Named(names).init(k, jnp.ones((2, 8)))  # noqa: E731
  with pytest.raises(ValueError, match=match):
    sharding.sharded_init(init, KEY, mesh, rules)


def test_sharded_init_never_builds_full_params():
  """Each device only ever holds its shard: the compiled init's outputs,
  whose shards put together are the unsharded init's values (a random
  init: a swapped or repeated shard would show)."""
  mesh, rules = _mesh((1, 8, 1, 1)), sharding.get_rules("fsdp")
  module = _Named(("embed", "mlp"), nn.initializers.normal(1.0))
  init = lambda k: module.init(k, jnp.ones((2, 64)))  # noqa
  state, shardings = sharding.sharded_init(init, KEY, mesh, rules)
  w = state["params"]["w"]
  assert shardings["params"]["w"].spec == P("fsdp", None)
  _assert_split(w, P("fsdp", None), mesh)
  assert len({s.device for s in w.addressable_shards}) == 8
  want = np.asarray(nn.unbox(init(KEY))["params"]["w"])
  assert np.unique(want).size == want.size
  for s in w.addressable_shards:
    np.testing.assert_array_equal(s.data, want[s.index])


def test_global_batch():
  mesh, rules = _mesh((2, 2, 2, 1)), sharding.get_rules("fsdp_tensor")
  batch = sharding.make_global_batch(BATCH, mesh, rules)
  spec = sharding.batch_shardings(
      jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), BATCH),
      mesh, rules)
  for k, x in batch.items():
    np.testing.assert_array_equal(x, BATCH[k])
    assert x.sharding == spec[k]
    _assert_split(x, P(("data", "fsdp", "expert"), None), mesh)
    # Replicated over "tensor": both tensor ranks hold the same rows.
  with pytest.raises(ValueError, match=r"\['label'\] has global shape \(6,\):"
                     r" dim 0 \(6\) must be divisible by mesh axes "):
    sharding.make_global_batch({"label": np.zeros(6, np.int32)}, mesh, rules)


class _MoeNet(nn.Module):
  """A stem and the token-routed MoE feed-forward layer."""

  @nn.compact
  def __call__(self, inputs, *, segment_ids=None, deterministic=True):
    x = common.Dense(D, (common.PATCH, common.EMBED), name="stem")(inputs)
    return MoeFeedForward(num_experts=4, d_ffn=F, capacity_factor=2.0,
                          name="moe")(x, mask=segment_ids > 0,
                                      deterministic=deterministic)


def test_expert_preset_splits_moe_experts():
  """Expert preset: MoE weights split over expert x fsdp x tensor; a train
  step (with the router's aux losses) equals the single-device step."""
  model, preset = _MoeNet(), "expert"
  rng = np.random.default_rng(3)
  batch = {"inputs": rng.normal(size=(B, N, 4)).astype(np.float32),
           "targets": rng.normal(size=(B, N, D)).astype(np.float32),
           "weights": BATCH["segment_ids"].astype(np.float32),
           "segment_ids": BATCH["segment_ids"]}
  mesh, rules = _mesh(PRESET_MESH[preset]), sharding.get_rules(preset)
  state, shardings = steps.create_train_state(model, optax.sgd(0.1), KEY,
                                              batch, mesh, rules)
  _assert_split(state.params["moe"]["wi"], P("expert", "fsdp", "tensor"),
                mesh)
  _assert_split(state.params["moe"]["wo"], P("expert", "tensor", "fsdp"),
                mesh)
  step = steps.make_train_step(model, "regression")
  ref_new, ref_m = jax.jit(step)(jax.device_get(state), batch, KEY)
  new, m = steps.jit_train_step(
      step, shardings, sharding.batch_shardings(batch, mesh, rules), mesh,
      rules)(state, sharding.make_global_batch(batch, mesh, rules), KEY)
  assert float(m["aux_loss"]) > 0
  for k in ("loss", "aux_loss", "total_loss"):
    np.testing.assert_allclose(m[k], ref_m[k], rtol=1e-5)
  chex.assert_trees_all_close(jax.device_get(new.params), ref_new.params,
                              rtol=2e-5, atol=1e-6)
  _check_all_shards(new.params, shardings.params, mesh)


def _all_gather_shapes(compiled_text):
  """Result shapes of the all-gathers in a compiled HLO module."""
  return {tuple(int(d) for d in m.group(1).split(",") if d)
          for m in re.finditer(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather\(",
                               compiled_text)}


def test_expert_preset_keeps_each_experts_hidden_width_split(monkeypatch):
  """Under expert parallelism with a tensor axis, each device applies its
  slice of every expert's hidden width (partial outputs summed): the train
  step gathers the experts over fsdp only, never whole [E/n, d, d_ffn]
  experts. Gathering them (the split turned off) shows up as such."""
  from hypermixer_jax.models.moe import tmoe
  model = _MoeNet()
  rng = np.random.default_rng(3)
  batch = {"inputs": rng.normal(size=(B, N, 4)).astype(np.float32),
           "targets": rng.normal(size=(B, N, D)).astype(np.float32),
           "weights": BATCH["segment_ids"].astype(np.float32),
           "segment_ids": BATCH["segment_ids"]}
  mesh, rules = _mesh(PRESET_MESH["expert"]), sharding.get_rules("expert")
  state, shardings = steps.create_train_state(model, optax.sgd(0.1), KEY,
                                              batch, mesh, rules)
  step = steps.make_train_step(model, "regression")

  def gathered():
    fn = steps.jit_train_step(
        step, shardings, sharding.batch_shardings(batch, mesh, rules), mesh,
        rules)
    return _all_gather_shapes(fn.lower(
        state, sharding.make_global_batch(batch, mesh, rules),
        KEY).compile().as_text())

  whole = {(2, D, F), (2, F, D)}      # 4 experts over expert=2: 2 a device
  got = gathered()
  assert (2, D, F // 2) in got and not whole & got, got
  monkeypatch.setattr(tmoe, "split_axes", lambda *a, **k: ())
  assert whole & gathered()
