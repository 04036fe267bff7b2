"""``model.scan_layers``: the layer stack as one ``nn.scan``.

The scanned stack must compute the unrolled stack's function (outputs and
gradients, with the unrolled parameters stacked), carry the ``layers``
logical axis on its stacked parameters, and load from and into checkpoints
of either layout.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.models import common
from hypermixer_jax.models import encoders
from hypermixer_jax.models import zoo
from hypermixer_jax.train import checkpoint as ckpt_lib


def _config(mixer: str, scan: bool, family: str = "text"):
  c = zoo.default_model_config()
  c.update(family=family, mixer=mixer, num_layers=2, d_model=32, d_ffn=48,
           vocab_size=50, max_len=12, dropout_rate=0.0, scan_layers=scan)
  if mixer in ("gmlp", "amlp"):
    c.block = "gmlp"
  if family == "continuous":
    c.update(head="classify", input_dim=8, num_classes=3,
             position_embeddings="none")
  return c


def _inputs(family: str):
  if family == "continuous":
    x = jax.random.normal(jax.random.key(0), (2, 12, 8))
  else:
    x = jax.random.randint(jax.random.key(0), (2, 12), 1, 50)
  seg = jnp.ones((2, 12), jnp.int32).at[1, 7:].set(0)   # a padded row
  return x, seg


def _with_stack(params, convert):
  enc = dict(params["encoder"])
  enc["stack"] = convert(enc["stack"])
  return dict(params, encoder=enc)


@pytest.mark.parametrize("mixer,family", [
    ("hypermixer", "text"), ("mlp_mixer", "continuous")])
def test_scanned_stack_computes_the_unrolled_function(mixer, family):
  x, seg = _inputs(family)
  unrolled = models.build_model(_config(mixer, False, family))
  scanned = models.build_model(_config(mixer, True, family))
  params = nn.unbox(jax.jit(unrolled.init)(jax.random.key(1), x,
                                            segment_ids=seg))["params"]
  stacked = _with_stack(params, encoders.stack_layers)
  # The stacked tree is exactly the scanned model's own layout.
  own = nn.unbox(jax.jit(scanned.init)(jax.random.key(1), x,
                                        segment_ids=seg))["params"]
  assert jax.tree.structure(own) == jax.tree.structure(stacked)
  assert jax.tree.map(jnp.shape, own) == jax.tree.map(jnp.shape, stacked)

  def loss(model, p):
    y = model.apply({"params": p}, x, segment_ids=seg)
    return jnp.sum(jnp.sin(y)), y

  (l0, y0), g0 = jax.jit(jax.value_and_grad(lambda p: loss(unrolled, p),
                                            has_aux=True))(params)
  (l1, y1), g1 = jax.jit(jax.value_and_grad(lambda p: loss(scanned, p),
                                            has_aux=True))(stacked)
  np.testing.assert_allclose(y1, y0, atol=2e-5)
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  # Gradients of the stacked parameters are the layers' gradients stacked.
  back = _with_stack(g1, encoders.unstack_layers)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)


def test_scanned_layers_draw_their_own_init_and_dropout():
  c = _config("hypermixer", True)
  x, seg = _inputs("text")
  model = models.build_model(c)
  p = nn.unbox(jax.jit(model.init)(jax.random.key(1), x,
                                   segment_ids=seg))["params"]
  kernel = p["encoder"]["stack"]["layers"]["layer"]["feature_mixing"]["wi"][
      "dense"]["kernel"]
  assert kernel.shape[0] == 2
  assert not np.allclose(kernel[0], kernel[1])
  c.dropout_rate = 0.5
  model = models.build_model(c)
  run = jax.jit(lambda k: model.apply(
      {"params": p}, x, segment_ids=seg, deterministic=False,
      rngs={"dropout": k}))
  h, again, other = (run(jax.random.key(2)), run(jax.random.key(2)),
                     run(jax.random.key(3)))
  np.testing.assert_array_equal(h, again)
  assert not np.allclose(h, other)


def test_stacked_parameters_carry_the_layers_axis_and_shard_by_the_rest():
  c = _config("hypermixer", True)
  c.d_model, c.d_ffn = 64, 128
  variables = zoo.abstract_variables(c)
  names = jax.tree.leaves(
      jax.tree.map(lambda b: b.names, variables["params"]["encoder"]["stack"][
          "layers"], is_leaf=common.is_box), is_leaf=lambda x: isinstance(
              x, tuple))
  assert names and all(n[0] == common.LAYERS for n in names)
  # Every preset leaves the layer axis whole and shards the rest as before.
  mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Auto,))
  rules = sharding.get_rules("fsdp")
  spec = nn.logical_to_mesh_sharding(
      nn.get_partition_spec(variables), mesh, rules)["params"]["encoder"][
          "stack"]["layers"]["layer"]["feature_mixing"]["wi"]["dense"][
              "kernel"]
  assert spec.spec == P(None, "fsdp", None)


def test_stack_and_unstack_round_trip_and_refuse_other_trees():
  tree = {"layer_0": {"w": jnp.zeros((2, 3))},
          "layer_1": {"w": jnp.ones((2, 3))},
          "final_norm": {"scale": jnp.ones(2)}}
  stacked = encoders.stack_layers(tree)
  assert stacked["layers"]["layer"]["w"].shape == (2, 2, 3)
  back = encoders.unstack_layers(stacked)
  assert set(back) == set(tree)
  np.testing.assert_array_equal(back["layer_1"]["w"], 1.0)
  with pytest.raises(ValueError, match="layer_0 ... layer_"):
    encoders.stack_layers({"layer_0": {}, "layer_2": {}})
  with pytest.raises(ValueError, match="layers/layer"):
    encoders.unstack_layers(tree)


def _save(path, params):
  ck = ckpt_lib.Checkpointer(path / "checkpoints", save_every=1)
  ck.save(1, {"params": params, "step": np.int32(1)}, {})
  ck.close()


def _fresh(scan: bool, layers: int = 2):
  c = _config("hypermixer", scan)
  c.num_layers = layers
  x, seg = _inputs("text")
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))
  p = nn.unbox(jax.jit(models.build_model(c).init)(jax.random.key(7), x,
                                          segment_ids=seg))["params"]
  return jax.device_put(p, NamedSharding(mesh, P()))


@pytest.mark.parametrize("saved_scan", [False, True])
def test_checkpoints_load_across_layouts(tmp_path, saved_scan):
  saved = _fresh(saved_scan)
  _save(tmp_path, saved)
  loaded = ckpt_lib.load_pretrained(tmp_path, _fresh(not saved_scan), ())
  convert = encoders.unstack_layers if saved_scan else encoders.stack_layers
  want = _with_stack(saved, convert)
  assert jax.tree.structure(loaded) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
    assert a.sharding.is_fully_replicated


def test_layer_count_mismatch_across_layouts_names_the_field(tmp_path):
  _save(tmp_path, _fresh(False, layers=1))
  with pytest.raises(ValueError) as e:
    ckpt_lib.load_pretrained(tmp_path, _fresh(True, layers=2), ())
  msg = str(e.value)
  assert "missing from checkpoint: encoder/stack/layers/layer/" in msg
  assert "model.scan_layers" in msg and "model.num_layers" in msg


def _eqns(jaxpr):
  """Every equation of ``jaxpr``, nested jaxprs (jit, remat) included."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      inner = getattr(v, "jaxpr", v)
      if hasattr(inner, "eqns") and e.primitive.name != "remat2":
        yield from _eqns(inner)


def _remat_pair(scan: bool, policy: str):
  c = _config("hypermixer", scan)
  c.update(d_model=64, d_ffn=256, max_len=64, dropout_rate=0.1)
  x = jax.random.randint(jax.random.key(0), (8, 64), 1, 50)
  out = []
  for name in ("none", policy):
    c.remat = name
    model = models.build_model(c)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(1), x))["params"]

    def loss(p, model=model):
      return jnp.sum(model.apply({"params": p}, x, deterministic=False,
                                 rngs={"dropout": jax.random.key(2)}) ** 2)
    out.append((params, loss))
  return c, out


def _same_params(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(u, v)


def test_remat_under_the_scan_keeps_gradients_and_frees_activations():
  _, [(base, base_loss), (params, loss)] = _remat_pair(True, "full")
  _same_params(params, base)
  grads, temps = [], []
  for p, f in ((base, base_loss), (params, loss)):
    g = jax.jit(jax.grad(f)).lower(p).compile()
    grads.append(g(p))
    temps.append(g.memory_analysis().temp_size_in_bytes)
  for a, b in zip(jax.tree.leaves(grads[1]), jax.tree.leaves(grads[0])):
    # Recomputation reorders float sums: agreement to the leaf's scale.
    np.testing.assert_allclose(a, b, rtol=1e-4,
                               atol=1e-5 * float(np.abs(b).max()))
  assert temps[1] < 0.8 * temps[0]


def test_remat_of_the_unrolled_stack_keeps_its_layout_and_function():
  # The wrapper shares the layer's scope: the same parameter paths, the same
  # loss and dropout stream, and one remat region per layer with its policy
  # (XLA:CPU keeps an unrolled stack's activations alive anyway; XLA:TPU
  # frees them: docs/pods.md, "Compile for a TPU topology").
  c, [(base, base_loss), (params, loss)] = _remat_pair(False, "save_dots")
  _same_params(params, base)
  np.testing.assert_allclose(jax.jit(loss)(base), jax.jit(base_loss)(base),
                             rtol=1e-6)
  jaxpr = jax.make_jaxpr(jax.grad(loss))(base)
  regions = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "remat2"]
  assert len(regions) == c.num_layers
  assert all(e.params["policy"] is jax.checkpoint_policies.dots_saveable
             for e in regions)


def test_unknown_remat_policy_names_the_valid_ones():
  c = _config("hypermixer", False)
  c.remat = "everything"
  with pytest.raises(ValueError, match="unknown remat 'everything'.*full"):
    models.build_model(c)


def test_resolution_adapter_resizes_a_scanned_stack_layer_by_layer():
  from hypermixer_jax.models import official_mixer  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)

  def layer():
    return {"token_mixing": {"kernel_in": rng.normal(size=(16, 8)),
                             "kernel_out": rng.normal(size=(8, 16)),
                             "bias_out": rng.normal(size=(16,)),
                             "bias_in": rng.normal(size=(8,))}}
  unrolled = {"encoder": {"stack": {"layer_0": layer(), "layer_1": layer()}}}
  scanned = {"encoder": {"stack": encoders.stack_layers(
      unrolled["encoder"]["stack"])}}
  want = official_mixer.adapt_resolution(unrolled, 64, method="nearest")
  got = official_mixer.adapt_resolution(scanned, 64, method="nearest")
  got = encoders.unstack_layers(got["encoder"]["stack"])
  assert got["layer_1"]["token_mixing"]["kernel_in"].shape == (64, 8)
  for a, b in zip(jax.tree.leaves(got),
                  jax.tree.leaves(want["encoder"]["stack"])):
    np.testing.assert_allclose(a, b, rtol=1e-6)
