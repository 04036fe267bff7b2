"""Checkpoint integrity: fingerprints checked on restore, damaged steps set
aside and saved again, readers that fall back and name their step, and
``--mode=verify``; on the files of real Orbax steps of a tiny run."""
import glob
import json
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import orbax.checkpoint as ocp
import pytest

from hypermixer_jax.train import artifacts
from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import integrity
from hypermixer_jax.train import loop
from hypermixer_jax.train import metrics as metrics_lib
from hypermixer_jax.train import multihost
from hypermixer_jax.train import verify

import flag_configs

# A failed read's leftover callbacks must not report (hundreds of
# tracebacks in a user's log): checkpoint.quiet_failed_reads.
pytestmark = pytest.mark.filterwarnings(
    "error::pytest.PytestUnraisableExceptionWarning")

ROOT = flag_configs.ROOT
DEFAULT = flag_configs.DEFAULT
TINY = flag_configs.TINY


def _config(*extra):
  return flag_configs.load(DEFAULT, *TINY, *extra)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A finished tiny run (steps 4 and 8) and its step-8 state."""
  workdir = tmp_path_factory.mktemp("run")
  result = loop.train_and_evaluate(_config(), str(workdir))
  return workdir, jax.device_get(result.state)


def _copy(run, tmp_path):
  workdir = tmp_path / "w"
  shutil.copytree(run[0], workdir)
  return workdir


def _largest_data_files(step_dir):
  """The largest OCDBT data file of each data folder of the step's state
  (the process's own database and the merged one)."""
  folders = glob.glob(f"{step_dir}/state/**/d/", recursive=True)
  return [max(glob.glob(f"{d}*"), key=os.path.getsize) for d in folders]


def _damage(step_dir, how):
  """The newest step's files damaged the ways a crash or a disk can."""
  if how == "lost fingerprints":   # a partial copy without the record
    shutil.rmtree(step_dir / ckpt_lib.FINGERPRINTS)
    return
  if how == "emptied":   # every file of the step 0 bytes long
    for f in glob.glob(f"{step_dir}/**/*", recursive=True):
      if os.path.isfile(f):
        os.truncate(f, 0)
    return
  for data in _largest_data_files(step_dir):
    size = os.path.getsize(data)
    if how == "truncated":
      os.truncate(data, size // 2)
    elif how == "zeroed":
      with open(data, "r+b") as f:
        f.write(bytes(size))
    elif how == "bitflip":   # 64 bytes XOR-ed in the middle
      with open(data, "r+b") as f:
        f.seek(size // 2 - 32)
        block = f.read(64)
        f.seek(size // 2 - 32)
        f.write(bytes(b ^ 0xFF for b in block))


def _np_fingerprint(x: np.ndarray) -> str:
  """The module docstring's formula, in NumPy integers (a reference)."""
  bits = np.ascontiguousarray(x).view(
      {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
  ).reshape(-1).astype(np.uint64)
  i = np.arange(bits.size, dtype=np.uint64)
  m32 = np.uint64(2**32 - 1)
  g = np.uint64(0x9E3779B1)
  weighted = int(np.sum((bits * (((2 * i + 1) * g) & m32)) & m32)) % 2**32
  v = (bits ^ ((i * g) & m32)) & m32
  v ^= v >> np.uint64(16)
  v = (v * np.uint64(0x7FEB352D)) & m32
  v ^= v >> np.uint64(15)
  v = (v * np.uint64(0x846CA68B)) & m32
  v ^= v >> np.uint64(16)
  mixed = int(np.sum(v)) % 2**32
  shape = ",".join(map(str, x.shape))
  return f"{x.dtype}[{shape}]:{weighted:08x}-{mixed:08x}"


def test_fingerprint_equals_numpy_on_any_sharding_and_sees_one_bit():
  rng = np.random.default_rng(0)
  arrays = {"f": rng.normal(size=(8, 6)).astype(np.float32),
            "b": rng.normal(size=(5, 8)).astype(jnp.bfloat16),
            "i": rng.integers(-9, 9, size=(3,)).astype(np.int32)}
  want = {k: _np_fingerprint(v) for k, v in arrays.items()}
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  specs = {"f": P("d", None), "b": P(None, "d"), "i": P()}
  sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k]))
             for k, v in arrays.items()}
  # NumPy on the host and jit on the devices, on 8, 1 or no device; the
  # NumPy path in chunks that split every array too.
  for tree in (arrays, sharded, jax.device_put(arrays, jax.devices()[0])):
    for on_host in (None, True, False):
      assert integrity.summarise(tree, on_host=on_host)[0] == want, on_host
  for k, v in arrays.items():
    a, b = (int(x) for x in integrity._host_summary(v, chunk=7)[:2])  # pylint: disable=protected-access
    assert want[k].endswith(f":{a:08x}-{b:08x}"), k
  # Keys and booleans (a train state's rng, masks): both paths agree.
  other = {"k": jax.random.split(jax.random.key(5), 3),
           "m": arrays["f"] > 0}
  assert (integrity.summarise(other, on_host=True)
          == integrity.summarise(other, on_host=False))
  flipped = arrays["f"].copy()
  flipped.view(np.uint32)[3, 4] ^= 1 << 31
  swapped = arrays["f"].copy()
  swapped[[0, 1]] = swapped[[1, 0]]
  for other in (flipped, swapped):
    assert integrity.problems({"f": other}, {"arrays": want}) == [
        "fingerprint mismatch in f"]
  nan = arrays["f"].copy()
  nan[2, 2] = np.nan
  assert integrity.problems({"f": nan}, None) == ["NaN/Inf in f"]


def _alter_silently(step_dir):
  """A flipped bit that Orbax cannot notice: the step's state item written
  again, by Orbax, with one bit of one float changed (a file system or a
  copy that changed data under a valid container)."""
  checkpointer = ocp.StandardCheckpointer()
  tree = checkpointer.restore(step_dir / "state")
  kernel = tree["params"]["encoder"]["stack"]["layer_0"]["token_mixing"]
  leaf = max(jax.tree.leaves(kernel), key=lambda x: x.size)
  bits = np.array(leaf).view(np.uint32)
  bits.flat[bits.size // 2] ^= 1   # the lowest mantissa bit
  path = jax.tree_util.tree_flatten_with_path(tree)[0]
  flat = [bits.view(np.float32) if x is leaf else x for _, x in path]
  tree = jax.tree_util.tree_unflatten(jax.tree.structure(tree), flat)
  shutil.rmtree(step_dir / "state")
  checkpointer.save(step_dir / "state", tree)
  checkpointer.wait_until_finished()
  checkpointer.close()


@pytest.mark.slow
def test_silently_altered_newest_step_is_set_aside_and_trained_again(
    run, tmp_path, caplog):
  workdir = _copy(run, tmp_path)
  ck = workdir / "checkpoints"
  _alter_silently(ck / "8")
  [row, _] = verify.verify(workdir)
  assert row.status == "damaged"
  assert row.what.startswith("fingerprint mismatch in params/encoder/stack/"
                             "layer_0/token_mixing/")
  with caplog.at_level("WARNING"):
    result = loop.train_and_evaluate(_config(), str(workdir))
  assert result.source == "workdir" and result.step == 8
  assert f"Checkpoint {ck}/8 does not restore: IntegrityError: " in caplog.text
  assert "Resuming from step 4, the newest step that restores." in caplog.text
  [aside] = os.listdir(workdir / "checkpoints_damaged")
  assert aside.startswith("8-") and os.listdir(
      workdir / "checkpoints_damaged" / aside)
  # Step 8 saved again, bit for bit the state of the undamaged run.
  rows = verify.verify(workdir)
  assert [(r.step, r.status) for r in rows] == [
      ("8", "ok"), ("4", "ok"), (aside, "set aside")]
  # Steps earlier versions set aside inside the folder are listed too.
  (ck / "damaged" / "4-20250101T000000Z").mkdir(parents=True)
  assert [(r.status, r.what) for r in verify.verify(workdir)[2:]] == [
      ("set aside", f"checkpoints_damaged/{aside}"),
      ("set aside", "damaged/4-20250101T000000Z")]
  for a, b in zip(jax.tree.leaves(jax.device_get(result.state)),
                  jax.tree.leaves(run[1])):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("edit, what", [
    (lambda r, k: r.pop(k), "no fingerprint recorded for {k}"),
    (lambda r, k: r.__setitem__(k, "bfloat16" + r[k][len("float32"):]),
     "dtype or shape other than recorded in {k}"),
    (lambda r, k: r.__setitem__(k + "_copy", r[k]),
     "recorded arrays missing from the checkpoint: {k}_copy"),
])
def test_verify_finds_a_fingerprint_record_that_does_not_cover_the_step(
    run, tmp_path, edit, what):
  # A restore may cast (fine-tuning in another dtype) and skips what the
  # record does not cover; verify reads the whole step at its saved dtypes,
  # so an edited or partial record is damage, not "ok".
  workdir = _copy(run, tmp_path)
  path = workdir / "checkpoints" / "8" / ckpt_lib.FINGERPRINTS / "metadata"
  record = json.loads(open(path).read())
  key = "params/encoder/conv_stem_0/kernel"
  assert record["arrays"][key].startswith("float32[")
  edit(record["arrays"], key)
  with open(path, "w") as f:
    json.dump(record, f)
  rows = verify.verify(workdir)
  assert [(r.step, r.status) for r in rows] == [("8", "damaged"), ("4", "ok")]
  assert rows[0].what == what.format(k=key)


@pytest.mark.parametrize("how", ["truncated", "zeroed", "emptied", "bitflip",
                                 "lost fingerprints"])
def test_verify_names_the_damaged_step(run, tmp_path, how):
  workdir = _copy(run, tmp_path)
  _damage(workdir / "checkpoints" / "8", how)
  rows = verify.verify(workdir)
  assert [(r.step, r.status) for r in rows] == [("8", "damaged"), ("4", "ok")]
  assert rows[1].what.endswith("arrays match")
  assert rows[0].what and "\n" not in rows[0].what
  assert ("(empty files: _CHECKPOINT_METADATA, commit_success.txt, "
          "data/commit_success.txt and " in rows[0].what) == (how == "emptied")
  if how == "lost fingerprints":
    assert rows[0].what == (
        f"IntegrityError: {workdir}/checkpoints/8: no fingerprints "
        f"({ckpt_lib.FINGERPRINTS}/), though the older step 4 has them: the "
        "file was lost (a partial copy?), so the step is treated as damaged")


def test_verify_names_a_missing_process_position(run, tmp_path):
  # A partial copy (one host's input position missing) restores on no
  # resume, so verify must not call it ok.
  workdir = _copy(run, tmp_path)
  data = workdir / "checkpoints" / "8" / "data"
  [position] = [f for f in os.listdir(data) if f.startswith("process_")]
  count = int(position.split("-of-")[1].split(".")[0])
  os.rename(data / position, data / "process_0-of-2.json")
  rows = verify.verify(workdir)
  assert [(r.step, r.status) for r in rows] == [("8", "damaged"), ("4", "ok")]
  assert count == 1 and (
      f"{data / 'process_1-of-2.json'} is missing (the input position of "
      "process 1 of 2)") in rows[0].what


@pytest.mark.parametrize("content", [None, "null", "{}", '{"epoch": 0}',
                                     "altered"])
def test_a_damaged_input_position_makes_its_step_damaged(run, tmp_path,
                                                         content, caplog):
  # The only position file lost, holding no position, or with one changed
  # digit that still parses (its batch number): the step does not resume
  # where it stopped, so verify names it and training resumes from the older
  # step (never from the start of the data or another batch, nor a config
  # blame).
  workdir = _copy(run, tmp_path)
  data = workdir / "checkpoints" / "8" / "data"
  [position] = [data / f for f in os.listdir(data)
                if f.startswith("process_")]
  text = position.read_text()
  if content is None:
    os.remove(position)
  elif content == "altered":
    assert '"batch": 8,' in text
    position.write_text(text.replace('"batch": 8,', '"batch": 9,'))
  else:
    position.write_text(content)
  rows = verify.verify(workdir)
  assert [(r.step, r.status) for r in rows] == [("8", "damaged"), ("4", "ok")]
  why = ("differs from its sha256 digest" if content == "altered"
         else "holds no input position")
  assert why in rows[0].what and "\n" not in rows[0].what, rows[0].what
  if content not in ("{}", "altered"):
    return
  with caplog.at_level("WARNING"):
    result = loop.train_and_evaluate(_config(), str(workdir))
  assert "Resuming from step 4, the newest step that restores." in caplog.text
  assert (f"{position}: its input position differs" if content == "altered"
          else f"{position} holds no input position") in caplog.text
  assert result.source == "workdir" and result.step == 8


def test_readers_fall_back_and_name_their_step(run, tmp_path, caplog):
  workdir = _copy(run, tmp_path)
  _damage(workdir / "checkpoints" / "8", "zeroed")
  with caplog.at_level("WARNING"):
    metrics = artifacts.evaluate_checkpoint(_config(), str(workdir))
  assert f"checkpoints/8 does not read: " in caplog.text
  assert "reading step 4 instead" in caplog.text
  saved = json.load(open(workdir / "evaluations" / "validation_step4.json"))
  assert saved["step"] == 4 and saved["mse"] == metrics["mse"]
  logged = metrics_lib.read_metrics(str(workdir), "eval")[4]["mse"]
  np.testing.assert_allclose(metrics["mse"], logged, rtol=1e-6)
  assert os.path.isdir(workdir / "checkpoints" / "8")   # a reader moves nothing
  # Every kind of damage, the same fallback (the errors Orbax gave each
  # were OUT_OF_RANGE, a TypeError on None metadata, a KeyError).
  for how in ("truncated", "emptied", "bitflip", "lost fingerprints"):
    other = tmp_path / how
    shutil.copytree(run[0], other)
    _damage(other / "checkpoints" / "8", how)
    assert artifacts.load_params(_config(), str(other))[1] == 4, how
  # Export falls back the same way; --mode=verify reads exports too.
  artifacts.export_params(_config(), str(workdir), str(tmp_path / "p"))
  assert [(r.step, r.status) for r in verify.verify(tmp_path / "p")] == [
      ("4", "ok")]
  # A step asked for by name is never replaced by another.
  with pytest.raises(ckpt_lib.CheckpointError) as e:
    artifacts.load_params(_config(), str(workdir), step=8)
  assert str(e.value).startswith(f"checkpoint {workdir}/checkpoints/8 does "
                                 "not read: ")
  assert "\n" not in str(e.value)


def test_steps_saved_without_fingerprints_still_restore(tmp_path, caplog):
  """A step written the way checkpoints were before fingerprints."""
  state = {"params": {"w": np.arange(6, dtype=np.float32)}}
  manager = ocp.CheckpointManager(tmp_path, item_names=("state", "data"))
  manager.save(3, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=multihost.DataStateSave({"epoch": 0, "batch": 3})))
  manager.wait_until_finished()
  manager.close()
  with caplog.at_level("WARNING"), ckpt_lib.Checkpointer(tmp_path) as ck:
    step, restored, data = ck.restore_latest(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(
                jax.make_mesh((1,), ("d",)), P())), state))
  assert step == 3 and data == {"epoch": 0, "batch": 3}
  np.testing.assert_array_equal(restored["params"]["w"], np.arange(6))
  assert "no fingerprints (saved before they existed): restored with the " \
      "NaN/Inf check alone" in caplog.text
  [row] = verify.verify(tmp_path)
  assert (row.step, row.status) == ("3", "ok, no fingerprint")


def test_a_state_that_is_not_finite_is_never_saved(tmp_path):
  """Parameters (or moments) turned NaN/Inf while the loss stayed finite:
  the save is refused, naming the arrays and the step kept, and the good
  step stays the newest (retention never drops it for a bad one)."""
  good = {"params": {"w": jnp.arange(4.0), "b": jnp.ones(2)},
          "opt": {"mu": jnp.zeros(4)}}
  bad = {"params": {"w": jnp.array([0.0, jnp.nan, 1.0, 2.0]),
                    "b": jnp.ones(2)},
         "opt": {"mu": jnp.array([jnp.inf, 0.0, 0.0, 0.0])}}
  with ckpt_lib.Checkpointer(tmp_path, save_every=1, keep=1) as ck:
    assert ck.save(1, good)
    ck.wait_until_finished()
    with pytest.raises(FloatingPointError) as e:
      ck.save(2, bad)
    ck.wait_until_finished()
    assert ck.all_steps() == [1]
  message = str(e.value)
  assert message.startswith("step 2: 2 array(s) of the state hold NaN/Inf (")
  assert "params/w" in message and "opt/mu" in message
  assert "params/b" not in message
  assert message.endswith(f"The latest checkpoint is step 1 in {tmp_path}.")
  assert sorted(os.listdir(tmp_path)) == ["1"]


def test_verify_from_the_command_line(run, tmp_path):
  workdir = _copy(run, tmp_path)
  _damage(workdir / "checkpoints" / "8", "bitflip")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run(
      [sys.executable, "-m", "hypermixer_jax.main", "--mode=verify",
       f"--workdir={workdir}"], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=120)
  assert out.returncode == 1, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert lines[0].split() == ["step", "status", "what", "failed", "/",
                              "checked"]
  assert lines[1].split()[:2] == ["8", "damaged"]
  assert lines[2].split()[:2] == ["4", "ok"]
  assert out.stderr.splitlines()[-1] == (
      f"Damaged: step(s) 8 of {workdir}; training on this workdir resumes "
      "from the newest step that restores and moves the damaged steps newer "
      "than it to checkpoints_damaged/.")
  assert "Traceback" not in out.stderr
  # The run's checkpoints folder (verify reads it too) is no export.
  out = subprocess.run(
      [sys.executable, "-m", "hypermixer_jax.main", "--mode=verify",
       f"--workdir={workdir / 'checkpoints'}"], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=120)
  assert out.returncode == 1, out.stderr[-2000:]
  assert "training on this workdir resumes" in out.stderr.splitlines()[-1]
  # An exported folder is not trained on: its fix is another export.
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  export = tmp_path / "export"
  artifacts.export_params(_config(), str(run[0]), str(export), step=8)
  _damage(export / "8", "bitflip")
  out = subprocess.run(
      [sys.executable, "-m", "hypermixer_jax.main", "--mode=verify",
       f"--workdir={export}"], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=120)
  assert out.returncode == 1, out.stderr[-2000:]
  assert out.stderr.splitlines()[-1] == (
      f"Damaged: step(s) 8 of {export}; an exported folder is not trained "
      "on: export those steps again from their run (--mode=export --step=N "
      "--overwrite).")


def _main_env():
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
              XLA_FLAGS=(os.environ["HYPERMIXER_TEST_XLA_FLAGS"] +
                         " --xla_force_host_platform_device_count=8"))


@pytest.mark.slow
def test_evaluate_beside_training_with_keep_checkpoints_1(tmp_path, caplog):
  """Retention deletes each step once the next is saved; evaluations read
  while it does still finish, each on a step that the run saved."""
  workdir = tmp_path / "w"
  train = subprocess.Popen(
      [sys.executable, "-m", "hypermixer_jax.main", f"--config={DEFAULT}",
       *TINY, "--config.num_train_steps=40", "--config.checkpoint_every=1",
       "--config.keep_checkpoints=1", "--config.eval_every=0",
       "--config.log_every=20", f"--workdir={workdir}"],
      cwd=ROOT, env=_main_env(), stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True)
  evaluated = 0
  try:
    while not any(p.name.isdigit()
                  for p in (workdir / "checkpoints").glob("*")):
      assert train.poll() is None, train.stderr.read()[-2000:]
      time.sleep(0.1)
    with caplog.at_level("WARNING"):
      while train.poll() is None and evaluated < 3:
        artifacts.evaluate_checkpoint(_config(), str(workdir))
        evaluated += 1
  finally:
    if train.poll() is None:   # enough evaluations beside it
      train.kill()
    train.communicate()
  assert train.returncode in (0, -9)
  steps = sorted(int(f.split("step")[1].split(".")[0])
                 for f in os.listdir(workdir / "evaluations"))
  assert evaluated >= 2 and steps and all(1 <= s <= 40 for s in steps)
  assert "does not read" not in caplog.text   # nothing was damaged


@pytest.mark.parametrize("error", [
    TimeoutError("read timed out"),
    ValueError("Error reading ...: UNAVAILABLE: gcs backend 503")])
def test_a_read_failed_by_the_storage_stops_and_sets_nothing_aside(
    run, tmp_path, monkeypatch, error):
  # A timeout or an unavailable store says nothing about the newest step:
  # resuming from an older one would set a good step aside and redo work.
  workdir = _copy(run, tmp_path)
  ck = workdir / "checkpoints"
  restore = ckpt_lib.Checkpointer.restore

  def flaky(self, step, abstract_state):
    if step == 8:
      raise error
    return restore(self, step, abstract_state)
  monkeypatch.setattr(ckpt_lib.Checkpointer, "restore", flaky)
  assert ckpt_lib.of_environment(error)
  assert not ckpt_lib.of_environment(ValueError("DATA_LOSS: truncated"))
  # gcsfs (gs:// without TensorFlow) once its retries are spent: the HTTP
  # status says whether the store failed or the object is missing.
  from gcsfs import retry  # pylint: disable=g-import-not-at-top
  import aiohttp  # pylint: disable=g-import-not-at-top
  for code, failed in ((503, True), (429, True), (408, True), (404, False),
                       (412, False)):
    assert ckpt_lib.of_environment(
        retry.HttpError({"code": code, "message": "x"})) == failed, code
  assert ckpt_lib.of_environment(aiohttp.ServerDisconnectedError())
  assert not ckpt_lib.of_environment(aiohttp.ClientPayloadError("cut"))
  # TensorFlow's file system (gs:// through etils) names the status by the
  # error's class alone; Orbax may wrap it.
  class UnavailableError(Exception):
    pass
  try:
    try:
      raise UnavailableError("connection reset")
    except UnavailableError as inner:
      raise ValueError("Failed to read step") from inner
  except ValueError as wrapped:
    assert ckpt_lib.of_environment(wrapped)
  with pytest.raises(ckpt_lib.CheckpointError) as e:
    loop.train_and_evaluate(_config(), str(workdir))
  assert str(e.value).startswith(
      f"{ck}/8 could not be read now ({type(error).__name__}: ")
  assert "nothing is set aside and no older step is used" in str(e.value)
  assert sorted(os.listdir(ck)) == ["4", "8"]
  monkeypatch.setattr(ckpt_lib.Checkpointer, "restore", restore)
  assert [(r.step, r.status) for r in verify.verify(workdir)] == [
      ("8", "ok"), ("4", "ok")]


def test_collected_read_coroutines_of_a_damaged_step_are_not_reported(
    monkeypatch):
  """Orbax's array-read coroutines collected after a failed restore report
  their error (with the array's whole TensorStore spec) through
  sys.unraisablehook: dropped; any other unraisable report goes on."""
  import types  # pylint: disable=g-import-not-at-top
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)
  ckpt_lib.quiet_failed_reads()
  where = {}
  exec(compile("async def _read_array_index_and_device_put(): pass",   # pylint: disable=exec-used
               os.path.join(os.sep, "venv", "orbax", "checkpoint", "_src",
                            "serialization.py"), "exec"), where)
  async def ours():
    pass
  for coroutine in (where["_read_array_index_and_device_put"](), ours()):
    sys.unraisablehook(types.SimpleNamespace(
        exc_type=Exception, exc_value=Exception("reading array index"),
        exc_traceback=None, err_msg=None, object=coroutine))
    coroutine.close()
  assert [r.object.__qualname__ for r in seen] == [
      "test_collected_read_coroutines_of_a_damaged_step_are_not_reported."
      "<locals>.ours"]


def test_leftover_read_errors_of_a_damaged_step_are_not_reported(caplog):
  """A damaged step fails several TensorStore reads; the first is the
  reason, the others asyncio would log (whenever the garbage collector
  runs) as tracebacks: dropped, while any other asyncio error is kept."""
  import logging  # pylint: disable=g-import-not-at-top
  ckpt_lib.quiet_failed_reads()
  log = logging.getLogger("asyncio")
  read = ValueError('DATA_LOSS: Error opening "zarr" driver: ... '
                    "[tensorstore_spec='{}']")
  with caplog.at_level("ERROR", logger="asyncio"):
    for error in (read, ValueError("a bug of ours")):
      log.error("Task exception was never retrieved\nfuture: <Task>",
                exc_info=(ValueError, error, None))
  assert [str(r.exc_info[1]) for r in caplog.records] == ["a bug of ours"]
