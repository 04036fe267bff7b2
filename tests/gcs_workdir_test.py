"""``gs://`` workdirs, end to end against a local Cloud Storage emulator.

The emulator (``gcp-storage-emulator``, in-memory, on a free port of
127.0.0.1) is reached by every client a run uses:

* ``etils.epath`` through fsspec's ``gcsfs`` (``STORAGE_EMULATOR_HOST``), with
  ``EPATH_USE_TF=false``. TensorFlow's own GCS file system (epath's default
  ``gs://`` backend when TensorFlow is installed) has its endpoint built in
  (``https://www.googleapis.com/storage/v1/``) and no emulator setting, so it
  cannot be tested here; the run's code is the same for both backends (it
  only calls epath), and local workdirs go through epath's third backend;
* TensorStore's ``gcs`` driver, which writes Orbax's arrays
  (``TENSORSTORE_GCS_HTTP_URL``, ``GOOGLE_AUTH_TOKEN_FOR_TESTING``);
* google-cloud-storage, for the workdir lock (``STORAGE_EMULATOR_HOST``).

The emulator ignores GCS preconditions (``ifGenerationMatch``), so the lock's
race (two jobs creating it at once) and its takeover of a stale lock are
tested against a fake bucket that applies them, below.
"""
import datetime
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from hypermixer_jax.data import testing
from hypermixer_jax.train import gcs_lock
from hypermixer_jax.train import storage
from hypermixer_jax.train import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "hm-test"
TINY_TEXT = ["--config.model.num_layers=1", "--config.model.d_model=16",
             "--config.model.d_ffn=32", "--config.model.max_len=16",
             "--config.model.mixer_kwargs.hyper_dim=8",
             "--config.data.seq_len=16", "--config.batch_size=4",
             "--config.eval_batch_size=8", "--config.eval_steps=1",
             "--config.num_train_steps=6", "--config.log_every=1",
             "--config.eval_every=6", "--config.checkpoint_every=2",
             "--config.warmup_steps=0"]


# The emulator's media downloads lack the ``x-goog-generation`` header that
# real GCS sends and TensorStore reads ("Malformed StorageGeneration" when an
# OCDBT manifest is read back); this wrapper adds it, changing nothing else.
EMULATOR = """
import sys
from gcp_storage_emulator.handlers import objects
download = objects.download
def with_generation(request, response, storage, *args, **kwargs):
  download(request, response, storage, *args, **kwargs)
  if int(response.status) in (200, 206):
    obj = storage.get_file_obj(request.params["bucket_name"],
                               request.params["object_id"])
    response["x-goog-generation"] = str(obj["generation"])
objects.download = with_generation
from gcp_storage_emulator import __main__ as emulator
emulator.main(sys.argv[1:])
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def emulator():
  """Environment variables pointing every client at a fresh emulator."""
  for module in ("gcp_storage_emulator", "gcsfs", "google.cloud.storage"):
    if importlib.util.find_spec(module) is None:
      pytest.skip(f"{module} is not installed: pip install -e '.[test]'")
  port = _free_port()
  proc = subprocess.Popen(
      [sys.executable, "-c", EMULATOR, "start",
       "--host=127.0.0.1", f"--port={port}", "--in-memory",
       f"--default-bucket={BUCKET}", "-q"],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f"http://127.0.0.1:{port}"
  env = {"STORAGE_EMULATOR_HOST": url, "EPATH_USE_TF": "false",
         "TENSORSTORE_GCS_HTTP_URL": url,
         "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
         "GOOGLE_CLOUD_PROJECT": "test",
         # gcsfs's bucket-type probe (Storage Control API) has no emulator.
         "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
  deadline = time.time() + 30
  while True:
    try:
      socket.create_connection(("127.0.0.1", port), timeout=1).close()
      break
    except OSError:
      if time.time() > deadline or proc.poll() is not None:
        proc.kill()
        pytest.fail("the GCS emulator did not start")
      time.sleep(0.1)
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  # epath caches its EPATH_USE_TF decision at the first gs:// path of the
  # process; a test that ran before in this process must not fix it.
  from etils.epath import gpath  # pylint: disable=g-import-not-at-top
  getattr(gpath._is_tf_installed, "cache_clear", lambda: None)()  # pylint: disable=protected-access
  try:
    yield env
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=30)


def _objects(prefix: str) -> list[str]:
  from google.cloud import storage as gcs  # pylint: disable=g-import-not-at-top
  return sorted(b.name for b in gcs.Client().list_blobs(BUCKET, prefix=prefix))


def _main(cwd, *flags):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             TF_CPP_MIN_LOG_LEVEL="2", XLA_FLAGS=os.environ["HYPERMIXER_TEST_XLA_FLAGS"])  # one device
  return subprocess.run(
      [sys.executable, "-m", "hypermixer_jax.main", *flags],
      capture_output=True, text=True, env=env, timeout=400, cwd=cwd)


@pytest.mark.slow
def test_train_kill_resume_evaluate_predict_export_on_gcs(emulator, tmp_path):
  """``main.py`` trains (killed with SIGKILL after step 3), is refused while
  the dead job's lock is fresh, resumes; then the functions behind
  ``--mode=evaluate|predict|export`` run here, on ``gs://`` in and out."""
  del emulator
  vocab = testing.tiny_vocab(str(tmp_path / "vocab"))
  train = tmp_path / "train.tsv"
  train.write_text("sentence\tlabel\n" + "".join(
      f"{w} film .\t{i % 2}\n" for i, w in enumerate(
          ["good", "bad", "fine", "dull", "great", "awful"] * 4)))
  run = f"gs://{BUCKET}/runs/sst2"
  config = [f"--config={ROOT}/configs/glue.py:sst2,hypermixer",
            f"--config.data.vocab_path={vocab}",
            f"--config.data.local_files.train={train}",
            f"--config.data.local_files.validation={train}", *TINY_TEXT]
  cwd = tmp_path / "cwd"
  cwd.mkdir()

  killed = _main(cwd, *config, f"--workdir={run}",
                 "--config.debug.kill_at_step=3")
  assert killed.returncode == -9, killed.stderr[-3000:]
  assert f"runs/sst2/.lock" in _objects("runs/sst2/")
  # The killed job's lock is fresh: a new job is refused, and told how to
  # remove it when the holder is known dead.
  with pytest.raises(workdir_lib.WorkdirLocked) as refused:
    workdir_lib.WorkdirLock(run).acquire()
  assert f"gcloud storage rm {run}/.lock" in str(refused.value)
  assert f"{run} is in use by another job (host " in str(refused.value)
  storage.path(f"{run}/.lock").unlink()

  resumed = _main(cwd, *config, f"--workdir={run}")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  records = [json.loads(l) for l in
             storage.path(f"{run}/metrics.jsonl").read_text().splitlines()]
  train_steps = [r["step"] for r in records if r["split"] == "train"]
  assert train_steps == [1, 2, 3, 4, 5, 6]   # step 3 logged once
  configs = sorted(p.name for p in storage.path(f"{run}/configs").iterdir())
  assert [c.split("-step")[1] for c in configs] == ["0.json", "2.json"]

  inputs = f"gs://{BUCKET}/inputs/sentences.txt"
  storage.path(inputs).write_text("good film .\nawful film .\n")
  # --mode=evaluate, predict and export (what main.py calls), here.
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  fv, argv = flags.FlagValues(), ["prog", *config]
  config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  fv(argv)
  artifacts.evaluate_checkpoint(fv.config, run)
  artifacts.predict_file(fv.config, run, inputs,
                         f"gs://{BUCKET}/out/predictions.jsonl")
  artifacts.export_params(fv.config, run, f"gs://{BUCKET}/out/params")
  # Replaced in place on the bucket (written beside, then copied in: an
  # object store renames no folder).
  artifacts.export_params(fv.config, run, f"gs://{BUCKET}/out/params",
                          overwrite=True)
  assert not [o for o in _objects("out/params/")
              if "/.staging-" in o or "/.replaced-" in o]
  # A swap cut short while copying the new step in: the old one aside, the
  # new one in place without its commit marker (copied last). The next
  # export puts the old one back before anything else.
  from hypermixer_jax.train import config_checks  # pylint: disable=g-import-not-at-top
  step6 = [o for o in _objects("out/params/6/")]
  assert "out/params/6/commit_success.txt" in step6
  for o in step6:
    storage.path(f"gs://{BUCKET}/{o}").copy(storage.path(
        f"gs://{BUCKET}/{o.replace('/6/', '/.replaced-6/', 1)}"))
  storage.path(f"gs://{BUCKET}/out/params/6/commit_success.txt").unlink()
  with pytest.raises(config_checks.ConfigError, match="already holds step 6"):
    artifacts.export_params(fv.config, run, f"gs://{BUCKET}/out/params")
  assert sorted(_objects("out/params/6/")) == step6
  assert not [o for o in _objects("out/params/") if "/.replaced-" in o]
  saved = json.loads(storage.path(
      f"{run}/evaluations/validation_step6.json").read_text())
  logged = [r for r in records if r["split"] == "eval" and r["step"] == 6]
  np.testing.assert_allclose(saved["accuracy"], logged[0]["accuracy"])
  lines = storage.path(f"gs://{BUCKET}/out/predictions.jsonl").read_text(
      ).splitlines()
  assert [json.loads(l)["sentence"] for l in lines] == ["good film .",
                                                        "awful film ."]

  objects = _objects("")
  for expected in ("runs/sst2/metrics.jsonl", "runs/sst2/config.json",
                   "runs/sst2/checkpoints/6/state/_METADATA",
                   "runs/sst2/checkpoints/6/data/process_0-of-1.json",
                   "out/params/6/state/_METADATA"):
    assert expected in objects, objects
  assert any(o.startswith("runs/sst2/tensorboard/events.out.tfevents.")
             for o in objects)
  assert "runs/sst2/.lock" not in objects   # released at the end
  # TensorBoard's events went to the bucket, one train/loss per step.
  events = []
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  for name in objects:
    if "/tensorboard/events" in name:
      records_, damaged = storage.read_records(f"gs://{BUCKET}/{name}")
      assert not damaged
      for r in records_:
        e = event_pb2.Event.FromString(r)
        events += [e.step for v in e.summary.value if v.tag == "train/loss"]
  assert sorted(events) == [1, 2, 3, 4, 5, 6]
  # Nothing was written to a local folder named after the URL.
  for root in (cwd, ROOT):
    assert not os.path.exists(os.path.join(root, "gs:")), root


def test_metrics_file_appends_on_gcs(emulator):
  del emulator
  path = f"gs://{BUCKET}/append/metrics.jsonl"
  f = storage.AppendFile(path)
  f.write("a\n")
  f.flush()
  f.close()
  g = storage.AppendFile(path)   # a resumed run keeps what was there
  g.write("b\n")
  assert storage.path(path).read_text() == "a\n"   # not flushed yet
  g.close()
  assert storage.path(path).read_text() == "a\nb\n"


def test_profile_and_png_reach_the_bucket(emulator):
  del emulator
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import profiling  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import pseudo_attention  # pylint: disable=g-import-not-at-top
  run = f"gs://{BUCKET}/profiled"
  prof = profiling.StepProfiler(run, start_step=0, num_steps=1)
  with prof.step(0):
    prof.keep(jnp.arange(7.0).sum())
  prof.close()
  files = profiling.trace_files(f"{run}/profile")
  assert any(f.endswith(".xplane.pb") for f in files), files
  assert all(f.startswith(f"{run}/profile/plugins/profile/") for f in files)
  png = f"{run}/map.png"
  pseudo_attention.save_png({"m": np.eye(5)}, png)
  assert storage.path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lock_object_on_the_emulator(emulator):
  del emulator
  lock = workdir_lib.WorkdirLock(f"gs://{BUCKET}/locked").acquire()
  text = storage.path(f"gs://{BUCKET}/locked/.lock").read_text()
  assert json.loads(text)["pid"] == os.getpid()
  with pytest.raises(workdir_lib.WorkdirLocked,
                     match=f"PID {os.getpid()}, running since"):
    workdir_lib.WorkdirLock(f"gs://{BUCKET}/locked").acquire()
  lock.release()
  assert not storage.path(f"gs://{BUCKET}/locked/.lock").exists()
  with workdir_lib.WorkdirLock(f"gs://{BUCKET}/locked"):
    assert storage.path(f"gs://{BUCKET}/locked/.lock").exists()


# ---------------------------------------------------------------------------
# The lock's preconditions, on a fake bucket that applies them as GCS does.
# ---------------------------------------------------------------------------
class _FakeBlob:

  def __init__(self, bucket, name):
    self._bucket, self.name = bucket, name
    self.generation = self.updated = None

  def upload_from_string(self, data, if_generation_match=None):
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    with self._bucket.mutex:
      current = self._bucket.objects.get(self.name)
      gen = current[1] if current else 0
      if if_generation_match is not None and if_generation_match != gen:
        raise exceptions.PreconditionFailed("generation mismatch")
      self._bucket.counter += 1
      self.generation, self.updated = self._bucket.counter, self._bucket.now()
      self._bucket.objects[self.name] = (data, self.generation, self.updated)

  def download_as_text(self):
    return self._bucket.objects[self.name][0]

  def delete(self, if_generation_match=None):
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    with self._bucket.mutex:
      current = self._bucket.objects.get(self.name)
      if current is None:
        raise exceptions.NotFound("no object")
      if if_generation_match not in (None, current[1]):
        raise exceptions.PreconditionFailed("generation mismatch")
      del self._bucket.objects[self.name]


class _FakeBucket:

  def __init__(self):
    import threading  # pylint: disable=g-import-not-at-top
    self.mutex = threading.Lock()
    self.objects, self.counter = {}, 0
    self.clock = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)

  def now(self):
    return self.clock

  def blob(self, name):
    return _FakeBlob(self, name)

  def get_blob(self, name):
    if name not in self.objects:
      return None
    b = _FakeBlob(self, name)
    _, b.generation, b.updated = self.objects[name]
    return b


def _lock(bucket, who, **kw):
  return gcs_lock.GcsLock("gs://b/run/.lock", who, bucket=bucket,
                          now=bucket.now, locked_error=workdir_lib.WorkdirLocked,
                          heartbeat_s=3600, **kw)


def test_lock_race_between_read_and_create_has_one_winner():
  pytest.importorskip("google.api_core")
  bucket = _FakeBucket()
  loser = _lock(bucket, "second")
  real_get = bucket.get_blob
  # The other job creates the lock after this one looked and found none.
  def get_then_lose(name):
    seen = real_get(name)
    if seen is None:
      bucket.blob(name).upload_from_string("first", if_generation_match=0)
    return seen
  bucket.get_blob = get_then_lose
  with pytest.raises(workdir_lib.WorkdirLocked, match=r"\(first; its lock"):
    loser.acquire()
  assert bucket.objects["run/.lock"][0] == "first"


def test_stale_lock_taken_over_fresh_one_refused():
  pytest.importorskip("google.api_core")
  bucket = _FakeBucket()
  dead = _lock(bucket, "dead", stale_s=300).acquire()
  dead._stop.set()            # pylint: disable=protected-access
  bucket.clock += datetime.timedelta(seconds=299)
  with pytest.raises(workdir_lib.WorkdirLocked, match="renewed 299 s ago"):
    _lock(bucket, "new", stale_s=300).acquire()
  bucket.clock += datetime.timedelta(seconds=2)
  new = _lock(bucket, "new", stale_s=300).acquire()
  assert bucket.objects["run/.lock"][0] == "new"
  dead.release()              # the old holder cannot delete the new lock
  assert bucket.objects["run/.lock"][0] == "new"
  new.release()
  assert "run/.lock" not in bucket.objects


def test_heartbeat_renews_the_lock():
  pytest.importorskip("google.api_core")
  bucket = _FakeBucket()
  lock = gcs_lock.GcsLock("gs://b/run/.lock", "me", bucket=bucket,
                          now=bucket.now, heartbeat_s=0.01)
  lock.acquire()
  first = lock.generation
  deadline = time.time() + 10
  while lock.generation == first and time.time() < deadline:
    time.sleep(0.01)
  assert lock.generation > first
  lock.release()
  assert not bucket.objects


def test_records_read_back_as_tensorflow_reads_them(tmp_path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  records = [b"", b"x" * 5, bytes(range(256)) * 3]
  path = tmp_path / "r.tfrecord"
  with tf.io.TFRecordWriter(str(path)) as w:
    for r in records:
      w.write(r)
  assert path.read_bytes() == storage.encode_records(records)
  assert storage.read_records(path) == (records, False)
  path.write_bytes(path.read_bytes()[:-3])   # cut short by a kill
  assert storage.read_records(path) == (records[:2], True)


def test_replace_writes_utf8_whole_or_not_at_all(tmp_path, monkeypatch):
  target = tmp_path / "out.jsonl"
  storage.replace(target, "é ✓\n")
  assert target.read_bytes() == "é ✓\n".encode("utf-8")
  # A rename that fails (e.g. the disk went read-only) leaves the old file
  # and no temporary file behind.
  def failing_rename(src, dst):
    raise OSError(30, f"Read-only file system: {src} -> {dst}")
  monkeypatch.setattr(storage.os, "replace", failing_rename)
  with pytest.raises(OSError, match="Read-only"):
    storage.replace(target, "new")
  monkeypatch.undo()
  assert target.read_bytes() == "é ✓\n".encode("utf-8")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
