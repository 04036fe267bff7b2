"""Automatic implementation choices follow the platform being traced for.

Block-wise attention and chunked HyperMixing are CPU forms, chosen
automatically by ``common.target_platform()``: the platform of the mesh in
context, else the default backend. A step compiled for TPU devices from
this CPU host must get the TPU forms.
"""
import jax
import jax.numpy as jnp
import pytest

from hypermixer_jax import sharding
from hypermixer_jax.models import attention
from hypermixer_jax.models import common
from hypermixer_jax.models.hypermixer import HyperMixing
from hypermixer_jax.train import compile as tc

AUTO = jax.sharding.AxisType.Auto


def tpu_abstract_mesh(size: int = 8) -> jax.sharding.AbstractMesh:
  """An abstract mesh of TPU devices (no libtpu needed to trace for it)."""
  device = jax.sharding.AbstractDevice(device_kind="TPU v5 lite",
                                       num_cores=1, platform="tpu")
  return jax.sharding.AbstractMesh((size,), ("data",), (AUTO,),
                                   abstract_device=device)


def on_tpu_mesh():
  """Context: ``tpu_abstract_mesh`` in context (as ``sharding.within``)."""
  return jax.sharding.use_abstract_mesh(tpu_abstract_mesh())


def traced_platform(*context) -> str:
  """``target_platform()`` as seen while ``jax.jit`` traces, in context."""
  seen = []

  def f(x):
    seen.append(common.target_platform())
    return x

  x = jnp.zeros(())
  if context:
    with context[0]:
      jax.jit(f).trace(x)
  else:
    jax.jit(f).trace(x)
  return seen[0]


def test_platform_of_the_mesh_in_context():
  assert jax.default_backend() == "cpu"
  assert common.target_platform() == "cpu"
  assert traced_platform() == "cpu"
  # A mesh of the 8 fake CPU devices: their platform, eagerly and in jit.
  cpu_mesh = sharding.build_mesh({"fsdp": -1}, jax.devices())
  with jax.set_mesh(cpu_mesh):
    assert common.target_platform() == "cpu"
  assert traced_platform(jax.set_mesh(cpu_mesh)) == "cpu"
  # A TPU mesh (what compiling for a topology sets), on this CPU host.
  tpu = tpu_abstract_mesh()
  with jax.sharding.use_abstract_mesh(tpu):
    assert common.target_platform() == "tpu"
  assert traced_platform(jax.sharding.use_abstract_mesh(tpu)) == "tpu"
  # ``sharding.within`` (the train and eval steps) carries the mesh's
  # platform into the jitted function.
  seen = []
  fn = sharding.within(lambda x: seen.append(common.target_platform()) or x,
                       cpu_mesh, sharding.get_rules("fsdp"))
  jax.jit(fn).trace(jnp.zeros(()))
  assert seen == ["cpu"]
  # An abstract mesh that names no device says nothing: the default backend.
  bare = jax.sharding.AbstractMesh((8,), ("data",), (AUTO,))
  with jax.sharding.use_abstract_mesh(bare):
    assert common.target_platform() == "cpu"
  assert common.target_platform() == "cpu"   # contexts restored


def _jaxpr(module, variables, x, context=None, **kw) -> str:
  fn = lambda v, x: module.apply(v, x, **kw)  # noqa: E731
  if context is None:
    return str(jax.make_jaxpr(fn)(variables, x))
  with context:
    return str(jax.make_jaxpr(fn)(variables, x))


def test_attention_auto_choice_follows_the_traced_platform():
  # N = 12 > block_size = 4: block-wise for CPU, the library's XLA path for
  # TPU (same host, same module).
  x = jax.random.normal(jax.random.key(0), (2, 12, 8))
  kw = dict(num_heads=2, causal=True, block_size=4)
  auto = attention.SelfAttention(**kw)
  v = auto.init(jax.random.key(1), x)
  forms = {impl: attention.SelfAttention(implementation=impl, **kw)
           for impl in ("xla", "blockwise")}
  tpu = on_tpu_mesh
  on_cpu = _jaxpr(auto, v, x)
  on_tpu = _jaxpr(auto, v, x, tpu())
  assert on_cpu == _jaxpr(forms["blockwise"], v, x)
  assert on_tpu == _jaxpr(forms["xla"], v, x, tpu())
  assert on_cpu != on_tpu
  # The blocks' scan is in the CPU form only.
  assert "scan[" in on_cpu and "scan[" not in on_tpu


def test_hypermixing_eval_chunks_only_for_cpu():
  # Evaluation (deterministic) of 4 x 512 tokens: two chunks for CPU, one
  # pass for TPU; training is one pass on both.
  x = jax.random.normal(jax.random.key(0), (4, 512, 8))
  auto = HyperMixing(16, max_len=512)
  v = auto.init(jax.random.key(1), x)
  one = HyperMixing(16, max_len=512, chunk_tokens=0)
  chunked = HyperMixing(16, max_len=512, chunk_tokens=1024)
  tpu = on_tpu_mesh
  on_cpu = _jaxpr(auto, v, x)
  on_tpu = _jaxpr(auto, v, x, tpu())
  assert on_cpu == _jaxpr(chunked, v, x) != _jaxpr(one, v, x)
  assert on_tpu == _jaxpr(one, v, x, tpu())
  with tpu():
    assert auto._chunks(4, 512, 512) == 1  # pylint: disable=protected-access
  assert auto._chunks(4, 512, 512) == 2  # pylint: disable=protected-access


@pytest.mark.slow
def test_lowered_for_tpu_topology_takes_the_tpu_forms():
  """On libtpu's compile-only devices (``--mode=compile``'s), through
  ``sharding.within`` as the train and eval steps trace."""
  try:
    tpu_devices = tc.topology_devices("v5e:2x2")
  except ValueError as e:
    pytest.skip(f"libtpu cannot describe TPU topologies here: {e}")
  rules = sharding.get_rules("data_parallel")
  x = jnp.zeros((4, 12, 8))
  cases = {
      "attention": (attention.SelfAttention(2, causal=True, block_size=4),
                    attention.SelfAttention(2, causal=True, block_size=4,
                                            implementation="xla")),
      "hypermixing": (HyperMixing(16, max_len=512),
                      HyperMixing(16, max_len=512, chunk_tokens=0)),
  }

  def lowered(module, devices, x):
    mesh = sharding.build_mesh({"data": -1}, devices)
    replicated = jax.NamedSharding(mesh, jax.P())
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,  # noqa: E731
                                          sharding=replicated)
    v = jax.tree.map(spec, jax.eval_shape(module.init, jax.random.key(0), x))
    fn = sharding.within(lambda v, x: module.apply(v, x), mesh, rules)
    return jax.jit(fn).lower(v, spec(x))

  cpu_devices = jax.devices()[:4]
  auto, xla = cases["attention"]
  on_tpu = lowered(auto, tpu_devices, x)
  assert "while" not in on_tpu.as_text()
  assert on_tpu.as_text() == lowered(xla, tpu_devices, x).as_text()
  assert "while" not in on_tpu.compile().as_text()
  assert "while" in lowered(auto, cpu_devices, x).as_text()
  # HyperMixing evaluation of 4 x 512 tokens: one pass for TPU, chunks on
  # the CPU mesh.
  auto, one = cases["hypermixing"]
  x = jnp.zeros((4, 512, 8))
  on_tpu = lowered(auto, tpu_devices, x).as_text()
  assert on_tpu == lowered(one, tpu_devices, x).as_text()
  on_cpu = lowered(auto, cpu_devices, x).as_text()
  assert on_cpu != lowered(one, cpu_devices, x).as_text()
  # The chunks are joined along the tokens on CPU only.
  joins = lambda t: t.count("stablehlo.concatenate")  # noqa: E731
  assert joins(on_cpu) > joins(on_tpu)
