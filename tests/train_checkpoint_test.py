"""Tests of hypermixer_jax.train.checkpoint: save/restore across meshes, fine-tune loading."""
import hashlib
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hypermixer_jax.train import checkpoint as ckpt_lib
from hypermixer_jax.train import multihost


def _mesh(n):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _state(mesh, seed=0):
  rng = np.random.default_rng(seed)
  tree = {"params": {"encoder": {"kernel": rng.normal(size=(16, 24)),
                                 "bias": rng.normal(size=(24,))},
                     "head": {"kernel": rng.normal(size=(24, 5))}},
          "step": np.int32(7)}
  specs = {"params": {"encoder": {"kernel": P("data", None),
                                  "bias": P("data")},
                      "head": {"kernel": P()}},
           "step": P()}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  state = jax.tree.map(lambda x, s: jax.device_put(np.asarray(x, np.float32)
                                                   if x.ndim else x, s),
                       tree, shardings)
  return state, shardings


@pytest.mark.parametrize("n_save,n_restore", [(8, 1), (1, 8)])
def test_restore_onto_other_device_count(tmp_path, n_save, n_restore):
  state, _ = _state(_mesh(n_save))
  ck = ckpt_lib.Checkpointer(tmp_path / "ck", save_every=1, keep=2)
  assert ck.save(3, state, {"position": np.int64(42), "epoch": [1, 2]})
  ck.wait_until_finished()
  assert ck.latest_step() == 3

  template, shardings = _state(_mesh(n_restore), seed=1)
  restored, data = ckpt_lib.Checkpointer(tmp_path / "ck").restore(
      None, ckpt_lib.abstract_like(template, shardings))
  assert data == {"position": 42, "epoch": [1, 2]}
  for a, b, s in zip(jax.tree.leaves(restored), jax.tree.leaves(state),
                     jax.tree.leaves(shardings)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding == s
    assert len(a.sharding.device_set) == n_restore


def test_retention_and_interval(tmp_path):
  state, _ = _state(_mesh(2))
  ck = ckpt_lib.Checkpointer(tmp_path, save_every=2, keep=3)
  started = [step for step in range(1, 8) if ck.save(step, state, {})]
  assert started == [2, 4, 6]
  assert ck.save(7, state, {}, force=True)  # the end of a run
  assert not ck.save(7, state, {}, force=True)  # never twice
  ck.close()
  assert list(ckpt_lib.Checkpointer(tmp_path).all_steps()) == [4, 6, 7]


def _save_pretrained(path):
  state, _ = _state(_mesh(8))
  ck = ckpt_lib.Checkpointer(path / "checkpoints", save_every=1)
  ck.save(5, state, {})
  ck.close()
  return state


def test_load_pretrained_encoder_new_head(tmp_path):
  pre = _save_pretrained(tmp_path)
  mesh = _mesh(4)
  rng = np.random.default_rng(3)
  rep = NamedSharding(mesh, P())
  new = {"encoder": {"kernel": jnp.zeros((16, 24)), "bias": jnp.zeros((24,))},
         "head": {"kernel": jnp.asarray(rng.normal(size=(24, 3)),
                                        jnp.float32),
                  "bias": jnp.ones((3,))}}
  new = jax.device_put(new, rep)
  out = ckpt_lib.load_pretrained(tmp_path, new, reinit=["head"])
  np.testing.assert_array_equal(out["encoder"]["kernel"],
                                pre["params"]["encoder"]["kernel"])
  np.testing.assert_array_equal(out["encoder"]["bias"],
                                pre["params"]["encoder"]["bias"])
  np.testing.assert_array_equal(out["head"]["kernel"], new["head"]["kernel"])
  np.testing.assert_array_equal(out["head"]["bias"], 1.0)
  assert out["encoder"]["kernel"].sharding == rep


def test_load_pretrained_mismatch_names_every_path(tmp_path):
  _save_pretrained(tmp_path)
  new = {"encoder": {"kernel": jnp.zeros((16, 32)),
                     "extra": jnp.zeros((2,))},
         "head": {"kernel": jnp.zeros((32, 3))}}
  with pytest.raises(ValueError) as e:
    ckpt_lib.load_pretrained(tmp_path / "checkpoints/5", new, reinit=["head"])
  msg = str(e.value)
  assert "shape mismatch: encoder/kernel checkpoint (16, 24) vs model (16, 32)" in msg
  assert "missing from checkpoint: encoder/extra" in msg
  assert "unexpected in checkpoint: encoder/bias" in msg


def test_load_pretrained_into_other_dtype_checks_the_saved_bits(tmp_path):
  """Read into a bf16 model, the parameters are the saved float32 values
  cast; the fingerprints are checked on the saved bits first, so a step
  altered under a valid container is refused, not cast and loaded."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  pre = _save_pretrained(tmp_path)
  new = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.bfloat16),
                     jax.device_get(pre["params"]))
  out = ckpt_lib.load_pretrained(tmp_path, new, reinit=[])
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(pre["params"])):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(a, np.asarray(b).astype(jnp.bfloat16))
  with pytest.raises(ValueError, match=r"init_reinit=\['.\*'\] "
                     r"re-initialises every one of the model's 3 parameter "
                     r"arrays, so nothing would be loaded"):
    ckpt_lib.load_pretrained(tmp_path, new, reinit=[".*"])
  # One bit of the encoder's kernel flipped, the state written again.
  step = tmp_path / "checkpoints" / "5" / ckpt_lib.STATE
  saver = ocp.StandardCheckpointer()
  tree = jax.device_get(saver.restore(step))
  bits = np.array(tree["params"]["encoder"]["kernel"]).view(np.uint32)
  bits.flat[7] ^= 1 << 30
  tree["params"]["encoder"]["kernel"] = bits.view(np.float32)
  shutil.rmtree(step)
  saver.save(step, tree)
  saver.wait_until_finished()
  saver.close()
  with pytest.raises(ckpt_lib.CheckpointError,
                     match="fingerprint mismatch in params/encoder/kernel"):
    ckpt_lib.load_pretrained(tmp_path, new, reinit=[])


def _damage(folder, how):
  """Damages one saved step folder the ways a crash or a disk can."""
  import os  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  files = [os.path.join(r, f) for r, _, fs in os.walk(folder) for f in fs]
  if how == "truncated":   # every array data file cut in half
    for f in files:
      if "/state/" in f and "ocdbt" in f and os.path.getsize(f) > 64:
        with open(f, "r+b") as h:
          h.truncate(os.path.getsize(f) // 2)
  elif how == "garbage_metadata":
    for f in files:
      if os.path.basename(f) in ("_METADATA", "_sharding"):
        with open(f, "wb") as h:
          h.write(b"\x00garbage{")
  elif how == "missing_manifest":
    for f in files:
      if "manifest" in os.path.basename(f):
        os.remove(f)
  elif how == "emptied":
    for entry in os.listdir(folder):
      path = os.path.join(folder, entry)
      shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


@pytest.mark.parametrize("how", ["truncated", "garbage_metadata",
                                 "missing_manifest", "emptied"])
def test_damaged_newest_step_falls_back(tmp_path, how, caplog):
  import os  # pylint: disable=g-import-not-at-top
  mesh = _mesh(2)
  state, shardings = _state(mesh)
  with ckpt_lib.Checkpointer(tmp_path, save_every=1, keep=5) as ck:
    for step in (1, 2):
      bumped = jax.tree.map(lambda x, s=step: x + s, state)
      ck.save(step, bumped, {"batch": step})
      ck.wait_until_finished()
  _damage(os.path.join(tmp_path, "2"), how)
  abstract = ckpt_lib.abstract_like(state, shardings)
  with ckpt_lib.Checkpointer(tmp_path) as ck, caplog.at_level("WARNING"):
    step, restored, data = ck.restore_latest(abstract)
  assert step == 1 and data == {"batch": 1}
  np.testing.assert_array_equal(restored["params"]["head"]["kernel"],
                                np.asarray(state["params"]["head"]["kernel"])
                                + 1)
  assert f"Checkpoint {tmp_path}/2 does not restore: " in caplog.text
  # Set aside, never deleted, so that the step can be saved again; outside
  # the checkpoints folder, where Orbax's clean-up of unfinished folders
  # (on gs://: every folder without a commit file) never reaches.
  [aside] = os.listdir(f"{tmp_path}_damaged")
  assert aside.startswith("2-") and not os.path.exists(tmp_path / "2")
  assert os.listdir(tmp_path) == ["1"]
  assert f"{tmp_path}/2 moved to {tmp_path}_damaged/{aside}" in caplog.text

  # Every step damaged: an error naming each folder, never a fresh start.
  _damage(os.path.join(tmp_path, "1"), how)
  with ckpt_lib.Checkpointer(tmp_path) as ck:
    with pytest.raises(ckpt_lib.CheckpointError) as e:
      ck.restore_latest(abstract)
  msg = str(e.value)
  assert f"{tmp_path}/1: " in msg and "Not starting from scratch" in msg
  assert os.path.isdir(tmp_path / "1")   # nothing to fall back to: left


def test_readers_fall_back_and_follow_retention(tmp_path, caplog,
                                                monkeypatch):
  """``load_pretrained_step`` (evaluate, predict, export, init_checkpoint):
  past a damaged step, moving nothing; on to the newer step when the one it
  reads is deleted under it."""
  import os  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  state, _ = _state(_mesh(2))
  bumped = lambda s: jax.tree.map(lambda x: x + s, state)  # noqa: E731
  with ckpt_lib.Checkpointer(tmp_path, save_every=1, keep=5) as ck:
    for step in (1, 2):
      ck.save(step, bumped(step), {})
  _damage(os.path.join(tmp_path, "2"), "truncated")
  with caplog.at_level("WARNING"):
    params, step = ckpt_lib.load_pretrained_step(tmp_path, state["params"], ())
  assert step == 1
  assert (f"Checkpoint {tmp_path}/2 does not read: ValueError: "
          in caplog.text) and "reading step 1 instead" in caplog.text
  np.testing.assert_array_equal(params["head"]["kernel"],
                                bumped(1)["params"]["head"]["kernel"])
  assert os.path.isdir(tmp_path / "2")   # a reader moves nothing

  real = ckpt_lib._load_step

  def retention(manager, directory, step, *args):
    if step == 1:   # a training saves step 3 and deletes step 1 meanwhile
      with ckpt_lib.Checkpointer(tmp_path, save_every=1) as ck:
        ck.save(3, bumped(3), {})
      shutil.rmtree(tmp_path / "1")
    return real(manager, directory, step, *args)

  monkeypatch.setattr(ckpt_lib, "_load_step", retention)
  caplog.clear()
  with caplog.at_level("WARNING"):
    params, step = ckpt_lib.load_pretrained_step(tmp_path, state["params"], ())
  assert step == 3 and (f"Checkpoint {tmp_path}/1 went away while being "
                        "read" in caplog.text)
  np.testing.assert_array_equal(params["head"]["kernel"],
                                bumped(3)["params"]["head"]["kernel"])


def test_empty_directory_restores_nothing(tmp_path):
  state, shardings = _state(_mesh(1))
  with ckpt_lib.Checkpointer(tmp_path) as ck:
    assert ck.restore_latest(ckpt_lib.abstract_like(state, shardings)) is None


def test_missing_init_checkpoint_is_named(tmp_path):
  with pytest.raises(FileNotFoundError,
                     match="checkpoint path .*nowhere.* \\(config.init_checkpoint or --step\\) does not exist"):
    ckpt_lib.load_pretrained(tmp_path / "nowhere", {})


def test_data_position_is_one_file_per_process(tmp_path):
  state, _ = _state(_mesh(2))
  ck = ckpt_lib.Checkpointer(tmp_path, save_every=1)
  ck.save(4, state, {"position": np.int64(9)})
  ck.close()
  data_dir = tmp_path / "4" / "data"
  assert [p.name for p in data_dir.glob("*.json")] == ["process_0-of-1.json"]
  # The position with the SHA-256 of its JSON text.
  assert json.loads((data_dir / "process_0-of-1.json").read_text()) == {
      "sha256": hashlib.sha256(b'{"position": 9}').hexdigest(),
      "input_position": {"position": 9}}


def test_a_position_that_differs_from_its_digest_is_refused(tmp_path):
  item = {"epoch": 1, "batch": 30, "iterator": "CgRzZWVk\u00e9", "lr": 1e-05,
          "ids": [3, -2], "done": False, "none": None}
  path = tmp_path / "process_0-of-1.json"
  path.write_text(multihost.encode_position(item))
  assert multihost.read_position(path) == item
  # Earlier versions' files: the bare position.
  (tmp_path / "bare.json").write_text(json.dumps(item))
  assert multihost.read_position(tmp_path / "bare.json") == item
  for old, new in [('"batch": 30', '"batch": 31'), ("CgRz", "CgRy"),
                   ('"sha256": "', '"sha256": "0')]:
    path.write_text(multihost.encode_position(item).replace(old, new, 1))
    with pytest.raises(ValueError, match=(
        f"^{re.escape(str(path))}: its input position differs from its "
        "sha256 digest .*: the checkpoint is damaged$")):
      multihost.read_position(path)
  path.write_text(multihost.encode_position(item)[:-5])
  with pytest.raises(ValueError, match=f"^{re.escape(str(path))} is not JSON"):
    multihost.read_position(path)


def _as_process(monkeypatch, index, count):
  monkeypatch.setattr(multihost, "_process", lambda: (index, count))


def test_each_process_restores_its_own_position(tmp_path, monkeypatch, caplog):
  handler = multihost.DataStateHandler()
  for i in range(2):  # what two hosts write into one checkpoint's data item
    _as_process(monkeypatch, i, 2)
    handler.save(tmp_path, multihost.DataStateSave({"host": i, "pos": 10 + i}))
  for i in range(2):
    _as_process(monkeypatch, i, 2)
    assert handler.restore(tmp_path) == {"host": i, "pos": 10 + i}
  # Another process count: other shards, no exact position -> from the start.
  _as_process(monkeypatch, 0, 4)
  with caplog.at_level("WARNING"):
    assert handler.restore(tmp_path) is None
  assert "saved by 2 process(es), this run has 4" in caplog.text
  # A host's file missing from a checkpoint of the same count: incomplete.
  (tmp_path / "process_1-of-2.json").unlink()
  _as_process(monkeypatch, 1, 2)
  with pytest.raises(FileNotFoundError, match="process_1-of-2.json is missing"):
    handler.restore(tmp_path)


@pytest.mark.parametrize("record,count,want", [
    ({"pos": 3}, 1, [{"pos": 3}]),
    ({"per_process": [{"pos": 1}, {"pos": 2}]}, 2, [{"pos": 1}, {"pos": 2}]),
    ({"per_process": [{"pos": 1}, {"pos": 2}]}, 1, [None]),
])
def test_earlier_single_record_still_restores(tmp_path, monkeypatch, record,
                                              count, want):
  (tmp_path / "metadata").write_text(json.dumps(record))
  for i in range(count):
    _as_process(monkeypatch, i, count)
    assert multihost.DataStateHandler().restore(tmp_path) == want[i]


def test_one_line_names_the_error_a_read_was_raised_from():
  # Orbax's read error says only which slice failed; TensorStore's, which
  # it is raised from, names the array file and why (a truncated file).
  try:
    try:
      raise ValueError(
          'OUT_OF_RANGE: Error reading "params.x/0.0.0": Requested byte '
          'range [0, 4096) is not valid for value of size 100 '
          '[tensorstore_spec={"driver": "zarr"}]')
    except ValueError as inner:
      raise Exception(   # pylint: disable=broad-exception-raised
          "Encountered error while reading array index: (slice(0, 32, 1),)."
          " See full TensorStore details: <bound method spec of "
          "TensorStore({'base': {'driver': 'zarr'}})>") from inner
  except Exception as e:  # pylint: disable=broad-except
    assert ckpt_lib.one_line(e) == (
        "Exception: Encountered error while reading array index: "
        "(slice(0, 32, 1),). (from ValueError: OUT_OF_RANGE: Error reading "
        '"params.x/0.0.0": Requested byte range [0, 4096) is not valid for '
        "value of size 100)")
  # Without a cause, the message alone.
  assert ckpt_lib.one_line(KeyError("x")) == "KeyError: 'x'"
