"""A run's saved config as the base of later commands, and the one-line
errors of the ``--config`` flags."""
import hashlib
import importlib.util
import json
import os

import ml_collections
import pytest

from hypermixer_jax.train import config_checks
from hypermixer_jax.train import run_config
from hypermixer_jax.train import workdir as workdir_lib

import flag_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, arg=""):
  spec = importlib.util.spec_from_file_location(
      f"cfg_{name}", os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _tiny_glue(vocab_path):
  config = _load("glue", "sst2,hypermixer")
  config.model.update(num_layers=1, d_model=16, d_ffn=32, max_len=24)
  config.model.mixer_kwargs.hyper_dim = 8
  config.data.update(seq_len=24, vocab_path=vocab_path)
  config.eval_steps = 7
  return config


@pytest.fixture
def saved(tmp_path, shared_data):
  """A workdir whose run saved its (tiny SST-2) config."""
  config = _tiny_glue(str(shared_data / "t5_spm" / "sentencepiece.model"))
  workdir_lib.save_config(config, str(tmp_path / "run"), 0)
  return config, tmp_path / "run"


def test_saved_config_round_trips_with_its_types(saved):
  config, workdir = saved
  path = run_config.find(workdir)
  assert path == workdir / "config.json"
  # A checkpoints folder or a step folder finds its run's config too.
  (workdir / "checkpoints" / "8").mkdir(parents=True)
  assert run_config.find(workdir / "checkpoints") == path
  assert run_config.find(workdir / "checkpoints" / "8") == path
  resolved = run_config.resolve(path, {})
  assert resolved.to_dict() == config.to_dict()     # tuples are tuples again
  assert resolved.model.conv_stem == config.model.conv_stem == ()
  # An unset path saved as null can still be overridden from the command line.
  assert config.data.local_files.test is None
  again = run_config.resolve(path, {"data.local_files.test": "t.tsv"})
  assert again.data.local_files.test == "t.tsv"


def test_overrides_apply_and_are_logged(saved, caplog):
  config, workdir = saved
  caplog.set_level("INFO")
  out = run_config.resolve(workdir / "config.json",
                           {"eval_steps": 3, "model.dropout_rate": 0.25})
  assert (out.eval_steps, out.model.dropout_rate) == (3, 0.25)
  assert out.model.d_model == 16 and out.is_locked
  [line] = [r.getMessage() for r in caplog.records
            if "overrides" in r.getMessage()]
  assert line.endswith("eval_steps: 7 -> 3; model.dropout_rate: "
                       f"{config.model.dropout_rate!r} -> 0.25")


def test_shape_and_vocabulary_changes_are_refused_by_name(saved):
  _, workdir = saved
  path = workdir / "config.json"
  with pytest.raises(config_checks.ConfigError) as e:
    run_config.resolve(path, {"model.d_model": 32, "eval_steps": 3,
                              "model.dropout_rate": 0.5})
  assert str(e.value) == (
      f"--config.model.d_model would change the shapes, dtypes or vocabulary "
      f"of the parameters, or the optimizer state's layout or accumulation, "
      f"saved with "
      f"{workdir} (see its config.json); drop the override(s), or train a "
      "new run in another --workdir.")
  with pytest.raises(config_checks.ConfigError,
                     match=r"^--config.data.vocab_path, "
                     r"--config.model.num_layers would change"):
    run_config.resolve(path, {"data.vocab_path": "other.model",
                              "model.num_layers": 2})


def test_dtype_and_optimizer_layout_changes_are_refused_by_name(saved):
  # A restore would cast the parameters to another param_dtype silently,
  # and another optimizer layout (a clipping stage, an accumulator) makes
  # every intact step fail to restore, as if damaged.
  config, workdir = saved
  path = workdir / "config.json"
  assert config.model.param_dtype == "float32" and config.clip_norm > 0
  for override, field in (({"model.param_dtype": "bfloat16"},
                           "model.param_dtype"),
                          ({"clip_norm": 0.0}, "clip_norm"),
                          ({"grad_accum_steps": 4}, "grad_accum_steps")):
    with pytest.raises(config_checks.ConfigError,
                       match=rf"^--config.{field} would change the shapes, "
                       "dtypes"):
      run_config.resolve(path, dict(override, eval_steps=3))
  # What keeps the layout passes: another clip norm, other Adam betas, the
  # compute dtype.
  out = run_config.resolve(path, {"clip_norm": 2 * config.clip_norm,
                                  "b2": 0.98, "model.dtype": "bfloat16"})
  assert out.clip_norm == 2 * config.clip_norm


def test_the_layout_fields_are_the_ones_that_change_the_optimizer_state(
    saved):
  # OPTIMIZER_LAYOUT against optax itself: the optimizer state's tree
  # changes exactly where the layout does.
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import optim  # pylint: disable=g-import-not-at-top
  config, _ = saved
  params = {"dense": {"kernel": jnp.zeros((2, 3)), "bias": jnp.zeros(3)}}

  def tree(**fields):
    c = config.copy_and_resolve_references()
    c.update(fields)
    tx, _ = optim.make_optimizer(c, params)
    return jax.tree_util.tree_structure(jax.eval_shape(tx.init, params))
  base = tree()
  for fields in ({"clip_norm": 0.0}, {"grad_accum_steps": 2}):
    assert tree(**fields) != base, fields
  for fields in ({"clip_norm": 3.0}, {"grad_accum_steps": 1},
                 {"b1": 0.8, "weight_decay": 0.0, "learning_rate": 1.0}):
    assert tree(**fields) == base, fields
  assert set(run_config.OPTIMIZER_LAYOUT) == {"clip_norm", "grad_accum_steps"}


def test_layer_layout_and_remat_may_change_but_not_the_layer_count(saved):
  # Checkpoints load across the scanned and unrolled stacks, and remat
  # changes no parameter: a saved run may be evaluated either way.
  _, workdir = saved
  path = workdir / "config.json"
  config = run_config.resolve(path, {"model.scan_layers": True,
                                     "model.remat": "full"})
  assert config.model.scan_layers and config.model.remat == "full"
  with pytest.raises(config_checks.ConfigError,
                     match=r"^--config.model.num_layers would change"):
    run_config.resolve(path, {"model.scan_layers": True,
                              "model.num_layers": 2})


def test_a_given_config_file_fills_in_a_partial_saved_config(tmp_path):
  """A converted checkpoint records its model and input scaling only: the
  --config file gives the rest, the saved fields win (model whole)."""
  given = _load("imagenet", "mixer_b16")
  partial = {"model": {**given.model.to_dict(), "num_layers": 2,
                       "approximate_gelu": True},
             "data": {"image_normalization": "inception"}}
  run_config.write(partial, tmp_path)
  path = tmp_path / "config.json"
  with pytest.raises(config_checks.ConfigError,
                     match="records only part of a config \\(a converted "
                     "checkpoint's model\\); pass --config=FILE for the rest"):
    run_config.resolve(path, {})
  out = run_config.resolve(path, {"batch_size": 8}, given=given)
  assert (out.model.num_layers, out.model.approximate_gelu,
          out.data.image_normalization, out.batch_size) == (
              2, True, "inception", 8)
  assert out.data.task == given.data.task == "imagenet_patches"


def test_a_config_of_another_run_is_refused_not_merged(saved):
  """--config of another job (task, model kind) with a folder holding a
  run: the saved config would replace its fields and resume that run, the
  given config's own fields (its evaluators) merged in; refused, naming
  what differs."""
  config, workdir = saved
  path = workdir / "config.json"
  # The same job (its own --config, other settings) resumes.
  same = ml_collections.ConfigDict(config.to_dict())
  same.eval_steps = 3
  assert run_config.resolve(path, {}, given=same).model.d_model == 16
  other = _load("default", "hypermixer")          # the synthetic task
  with pytest.raises(run_config.ConfigFlagError, match=(
      f"^--workdir={workdir} holds another run than --config \(data.task: "
      "'glue_sst2' there, 'synthetic_pairs' in --config; model.family: "
      "'text' there, 'continuous' in --config; model.head: 'classify' "
      "there, 'regression' in --config\): resume it with --workdir alone")):
    run_config.resolve(path, {}, given=other)
  # The same job at other shapes (a fine-tune's adopted from its
  # init_checkpoint, an override the first command had): the saved win.
  wider = ml_collections.ConfigDict(config.to_dict())
  wider.model.d_model = 32
  assert run_config.resolve(path, {}, given=wider).model.d_model == 16
  mixer = ml_collections.ConfigDict(config.to_dict())  # another model
  mixer.model.mixer = "attention"
  with pytest.raises(run_config.ConfigFlagError,
                     match="model.mixer: 'hypermixer' there, 'attention'"):
    run_config.resolve(path, {}, given=mixer)


def test_export_folder_carries_its_vocabulary(saved, tmp_path):
  config, _ = saved
  run_config.write(config, tmp_path / "export", vocabulary=True)
  original = config.data.vocab_path
  copy = tmp_path / "export" / "vocab" / "sentencepiece.model"
  record = json.loads((tmp_path / "export" / "vocabulary.json").read_text())
  with open(original, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  assert record == {"path": original, "extra_ids": 100,
                    "file": "vocab/sentencepiece.model", "sha256": digest}
  assert hashlib.sha256(copy.read_bytes()).hexdigest() == digest
  # Read back from anywhere: the copy is the vocabulary, not the original.
  moved = tmp_path / "moved"
  (tmp_path / "export").rename(moved)
  loaded = run_config.get_config(str(moved))
  assert loaded.data.vocab_path == str(moved / "vocab" /
                                       "sentencepiece.model")
  assert run_config.resolve(moved / "config.json", {}).data.vocab_path == (
      loaded.data.vocab_path)
  # Without its copy, an export falls back to the original path only while
  # that is still the same file.
  original_copy = tmp_path / "spm.model"
  original_copy.write_bytes(
      (moved / "vocab" / "sentencepiece.model").read_bytes())
  config.data.vocab_path = str(original_copy)
  run_config.write(config, tmp_path / "e2", vocabulary=True)
  (tmp_path / "e2" / "vocab" / "spm.model").unlink()
  assert run_config.get_config(str(tmp_path / "e2")).data.vocab_path == str(
      original_copy)
  original_copy.write_bytes(b"another vocabulary")
  with pytest.raises(config_checks.ConfigError,
                     match=f"^{original_copy} is not the vocabulary the "
                     "parameters of .*e2 were trained with"):
    run_config.get_config(str(tmp_path / "e2"))


def test_missing_config_file_lists_the_configs(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)   # no configs/ here: the package's are listed
  with pytest.raises(config_checks.ConfigError) as e:
    run_config.check_config_file("configs/defualt.py:x",
                                 os.path.join(ROOT, "configs"))
  names = sorted(f for f in os.listdir(os.path.join(ROOT, "configs"))
                 if f.endswith(".py"))
  assert str(e.value) == (
      f"--config=configs/defualt.py:x: no config file 'configs/defualt.py'. "
      f"Did you mean {os.path.join(ROOT, 'configs', 'default.py')}? The "
      f"configs in {os.path.join(ROOT, 'configs')}: {', '.join(names)}.")
  run_config.check_config_file(os.path.join(ROOT, "configs", "glue.py:sst2"),
                               str(tmp_path))   # exists: no error
  # Beside a folder of configs, that folder is listed.
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "sst2_small.py").write_text("")
  with pytest.raises(config_checks.ConfigError) as e:
    run_config.check_config_file("mine/sst2_smal.py", "elsewhere")
  assert str(e.value) == (
      "--config=mine/sst2_smal.py: no config file 'mine/sst2_smal.py'. Did "
      "you mean mine/sst2_small.py? The configs in mine: sst2_small.py.")


def test_unknown_fields_name_the_closest():
  config = _load("default")
  argv = ["prog", "--config=x", "--config.num_train_steps=3"]
  assert run_config.unknown_fields(config, argv) is None
  assert run_config.unknown_fields(
      config, argv + ["--config.num_train_step=3"]) == (
          "--config.num_train_step: the config has no field "
          "'num_train_step'; did you mean --config.num_train_steps?")
  assert run_config.unknown_fields(config, ["--config.model.d_mdl=3"]) == (
      "--config.model.d_mdl: the config has no field 'model.d_mdl'; did you "
      "mean --config.model.d_model?")
  # A field at the wrong depth finds its nested name, not its misspelt
  # parent's other children.
  assert run_config.unknown_fields(config, ["--config.model.hyperdim=10"]) == (
      "--config.model.hyperdim: the config has no field 'model.hyperdim'; "
      "did you mean --config.model.mixer_kwargs.hyper_dim?")
  assert run_config.unknown_fields(config, ["--config.seqlen=8"]) == (
      "--config.seqlen: the config has no field 'seqlen'; did you mean "
      "--config.data.seq_len or --config.data.synthetic.seq_len?")
  # An option of the configured mixer that the config leaves unset: the
  # line says why it is refused and how to set it; a misspelt one is named.
  line = run_config.unknown_fields(
      config, ["--config.model.mixer_kwargs.hyper_dim=8",
               "--config.model.mixer_kwargs.tied=false"])
  assert line.startswith(
      "--config.model.mixer_kwargs.tied: 'tied' is an option of mixer "
      "'hypermixer' (HyperMixing) that this config leaves at its default")
  assert "set c.model.mixer_kwargs.tied in a config file" in line
  assert run_config.unknown_fields(
      config, ["--config.model.mixer_kwargs.tide=false"]) == (
          "--config.model.mixer_kwargs.tide: mixer 'hypermixer' "
          "(HyperMixing) has no option 'tide'; did you mean 'tied'?")
  line = run_config.unknown_fields(config, ["--config.mesh.zzz=1"])
  assert line == ("--config.mesh.zzz: the config has no field 'mesh.zzz'; "
                  "config.mesh has data, expert, fsdp, tensor")


def test_config_file_errors_lead_with_the_cause():
  spec = os.path.join(ROOT, "configs", "glue.py") + ":sst-2,hypermixer"
  # What config_flags raises: the config's own message after a traceback.
  message = ("flag --config=x: Error whilst parsing config file: Traceback "
             "(most recent call last):\n  File ...\nValueError: ...")
  line = run_config.flag_error(message, spec)
  assert line == (f"--config={spec}: unknown GLUE task 'sst-2'; tasks: "
                  "['mnli', 'qnli', 'qqp', 'snli', 'sst2']")
  # Other flag errors keep absl's words, on one line.
  assert run_config.flag_error("Unknown command line flag\n 'bogus'", spec) \
      == "Unknown command line flag 'bogus' (--help lists the flags)"


def test_doubts_warn_about_warmup_and_silent_runs():
  config = _load("glue", "sst2,hypermixer")
  config.update(num_train_steps=20, log_every=100, warmup_steps=1000)
  assert config_checks.doubts(config) == [
      "warmup_steps=1000 > the run's 20 optimiser updates: the learning rate "
      "only reaches 1.9e-06, not learning_rate=0.0001. Set "
      "--config.warmup_steps=2 (or fewer).",
      "log_every=100 > num_train_steps=20: the only train log line comes at "
      "the end. Set --config.log_every=2 to see progress."]
  config.update(warmup_steps=2, log_every=5)
  assert config_checks.doubts(config) == []
  config.data.image_normalization = "imagenet21k"
  assert config_checks.problems(config) == [
      "data.image_normalization='imagenet21k': must be 'imagenet' or "
      "'inception'"]


def test_tfds_fields_beside_local_files_are_named():
  """Local files serve every split and are read whole: a TFDS split
  expression beside them (a low-resource subset) is refused, a data_dir
  warned about; either alone passes."""
  config = _load("glue", "sst2,hypermixer")
  config.data.tfds_train_split = "train[:10%]"
  assert config_checks.problems(config) == []          # TFDS: it applies
  config.data.local_files.train = "/data/train.tsv"
  assert config_checks.problems(config) == [
      "data.tfds_train_split='train[:10%]' selects part of a TFDS split, but "
      "data.local_files.train is set: local files are read whole, for every "
      "split; drop data.tfds_train_split, or cut the file itself"]
  config.data.tfds_train_split = ""
  config.data.data_dir = "/tfds"
  assert config_checks.problems(config) == []
  assert [d for d in config_checks.doubts(config) if "data_dir" in d] == [
      "data.data_dir='/tfds' is not read: data.local_files.train is set, and "
      "local files serve every split. Drop one of the two."]


def test_init_checkpoint_of_another_family_is_named(tmp_path):
  pre = _load("default")   # a continuous-family model
  run_config.write(pre, tmp_path / "synthetic")
  fine = _load("glue", "sst2,hypermixer,finetune")
  # A path that does not exist stops before anything is built; one without
  # a saved config has nothing to compare: unchanged.
  fine.init_checkpoint = str(tmp_path / "none")
  with pytest.raises(config_checks.ConfigError, match=(
      rf"^init_checkpoint {tmp_path / 'none'}: no such folder; pass a trained "
      "run's workdir")):
    run_config.adopt_init_checkpoint(fine)
  (tmp_path / "none").mkdir()
  assert run_config.adopt_init_checkpoint(fine) is fine
  fine.init_checkpoint = str(tmp_path / "synthetic")
  with pytest.raises(config_checks.ConfigError) as e:
    run_config.adopt_init_checkpoint(fine)
  assert str(e.value) == (
      f"init_checkpoint {tmp_path / 'synthetic'} holds a "
      "model.family='continuous' model, this run builds 'text'; fine-tune it "
      "with a config of its family, or drop --config.init_checkpoint.")
  # Another mixer of the family: its fields (e.g. MLP-Mixer's token_mlp_dim)
  # do not build the checkpoint's mixer; one line naming the config to use.
  run_config.write(_load("glue", "sst2,hypermixer"), tmp_path / "hyper")
  for mixer in ("mlp_mixer", "attention"):
    other = _load("glue", f"sst2,{mixer},finetune")
    other.init_checkpoint = str(tmp_path / "hyper")
    with pytest.raises(config_checks.ConfigError) as e:
      run_config.adopt_init_checkpoint(other)
    assert str(e.value) == (
        f"init_checkpoint {tmp_path / 'hyper'} holds a model.mixer="
        f"'hypermixer' model, this run builds {mixer!r}; fine-tune it with "
        "a config of its mixer (e.g. --config=configs/glue.py:sst2,"
        "hypermixer,finetune), or drop --config.init_checkpoint.")


def test_accumulation_resumes_only_with_its_own_k_and_state(tmp_path):
  """Another grad_accum_steps > 1 is refused (the accumulator's count and
  the schedule's horizon would disagree), and so is a step saved with
  optax.MultiSteps' accumulator by an earlier version."""
  config = run_config.load_config_file(flag_configs.DEFAULT)
  config.grad_accum_steps, config.num_train_steps = 2, 8
  workdir = tmp_path / "run"
  workdir_lib.save_config(config, str(workdir), 0)
  meta = workdir / "checkpoints" / "4" / "state" / "_METADATA"
  meta.parent.mkdir(parents=True)
  meta.write_text('{"tree_metadata": {"(\'opt_state\', \'acc_grads\')": {}}}')
  run_config.check_fits_checkpoints(config, workdir)   # the same: resumes
  run_config.check_accumulator(config, workdir)
  other = config.copy_and_resolve_references()
  other.grad_accum_steps = 4
  with pytest.raises(config_checks.ConfigError, match=r"grad_accum_steps: 2 "
                     r"-> 4"):
    run_config.check_fits_checkpoints(other, workdir)
  # (Orbax's metadata names each leaf by its key path.)
  meta.write_text('{"tree_metadata": {"(\'opt_state\', \'gradient_step\')":'
                  ' {}}}')
  run_config.check_fits_checkpoints(config, workdir)   # its params load
  with pytest.raises(config_checks.ConfigError, match=(
      r"checkpoints/4 holds optax.MultiSteps' accumulator \(saved by an "
      r"earlier version")):
    run_config.check_accumulator(config, workdir)      # training refuses


def test_fine_tuning_with_another_vocabulary_is_refused(tmp_path, caplog):
  """Token ids of another SentencePiece file (or other extra ids) name other
  pieces: fine-tuning from a checkpoint trained with another vocabulary
  stops in one line; the same file's content elsewhere passes."""
  a, b, copy = (tmp_path / n for n in ("a.model", "b.model", "copy.model"))
  a.write_bytes(b"pieces of A")
  b.write_bytes(b"pieces of B")
  copy.write_bytes(b"pieces of A")
  config = run_config.load_config_file(
      os.path.join(ROOT, "configs", "glue.py") + ":sst2,hypermixer")
  config.data.vocab_path = str(a)
  workdir_lib.save_config(config, str(tmp_path / "pre"), 0)
  tune = config.copy_and_resolve_references()
  tune.init_checkpoint = str(tmp_path / "pre")
  tune.data.vocab_path = str(copy)
  run_config.check_init_vocabulary(tune)
  for field, value in (("vocab_path", str(b)), ("extra_ids", 101)):
    other = tune.copy_and_resolve_references()
    other.data[field] = value
    with pytest.raises(config_checks.ConfigError, match=(
        rf"^init_checkpoint {tmp_path}/pre was trained with the vocabulary "
        rf"{a} \(data.extra_ids=100\), this run reads .* whose ids name other "
        rf"pieces: pass --config.data.vocab_path={a} "
        r"--config.data.extra_ids=100.$")):
      run_config.check_init_vocabulary(other)
  # A saved vocabulary that cannot be read here is not compared: said so.
  gone = tune.copy_and_resolve_references()
  gone.init_checkpoint = str(tmp_path / "pre_moved")
  workdir_lib.save_config(config, gone.init_checkpoint, 0)
  a.rename(tmp_path / "a_moved.model")
  caplog.set_level("WARNING")
  run_config.check_init_vocabulary(gone)
  assert any(f"vocabulary {a}, this run reads {copy}; {a} cannot be read "
             "here, so the two are not compared" in r.getMessage()
             for r in caplog.records)


def test_fine_tuning_reads_the_checkpoints_vocabulary_unless_given(
    tmp_path, caplog):
  """A fine-tuning config left at its file's vocabulary (the public T5 one
  on gs://) reads init_checkpoint's (an export's own copy included), with
  its extra ids; one given on the command line, or a saved one that cannot
  be read here, is kept."""
  vocab = tmp_path / "export" / "vocab" / "spm.model"
  vocab.parent.mkdir(parents=True)
  vocab.write_bytes(b"the pieces")
  pre = _load("glue", "sst2,hypermixer")
  pre.data.vocab_path, pre.data.extra_ids = str(vocab), 0
  run_config.write(pre, tmp_path / "export")
  tune = _load("glue", "sst2,hypermixer,finetune")
  tune.init_checkpoint = str(tmp_path / "export")
  default = tune.data.vocab_path
  caplog.set_level("INFO")
  got = run_config.adopt_init_vocabulary(tune)
  assert (got.data.vocab_path, got.data.extra_ids) == (str(vocab), 0)
  assert tune.data.vocab_path == default          # the input is not changed
  assert any(f"data.vocab_path: {default!r} -> {str(vocab)!r}; "
             "data.extra_ids: 100 -> 0" in r.getMessage()
             for r in caplog.records)
  run_config.check_init_vocabulary(got)           # and it then passes
  kept = run_config.adopt_init_vocabulary(
      tune, explicit={"data.vocab_path": default})
  assert kept.data.vocab_path == default
  vocab.unlink()
  assert run_config.adopt_init_vocabulary(tune).data.vocab_path == default


def test_relative_paths_are_made_absolute_as_given(tmp_path, monkeypatch):
  """Relative local paths of the path fields become absolute (from the
  current folder), each of a comma-separated list; URLs, absolute paths,
  empty fields and other fields stay as they are."""
  monkeypatch.chdir(tmp_path)
  config = _load("glue", "sst2,hypermixer")
  config.data.vocab_path = "vocab/sp.model"
  config.data.local_files.train = "a.tsv, gs://bucket/b.tsv, /abs/c.tsv"
  config.init_checkpoint = "../pre"
  config.data.data_dir = "/sweep/d=256,L=6"     # a comma in one folder's name
  config.model.name = "relative_looking_but_not_a_path"
  run_config.absolute_paths(config)
  assert config.data.vocab_path == str(tmp_path / "vocab/sp.model")
  assert config.data.local_files.train == (
      f"{tmp_path / 'a.tsv'},gs://bucket/b.tsv,/abs/c.tsv")
  assert config.init_checkpoint == str(tmp_path.parent / "pre")
  assert config.model.name == "relative_looking_but_not_a_path"
  assert config.data.data_dir == "/sweep/d=256,L=6"
  assert not config.data.local_files.test
  config.data.local_files.test = "a.tsv, ~/b.tsv"
  with pytest.raises(config_checks.ConfigError, match=(
      r"^--config.data.local_files.test=a.tsv, ~/b.tsv: the shell does not "
      r"expand '~' after '='")):
    run_config.absolute_paths(config)


def test_an_override_equal_to_the_saved_relative_path_is_kept(tmp_path,
                                                               monkeypatch):
  """On a run saved with relative paths (older runs), an override that
  repeats the saved value keeps it (the run reads what it read); another
  relative path becomes absolute."""
  config = _load("glue", "sst2,hypermixer")
  config.data.local_files.validation = "dev.tsv"
  workdir_lib.save_config(config, str(tmp_path / "run"), 0)
  monkeypatch.chdir(tmp_path)
  saved = run_config.find(tmp_path / "run")
  got = run_config.absolute_overrides(
      {"data.local_files.validation": "dev.tsv", "data.local_files.test":
       "test.tsv", "learning_rate": 0.5}, saved)
  assert got == {"data.local_files.validation": "dev.tsv",
                 "data.local_files.test": str(tmp_path / "test.tsv"),
                 "learning_rate": 0.5}
