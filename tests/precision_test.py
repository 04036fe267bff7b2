"""The precision policy: bf16 compute on TPU / GPU, float32 where it matters.

``model.dtype='auto'`` (every config's) resolves to bfloat16 for TPU and GPU
and float32 for CPU; parameters, optimizer state, softmaxes, LayerNorm
statistics and the loss stay float32 under bfloat16 compute; a bfloat16
run's loss tracks the float32 run's.
"""
import importlib.util
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax.models import common
from hypermixer_jax.models import smlp
from hypermixer_jax.train import steps

AUTO = jax.sharding.AxisType.Auto
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
B, N, V = 4, 16, 29


def _mesh_of(platform: str) -> jax.sharding.AbstractMesh:
  device = jax.sharding.AbstractDevice(device_kind=platform, num_cores=1,
                                       platform=platform)
  return jax.sharding.AbstractMesh((8,), ("data",), (AUTO,),
                                   abstract_device=device)


def test_auto_is_bf16_on_accelerators_and_float32_on_cpu():
  assert jax.default_backend() == "cpu"
  assert common.dtype("auto") == jnp.float32
  for platform in ("tpu", "gpu"):
    with jax.sharding.use_abstract_mesh(_mesh_of(platform)):
      assert common.dtype("auto") == jnp.bfloat16
      model = models.build_model(models.default_model_config())
      assert model.dtype == jnp.bfloat16 and model.param_dtype == jnp.float32
  with pytest.raises(ValueError, match="'bf16'.*auto, float32, bfloat16"):
    common.dtype("bf16")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.py")),
                         ids=lambda p: p.stem)
def test_every_config_uses_the_policy(path):
  spec = importlib.util.spec_from_file_location(f"cfg_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  assert config.model.dtype == "auto"
  assert config.model.param_dtype == "float32"


def _tiny_configs():
  mlm = models.default_model_config()
  mlm.update(num_layers=1, d_model=16, d_ffn=24, max_len=N, vocab_size=V,
             dropout_rate=0.0)
  out = {}
  for mixer in ("hypermixer", "amlp", "attention"):
    c = mlm.copy_and_resolve_references()
    c.mixer = mixer
    c.block = "gmlp" if mixer == "amlp" else "pre_ln"
    out[mixer] = (c, "mlm")
  lm = smlp.smlp_config("tiny")
  lm.moe.tmoe_router = "switch"
  lm.moe.smoe_routing = "partial"
  out["smlp"] = (lm, "causal_lm")
  return out


def _batch(seed: int = 0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(1, V, size=(B, N))
  return dict(inputs=jnp.asarray(ids), targets=jnp.asarray(ids),
              weights=jnp.asarray(rng.rand(B, N) < 0.5, jnp.float32))


def _eqns(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs nested in it."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _eqns(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _eqns(sub)


@pytest.mark.parametrize("name", ["hypermixer", "amlp", "attention", "smlp"])
def test_bf16_keeps_softmax_norm_statistics_and_loss_in_float32(name):
  config, head = _tiny_configs()[name]
  config.dtype = "bfloat16"
  model = models.build_model(config)
  batch = _batch()
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), batch["inputs"])
                    ["params"])

  def loss_fn(p):
    out, _ = model.apply({"params": p}, batch["inputs"], deterministic=False,
                         rngs={"dropout": jax.random.key(1)},
                         mutable=steps.MUTABLE)
    return heads.compute_loss(head, out, batch)[0]

  # The forward pass (the backward differentiates erf GELU with a bf16
  # exp(-x^2), which is no softmax).
  eqns = list(_eqns(jax.make_jaxpr(loss_fn)(params).jaxpr))
  dtype_of = lambda v: v.aval.dtype
  # The policy is on: matmuls take bf16 inputs...
  dots = [e for e in eqns if e.primitive.name == "dot_general"]
  assert any(all(dtype_of(v) == jnp.bfloat16 for v in e.invars) for e in dots)
  # ...but every exponential (softmaxes: routers, attention, the loss),
  # logarithm (the loss) and reciprocal square root (LayerNorm's variance)
  # runs in float32.
  kept = [e for e in eqns if e.primitive.name in ("exp", "log", "rsqrt")]
  assert {e.primitive.name for e in kept} >= {"exp", "log", "rsqrt"}
  low = [str(e)[:120] for e in kept
         if any(dtype_of(v) != jnp.float32 for v in e.outvars)]
  assert not low, low
  # The loss and the parameters' gradients (hence optimizer state) float32.
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  assert loss.dtype == jnp.float32
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype("float32")}
  opt_state = jax.jit(optax.adamw(1e-3).init)(params)   # one program
  assert {x.dtype for x in jax.tree.leaves(opt_state)
          if x.ndim} == {jnp.dtype("float32")}


def _losses(dtype: str, steps_: int = 40) -> np.ndarray:
  config, head = _tiny_configs()["hypermixer"]
  config.dtype = dtype
  model = models.build_model(config)
  batches = [_batch(i) for i in range(4)]
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0),
                                        batches[0]["inputs"])["params"])
  state = steps.TrainState.create(apply_fn=model.apply, params=params,
                                  tx=optax.adam(1e-2))
  step = jax.jit(steps.make_train_step(model, head))
  out = []
  for i in range(steps_):
    state, metrics = step(state, batches[i % 4], jax.random.key(2))
    out.append(float(metrics["loss"]))
  return np.asarray(out)


def test_bf16_loss_tracks_float32():
  """A tiny MLM (identity targets at half the positions), 40 Adam steps in
  each precision from the same initialisation and batches."""
  f32, bf16 = _losses("float32"), _losses("bfloat16")
  assert f32[-5:].mean() < 0.5 * f32[0]          # it learns
  np.testing.assert_allclose(bf16[0], f32[0], rtol=0.01)
  np.testing.assert_allclose(bf16, f32, rtol=0.03, atol=0.02)
