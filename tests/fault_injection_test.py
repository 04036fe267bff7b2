"""Faults a run must survive or refuse in one line: a kill between a save and
its evaluation, a full or read-only disk, a workdir that is a file, batches
the devices do not divide, missing data files, damaged or edited
``config.json``, links planted where temporary files go.

The kill and the full disk run ``python -m hypermixer_jax.main`` on a tiny
synthetic model (one device); the full disk is a small tmpfs and the
read-only workdir a read-only bind mount (the tests run as root, which file
modes do not stop); both are skipped where mounting is not allowed. The
damaged and bit-flipped checkpoints are ``checkpoint_integrity_test.py``'s.
"""
import contextlib
import errno
import json
import os
import subprocess
import sys

import pytest

from hypermixer_jax.train import config as train_config
from hypermixer_jax.train import config_checks
from hypermixer_jax.train import preflight
from hypermixer_jax.train import run_config
from hypermixer_jax.train import storage
from hypermixer_jax.train import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config.model.num_layers=1", "--config.model.d_model=16",
        "--config.model.d_ffn=32", "--config.model.max_len=40",
        "--config.model.mixer_kwargs.hyper_dim=8",
        "--config.data.synthetic.seq_len=40",
        "--config.data.synthetic.num_eval_examples=8",
        "--config.batch_size=8", "--config.eval_batch_size=8",
        "--config.eval_steps=1", "--config.warmup_steps=0",
        "--config.log_every=1", "--config.eval_every=3",
        "--config.checkpoint_every=3", "--config.num_train_steps=6",
        "--config.evals.pseudo_attention.every=-1"]


def _run(workdir, *flags, config="configs/default.py"):
  cmd = [sys.executable, "-m", "hypermixer_jax.main", f"--workdir={workdir}",
         *([f"--config={config}", *TINY] if config else []), *flags]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=os.environ["HYPERMIXER_TEST_XLA_FLAGS"])  # one device
  return subprocess.run(cmd, capture_output=True, text=True, env=env,
                        timeout=300, cwd=ROOT)


def _records(workdir, split):
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [r["step"] for r in map(json.loads, lines) if r["split"] == split]


def _stopped(out) -> str:
  """The command's one-line stop; nothing else but absl's INFO lines."""
  assert out.returncode == 1, out.stderr[-3000:]
  others = [l for l in out.stderr.splitlines() if not l.startswith("I1")]
  assert len(others) == 1 and others[0].startswith("Stopped: "), others[:40]
  return others[0]


def test_a_kill_between_save_and_evaluation_loses_no_evaluation(tmp_path):
  work = tmp_path / "w"
  out = _run(work, "--config.debug.kill_after_save_at_step=3")
  assert out.returncode == -9, out.stderr[-3000:]
  assert (work / "checkpoints" / "3").is_dir()
  assert _records(work, "eval") == []          # killed before evaluating 3
  out = _run(work, config=None)                # resumes from its config
  assert out.returncode == 0, out.stderr[-3000:]
  assert "Evaluating step 3 (eval) first" in out.stderr
  assert _records(work, "eval") == [3, 6]
  assert _records(work, "train") == [1, 2, 3, 4, 5, 6]


@contextlib.contextmanager
def _mounted(target, *commands):
  """``mount`` ``commands`` on ``target``; skips the test where not allowed."""
  target.mkdir(parents=True, exist_ok=True)
  for i, args in enumerate(commands):
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode:
      if i:
        subprocess.run(["umount", str(target)], check=False)
      pytest.skip(f"cannot mount here: {done.stderr.strip()}")
  try:
    yield target
  finally:
    subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_full_disk_stops_in_one_line_naming_the_last_good_step(tmp_path):
  disk = tmp_path / "disk"
  with _mounted(disk, ["-t", "tmpfs", "-o", "size=700k", "tmpfs",
                       str(disk)]):
    line = _stopped(_run(disk / "w", "--config.num_train_steps=60",
                         "--config.keep_checkpoints=0"))
    steps = run_config.checkpoint_steps(disk / "w")
    assert steps, "the disk filled before the first checkpoint"
    # Space freed: the same command resumes from the last good step.
    subprocess.run(["mount", "-o", "remount,size=20m", str(disk)],
                   check=True)
    out = _run(disk / "w", "--config.num_train_steps=12",
               "--config.keep_checkpoints=0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from own checkpoint {disk / 'w' / 'checkpoints'} " \
        f"step {steps[-1]}" in out.stderr
    assert _records(disk / "w", "eval") == [3, 6, 9, 12]
  assert line == (
      f"Stopped: No space left on the disk of --workdir={disk / 'w'}: "
      f"stopped, the newest checkpoint folder is step {steps[-1]} in "
      f"{disk / 'w' / 'checkpoints'}; free space (or lower "
      "--config.keep_checkpoints) and run the same command again: it "
      "resumes from there.")


def test_disk_full_is_found_behind_library_errors():
  full = OSError(errno.ENOSPC, "No space left on device")
  try:
    try:
      raise full
    except OSError as e:
      raise RuntimeError("Save Finalize thread failed") from e
  except RuntimeError as wrapped:
    assert preflight.disk_full(wrapped) is full
  tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing local file '
                           '"w/checkpoints/6/_sharding"')
  assert preflight.disk_full(tensorstore).errno == errno.ENOSPC
  assert preflight.disk_full(OSError(errno.EROFS, "read-only")) is None
  assert preflight.disk_full(RuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory while trying to allocate")) is None


def test_a_read_only_workdir_is_refused_before_the_run(tmp_path):
  work = tmp_path / "w"
  work.mkdir()
  with _mounted(work, ["--bind", str(work), str(work)],
                ["-o", "remount,bind,ro", str(work)]):
    with pytest.raises(preflight.WorkdirError) as e:
      workdir_lib.guard(_config(), str(work), is_main=True)
    # Evaluate writes evaluations/ there: it says so before evaluating.
    from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
    with pytest.raises(preflight.WorkdirError, match="Read-only"):
      artifacts.evaluate_checkpoint(_config(), str(work))
  assert str(e.value) == (
      f"--workdir={work} cannot be written (Read-only file system); make "
      "it writable (a read-only mount, or no write permission) or pass "
      "another --workdir.")
  assert not (work / ".lock").exists()


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
  (tmp_path / "f").write_text("x")
  with pytest.raises(preflight.WorkdirError,
                     match=r"--workdir=.*/f is a file, not a folder; pass"):
    preflight.check_writable(str(tmp_path / "f"))
  with pytest.raises(preflight.WorkdirError,
                     match=r"cannot be written \(Not a directory\); a path "
                     "on the way is a file"):
    preflight.check_writable(str(tmp_path / "f" / "w"))


def _config(**fields):
  config = run_config.load_config_file(
      os.path.join(ROOT, "configs", "default.py"))
  config.update(fields)
  return config


@pytest.mark.parametrize("field,value,message", [
    ("batch_size", 12, "batch_size=12 does not divide over the 8 devices "
     "that split the batch (mesh data=8 x fsdp=1 x expert=1 of 8 devices); "
     "pass --config.batch_size=8"),
    ("eval_batch_size", 20, "pass --config.eval_batch_size=16 (a multiple"),
])
def test_batches_the_devices_do_not_divide_stop_at_the_start(field, value,
                                                            message):
  with pytest.raises(config_checks.ConfigError, match=message.replace(
      "(", r"\(").replace(")", r"\)")):
    preflight.check_batches(_config(**{field: value}))
  preflight.check_batches(_config(eval_every=-1, eval_batch_size=20))
  # --mode=evaluate: the evaluation's batch alone.
  preflight.check_batches(_config(batch_size=12), training=False)
  with pytest.raises(config_checks.ConfigError, match="^eval_batch_size=20"):
    preflight.check_batches(_config(eval_every=-1, eval_batch_size=20),
                            training=False)


def test_an_endless_evaluation_split_evaluated_whole_stops_at_the_start():
  endless = _config(eval_steps=-1)
  endless.data.synthetic.num_eval_examples = 0
  with pytest.raises(config_checks.ConfigError, match=(
      r"^eval_steps=-1 evaluates the whole 'validation' split, which "
      r"data.synthetic.num_eval_examples=0 makes an endless stream; ")):
    preflight.check_batches(endless)
  endless.eval_steps = 4        # a fixed number of batches ends
  preflight.check_batches(endless)


@pytest.mark.parametrize("task,split,refused", [
    ("glue_mnli", "test_matched", True), ("glue_sst2", "test", True),
    ("glue_snli", "test", False), ("glue_sst2", "validation", False)])
def test_an_unlabelled_glue_test_split_is_not_scored(task, split, refused):
  config = run_config.load_config_file(
      os.path.join(ROOT, "configs", "glue.py") + f":{task[5:]},hypermixer")
  config.eval_split = split
  if refused:
    with pytest.raises(config_checks.ConfigError, match=(
        rf"^eval_split='{split}': {task}'s test split in TFDS holds no labels "
        r"\(-1\), so it cannot be scored; evaluate on 'validation'")):
      preflight.check_batches(config, training=False)
  else:
    preflight.check_batches(config, training=False)
  config.data.local_files = {"train": "train.tsv", split: "mine.tsv"}
  preflight.check_batches(config, training=False)   # local files: labelled


def test_missing_or_unreadable_data_files_stop_at_the_start(tmp_path):
  train = tmp_path / "train.tsv"
  train.write_text("sentence\tlabel\nok\t1\n")
  config = _config()
  config.data.local_files.train = str(train)
  config.data.local_files.validation = str(tmp_path / "dev.tsv")
  with pytest.raises(FileNotFoundError, match=(
      r"^--config.data.local_files.validation: no file '.*/dev.tsv'; check "
      "the path.$")):
    preflight.check_data_files(config)
  config.data.local_files.validation = str(tmp_path / "dev*.tsv")
  with pytest.raises(FileNotFoundError, match=r"/dev\*.tsv' matches; check"):
    preflight.check_data_files(config)
  (tmp_path / "dev.tsv").mkdir()   # root reads any file: a folder cannot
  with pytest.raises(FileNotFoundError, match=(
      r"--config.data.local_files.validation: .*/dev.tsv cannot be read "
      r"\(Is a directory\); pass a readable file.")):
    preflight.check_data_files(config)
  config.eval_every = -1           # a split the run does not read
  config.evals.pseudo_attention.every = -1
  preflight.check_data_files(config)


def test_temporary_files_do_not_follow_planted_links(tmp_path):
  victim = tmp_path / "victim"
  victim.write_text("precious")
  target = tmp_path / "shared" / "metrics.jsonl"
  target.parent.mkdir()
  # Links at every name the writer could be expected to use.
  for name in (f"{target.name}.{os.getpid()}.tmp", f".{target.name}.tmp"):
    os.symlink(victim, target.parent / name)
  storage.replace(target, "mine\n")
  assert victim.read_text() == "precious"
  assert target.read_text() == "mine\n"
  assert oct(target.stat().st_mode & 0o777) == oct(0o644)
  # A link at the target itself is replaced, never written through.
  target.unlink()
  os.symlink(victim, target)
  storage.replace(target, "again\n")
  assert victim.read_text() == "precious"
  assert not target.is_symlink() and target.read_text() == "again\n"
  assert sorted(p.name for p in target.parent.iterdir()) == sorted(
      [f"{target.name}.{os.getpid()}.tmp", f".{target.name}.tmp",
       target.name])


def _trained_workdir(tmp_path, config):
  """A workdir as a run leaves it: checkpoint steps, config.json and the
  per-run copy (no training: the checks read only these)."""
  work = tmp_path / "w"
  for step in (3, 6):
    (work / "checkpoints" / str(step)).mkdir(parents=True)
  copy = workdir_lib.save_config(config, str(work), 0)
  return work, copy


def test_config_json_damaged_missing_or_edited_says_what_is_true(tmp_path):
  config = _config()
  work, copy = _trained_workdir(tmp_path, config)
  saved = work / "config.json"
  text = saved.read_text()

  saved.write_text(text[:len(text) // 2])          # cut short
  with pytest.raises(run_config.ConfigFlagError) as e:
    run_config.resolve(saved, {}, given=config)    # --config passed too
  assert str(e.value).startswith(f"{saved} is cut short or not a config (")
  assert str(e.value).endswith(
      f"the checkpoints (steps 3, 6) are not affected. Restore it from the "
      f"copy its last run saved: cp {copy} {saved}")

  saved.unlink()                                   # deleted
  with pytest.raises(run_config.ConfigFlagError, match=(
      f"^{saved} is missing: the checkpoints \\(steps 3, 6\\) are not "
      f"affected. Restore it from the copy its last run saved: cp {copy} ")):
    run_config.check_present(work)

  edited = json.loads(text)                        # d_model edited
  edited["model"]["d_model"] = 24
  saved.write_text(json.dumps(edited))
  with pytest.raises(run_config.ConfigFlagError) as e:
    run_config.resolve(saved, {})
  message = str(e.value)
  assert (f"changes the shapes, dtypes or vocabulary of the parameters, or "
          f"the optimizer state's layout or accumulation, that "
          f"{work / 'checkpoints'} holds "
          f"(model.d_model: "
          f"{config.model.d_model} -> 24; the checkpoints were saved with "
          f"{copy}, and they are intact)") in message
  assert "damaged" not in message.replace(str(tmp_path), "")
  # The command line says the same, in one line of its own words.
  line = _stopped(_run(work, "--mode=evaluate", config=None))
  assert line == f"Stopped: {message}"
  edited["model"]["d_model"] = config.model.d_model
  edited["learning_rate"] = 1e-4                   # not a shape: fine
  saved.write_text(json.dumps(edited))
  assert run_config.resolve(saved, {}).learning_rate == 1e-4


def test_config_json_is_written_whole(tmp_path, monkeypatch):
  config = _config()
  workdir_lib.save_config(config, str(tmp_path), 0)
  before = (tmp_path / "config.json").read_text()

  def full_disk(fd, data):
    raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(storage.os, "fsync", lambda fd: full_disk(fd, b""))
  with pytest.raises(OSError, match="No space left"):
    workdir_lib.save_config(train_config.base_config(), str(tmp_path), 3)
  monkeypatch.undo()
  assert (tmp_path / "config.json").read_text() == before
  assert not [p for p in tmp_path.rglob("*.tmp")]


@pytest.mark.parametrize("name", ["../x.png", "/tmp/x.png", "a/../../x.png",
                                  "out/x.png"])
def test_evaluator_files_stay_inside_the_workdir(tmp_path, name):
  from hypermixer_jax.train import evaluation  # pylint: disable=g-import-not-at-top
  work = tmp_path / "w"
  work.mkdir()
  os.symlink(tmp_path, work / "out")          # a link that leads out
  config = _config()
  config.evals.pseudo_attention.filename = name
  context = evaluation.Context(
      config=config, workdir=str(work), model=None, facts=None, mesh=None,
      rules=None, state_shardings=None, pipeline=None, write_image=None,
      is_main=True)
  with pytest.raises(config_checks.ConfigError, match=(
      f"^evals.pseudo_attention.filename='{name}' must be a file name "
      r"relative to the workdir that stays inside it \(no absolute path, no "
      r"'..'\); e.g. --config.evals.pseudo_attention.filename=x.png.$")):
    evaluation.declared(context)
  config.evals.pseudo_attention.filename = "maps/x.png"
  assert [ev.name for ev in evaluation.declared(context)] == [
      "eval", "pseudo_attention"]


def test_predict_input_that_is_a_folder_or_not_text(tmp_path):
  from hypermixer_jax.data import DataError  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  with pytest.raises(DataError, match=f"^--input={tmp_path} is a folder; "
                     "pass a file"):
    artifacts._read_lines(str(tmp_path))
  with pytest.raises(DataError, match=(
      f"^--input={tmp_path / 'nope.txt'}: no such file; check the path")):
    artifacts._read_lines(str(tmp_path / "nope.txt"))
  binary = tmp_path / "model.bin"
  binary.write_bytes(b"ok\r\nstill ok \xc3\xa9\n\x89PNG\x00\xff\n")
  with pytest.raises(DataError, match=(
      f"^{binary}:3: the line is not valid UTF-8 \\(byte 1\\); re-encode")):
    artifacts._read_lines(str(binary))
  binary.write_bytes(b"ok\r\nstill ok \xc3\xa9\n")
  assert artifacts._read_lines(str(binary)) == ["ok", "still ok é"]


def test_export_refuses_a_step_it_holds_or_a_foreign_folder(tmp_path):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  out = tmp_path / "export"
  artifacts.write_params(out, {"w": np.zeros(3, np.float32)}, step=4)
  with pytest.raises(config_checks.ConfigError, match=(
      f"^--output={out} already holds step 4; pass --overwrite to replace "
      "it, or another --output.$")):
    artifacts.write_params(out, {"w": np.ones(3, np.float32)}, step=4)
  # A replacing save that fails (a full disk, a kill) leaves the old step.
  save = ckpt_lib.Checkpointer.save

  def full_disk(self, *args, **kwargs):
    raise OSError(28, "No space left on device")
  ckpt_lib.Checkpointer.save = full_disk
  try:
    with pytest.raises(OSError, match="No space left"):
      artifacts.write_params(out, {"w": np.ones(3, np.float32)}, step=4,
                             overwrite=True)
  finally:
    ckpt_lib.Checkpointer.save = save

  def read():
    with ckpt_lib.Checkpointer(out, save_every=0) as ck:
      assert ck.all_steps() == [4]
      return ck.restore(4, {"params": {"w": np.zeros(3, np.float32)}}
                        )[0]["params"]["w"]
  np.testing.assert_array_equal(read(), np.zeros(3))
  artifacts.write_params(out, {"w": np.ones(3, np.float32)}, step=4,
                         overwrite=True)
  np.testing.assert_array_equal(read(), np.ones(3))
  assert sorted(os.listdir(out)) == ["4"]
  # A complete step left in .staging-4 by an export cut short is never the
  # one swapped in: this call's parameters are.
  artifacts.write_params(out / ".staging-4", {"w": np.full(3, 7, np.float32)},
                         step=4)
  artifacts.write_params(out, {"w": np.full(3, 2, np.float32)}, step=4,
                         overwrite=True)
  np.testing.assert_array_equal(read(), np.full(3, 2))
  # A swap cut short after moving the old step aside: the next call puts it
  # back (and refuses to replace it without --overwrite).
  os.rename(out / "4", out / ".replaced-4")
  with pytest.raises(config_checks.ConfigError, match="already holds step 4"):
    artifacts.write_params(out, {"w": np.ones(3, np.float32)}, step=4)
  np.testing.assert_array_equal(read(), np.full(3, 2))
  assert sorted(os.listdir(out)) == ["4"]

  (tmp_path / "home").mkdir()
  for name in ("notes.txt", "data", "a.py", "b.py"):
    (tmp_path / "home" / name).write_text("mine")
  with pytest.raises(config_checks.ConfigError, match=(
      f"^--output={tmp_path / 'home'} is a folder with other files than an "
      r"export's \(a.py, b.py, data, ...\); pass a new or empty folder, or "
      "--overwrite to write into it.$")):
    artifacts.export_params(_config(), str(tmp_path / "no_run"),
                            str(tmp_path / "home"))


def test_export_refuses_a_folder_of_another_models_export(tmp_path):
  """An export's config.json says how its steps load: a run of other shapes
  exporting into it would replace it, and the steps there would no longer
  load. What --mode=evaluate writes into an export does not count as a
  foreign file."""
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  out = tmp_path / "export"
  config = _config()
  run_config.write(config, out)
  (out / "evaluations").mkdir()
  wider = _config()
  wider.model.d_model *= 2
  with pytest.raises(config_checks.ConfigError, match=(
      rf"^--output={out} holds the export of another model \(its "
      rf"{out}/config.json differs in model.d_model\); export into another "
      r"folder, or pass --overwrite to replace its config.$")):
    artifacts._check_export_folder(str(out), False, wider)
  artifacts._check_export_folder(str(out), False, config)   # the same model
  artifacts._check_export_folder(str(out), True, wider)     # --overwrite
  trained_otherwise = _config()   # another optimizer: the same parameters
  trained_otherwise.clip_norm, trained_otherwise.grad_accum_steps = 0.0, 4
  artifacts._check_export_folder(str(out), False, trained_otherwise)


def test_exporting_again_into_a_text_models_export_is_allowed(tmp_path):
  """An export's config.json names its own copy of the vocabulary: the same
  model exported again (another step) passes; another vocabulary does not."""
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  vocab, other = tmp_path / "spm.model", tmp_path / "other.model"
  vocab.write_bytes(b"the pieces")
  other.write_bytes(b"other pieces")
  config = run_config.load_config_file(
      os.path.join(ROOT, "configs", "glue.py") + ":sst2,hypermixer")
  config.data.vocab_path = str(vocab)
  out = tmp_path / "export"
  run_config.write(config, out, vocabulary=True)
  artifacts._check_export_folder(str(out), False, config)
  config.data.vocab_path = str(other)
  with pytest.raises(config_checks.ConfigError,
                     match=r"differs in data.vocab_path\); export into"):
    artifacts._check_export_folder(str(out), False, config)


@pytest.mark.parametrize("read,where", [
    ("run", "run"), ("run", "run/checkpoints"), ("run", "run/checkpoints/4"),
    ("run", "link/checkpoints/"), ("run/checkpoints/4", "run/checkpoints"),
    ("run/checkpoints", "run"), ("run/checkpoints/4/", "run/checkpoints/4"),
    # A run whose checkpoints folder is a link (to another disk).
    ("far", "far/checkpoints"), ("far/checkpoints/5", "far"),
    ("far/checkpoints", "far"), ("far", "disk/ckpts/5")])
def test_export_never_writes_into_the_run_it_reads(tmp_path, read, where):
  """Even with --overwrite: a parameters-only step (and its config) in the
  run's own folder or checkpoints would replace its training state."""
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)
  (tmp_path / "link").symlink_to(tmp_path / "run")
  (tmp_path / "disk" / "ckpts" / "5").mkdir(parents=True)
  (tmp_path / "far").mkdir()
  (tmp_path / "far" / "checkpoints").symlink_to(tmp_path / "disk" / "ckpts")
  out = str(tmp_path / where)
  with pytest.raises(config_checks.ConfigError, match=(
      rf"^--output={out} is the run it exports \(--workdir={tmp_path}/{read}"
      r"\) or its checkpoints; an export there would replace the run's "
      r"training state: pass another folder.$")):
    artifacts.export_params(_config(), f"{tmp_path}/{read}", out,
                            overwrite=True)
