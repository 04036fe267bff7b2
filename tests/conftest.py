"""Test setup: 8 fake CPU devices, so that sharding is tested everywhere.

The flag must be set before JAX initialises its backend, i.e. before any
test module touches a device; conftest.py is imported first by pytest.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (
      _flags + " --xla_force_host_platform_device_count=8").strip()
# TensorFlow (seqio/TFDS) must never grab an accelerator or print noise.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# The tests' programs are tiny, so XLA's optimisation passes (LLVM -O2 and
# friends) cost far more than they save: on CI's 2 CPU cores they roughly
# halve the compile time that dominates the suite. Set
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 to test with the default pipeline.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pathlib  # noqa: E402

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(
    os.environ.get("HYPERMIXER_SHARED_DATA",
                   pathlib.Path(__file__).resolve().parents[1].parent
                   / "shared" / "data"))


@pytest.fixture(scope="session", autouse=True)
def subprocess_compilation_cache(tmp_path_factory):
  """One persistent JAX compilation cache for the commands the tests launch
  (``python -m hypermixer_jax.main`` ...): many launch the same tiny model,
  and each launch would compile it again. The test process itself read its
  JAX settings at import, so this reaches only the processes it starts."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent   # the workers' folders share this parent
  path = base / "jax_cache_subprocesses"
  path.mkdir(exist_ok=True)
  keys = ("JAX_COMPILATION_CACHE_DIR",
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
  old = {k: os.environ.get(k) for k in keys}
  os.environ.setdefault(keys[0], str(path))
  os.environ.setdefault(keys[1], "0")
  yield
  for k, v in old.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v


@pytest.fixture(scope="module")
def models_traced_once():
  """``zoo.abstract_variables`` (what ``count_params`` counts) traces each
  model config once for the module that uses this fixture: tracing a
  paper-size init is the slow part of counting, and a module's tests often
  count the same configs again."""
  from hypermixer_jax.models import zoo  # pylint: disable=g-import-not-at-top
  traced = {}
  trace = zoo.abstract_variables

  def cached(config):
    key = config.to_json()
    if key not in traced:
      traced[key] = trace(config)
    return traced[key]
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(zoo, "abstract_variables", cached)
    yield


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
  """Path of ``../shared/data``; skips the test when it is absent."""
  if not SHARED_DATA.is_dir():
    pytest.skip(f"real sample data not found at {SHARED_DATA} (set "
                "HYPERMIXER_SHARED_DATA to the shared/data folder to run "
                "this test)")
  return SHARED_DATA



def pytest_collection_modifyitems(config, items):
  """The modules with tests marked ``slow`` run first, so that with ``-n 2``
  the workers end on short tests and finish together (the longest take
  30-90 s each). A module's tests stay together: its module-scoped fixtures
  are built once."""
  del config
  slow = {item.module for item in items if item.get_closest_marker("slow")}
  items.sort(key=lambda item: item.module not in slow)
