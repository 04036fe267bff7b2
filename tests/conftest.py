"""Test setup: 8 fake CPU devices, so that sharding is tested everywhere.

The flag must be set before JAX initialises its backend, i.e. before any
test module touches a device; conftest.py is imported first by pytest.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# TensorFlow (seqio/TFDS) must never grab an accelerator or print noise.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# The tests' programs are tiny, so XLA's optimisation passes (LLVM -O2 and
# friends) cost far more than they save: on CI's 2 CPU cores they roughly
# halve the compile time that dominates the suite. Set
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 to test with the default pipeline.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Without those passes, XLA:CPU's older elemental emitters compile a program
# 2-2.5x faster than its MLIR fusion emitters (a tiny model's train step:
# 2.7 s -> 1.2 s; one eager op: 26 ms -> 10 ms), which roughly halves the
# model tests' time. HYPERMIXER_TEST_XLA_FLAGS carries the flags to the
# commands the tests launch with their own device count.
os.environ.setdefault(
    "HYPERMIXER_TEST_XLA_FLAGS",
    "--xla_cpu_use_fusion_emitters=false"
    if os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1" else "")
# Each xdist worker keeps to one core (below), where XLA:CPU's parallel
# codegen (the LLVM module split into up to 32 parts compiled on a thread
# pool) only adds per-part overhead: one part compiles the same programs
# about 14% faster (tests/moe_layers_test.py on one core: 37.4 s -> 32.2 s,
# two runs each). The programs compute the same; only their build differs.
os.environ["HYPERMIXER_TEST_XLA_FLAGS"] = " ".join(filter(None, (
    os.environ["HYPERMIXER_TEST_XLA_FLAGS"],
    "--xla_cpu_parallel_codegen_split_count=1"
    if "xla_cpu_parallel_codegen_split_count" not in os.environ[
        "HYPERMIXER_TEST_XLA_FLAGS"] else "")))
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_cpu_use_fusion_emitters" not in _flags:
  _flags += " " + os.environ["HYPERMIXER_TEST_XLA_FLAGS"]
elif "xla_cpu_parallel_codegen_split_count" not in _flags:
  _flags += " --xla_cpu_parallel_codegen_split_count=1"
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = _flags.strip()
# Under pytest-xdist each worker keeps to one core (gw0 the first, gw1 the
# second, ...): XLA's and TensorFlow's thread pools then stop competing for
# the same cores (on CI's 2 cores: fewer context switches, about 3% less CPU
# time). The commands a test launches inherit their worker's core.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and hasattr(os, "sched_setaffinity"):
  _cores = sorted(os.sched_getaffinity(0))
  if len(_cores) > 1:
    os.sched_setaffinity(0, {_cores[int(_worker[2:]) % len(_cores)]})

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import gc  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402

SHARED_DATA = pathlib.Path(
    os.environ.get("HYPERMIXER_SHARED_DATA",
                   pathlib.Path(__file__).resolve().parents[1].parent
                   / "shared" / "data"))


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
  """One persistent JAX compilation cache for the whole run: the xdist
  workers and the commands the tests launch (``python -m hypermixer_jax.main``
  ...) share it. Many tests build the same tiny programs again (a model's
  init and step in a new ``jax.jit`` per test, the same job in each launched
  command); a hit skips XLA's compile. It lives in pytest's base temporary
  folder (the last few runs' are kept, older ones removed by pytest) and is
  set here, after the tmpdir plugin and before collection compiles anything
  (JAX opens its cache at the first compile). Modules that test the cache
  itself switch to their own folder and reset JAX's cache after."""
  base = config._tmp_path_factory.getbasetemp()  # pylint: disable=protected-access
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent   # the workers' folders share this parent
  path = base / "jax_cache"
  path.mkdir(exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  # The commands the tests launch read the environment.
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(path)
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


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


@pytest.fixture(scope="module")
def c4_slice(shared_data, tmp_path_factory):
  """``(file, vocabulary)``: 40 documents of the C4 sample and a 300-piece
  SentencePiece vocabulary trained on them.

  For training runs whose subject is not the vocabulary (the N = 1024
  causal LM, the sMLP experts): a T5-size output layer (32,128 ids) would
  cost most of a tiny model's step."""
  from hypermixer_jax.data import train_vocab  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("c4")
  with open(shared_data / "c4/c4_en_train_00000_first1000.jsonl",
            encoding="utf-8") as f:
    lines = [next(f) for _ in range(40)]
  c4 = root / "c4.jsonl"
  c4.write_text("".join(lines), encoding="utf-8")
  return str(c4), train_vocab.train(str(c4), str(root / "spm"), 300)


def pytest_collection_finish(session):
  """Python's cyclic garbage collector, tuned for a suite that imports
  JAX, TensorFlow and seqio (millions of long-lived objects) and then traces
  many small programs: the objects alive after collection are frozen (never
  scanned again), and a full collection comes after 100 (not 10) of the
  middle generation's. On tests/train_loop_test.py and steps_test.py this
  cut the collector's time from 3.9 s to 1.0 s of about 50 s. Cycles are
  still collected; only the rescans of what never dies are saved."""
  del session
  gc.collect()
  gc.freeze()
  gc.set_threshold(*gc.get_threshold()[:2], 100)
