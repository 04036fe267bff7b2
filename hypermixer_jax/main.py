r"""Trains, evaluates, predicts or exports; the logic lives in ``hypermixer_jax.train``.

    python -m hypermixer_jax.main --config=configs/default.py --workdir=/tmp/hm
    hypermixer-train --config=configs/glue.py:sst2,hypermixer \
        --config.learning_rate=1e-4 --workdir=/tmp/sst2
    # without training: evaluate the latest (or --step) checkpoint, predict
    # on a file (JSONL out), export the parameters with config and vocabulary;
    # these read the run's own config (WORKDIR/config.json):
    hypermixer-train --mode=evaluate --workdir=/tmp/sst2
    hypermixer-train --mode=predict --workdir=/tmp/sst2 \
        --input=sentences.txt --output=predictions.jsonl
    hypermixer-train --mode=export --workdir=/tmp/sst2 --output=/tmp/sst2_params
    hypermixer-train --mode=evaluate --workdir=/tmp/sst2_params
    # every checkpoint step read and checked against its fingerprints
    hypermixer-train --mode=verify --workdir=/tmp/sst2
    # compile for a TPU topology without owning it (no --workdir; needs
    # the [tpu] extra): per-chip memory, FLOPs, collectives, estimated MFU
    hypermixer-train --mode=compile --config=configs/c4_mlm.py:hypermixer \
        --topology=v5e:16x16 [--num_slices=2]

The config is locked: ``--config.some_field=value`` must name an existing
field. A run restarted with the same ``--workdir`` resumes from its latest
checkpoint and its saved config. On a workdir (or an exported folder) with a
saved config, ``--config=FILE`` is optional: ``--config.field=value``
overrides go on top of the saved config (the differences are logged), and
one that changes the parameters' shapes, dtypes or vocabulary, or the
optimizer state's layout (clipping on or off, gradient accumulation), is
refused.

Several processes (hosts): on Cloud TPU pod slices and under SLURM ``srun``
``jax.distributed.initialize()`` finds the other processes by itself; anywhere
else pass ``--coordinator_address=HOST:PORT --num_processes=N
--process_id=I`` to every process (see ``hypermixer_jax.runtime``).
"""
import os
import sys

# Before anything imports TensorFlow: its C++ start-up lines stay quiet.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402


def _train(config) -> None:
  from hypermixer_jax.train import loop  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  if not run_config.has_checkpoint(FLAGS.workdir):   # else it resumes
    explicit = config_flags.get_override_values(FLAGS["config"])
    config = run_config.adopt_init_checkpoint(config, explicit=explicit)
    config = run_config.adopt_init_vocabulary(config, explicit=explicit)
  loop.train_and_evaluate(config, FLAGS.workdir)


def _evaluate(config) -> None:
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  steps = FLAGS.eval_steps
  if "eval_steps" in config_flags.get_override_values(FLAGS["config"]):
    # --config.eval_steps, the field training's evaluations take, counts
    # here too; with --eval_steps as well, the two must agree.
    if FLAGS["eval_steps"].present and steps != config.eval_steps:
      raise run_config.ConfigFlagError(
          f"--eval_steps={steps} and --config.eval_steps={config.eval_steps}"
          " disagree: pass one of them.")
    steps = config.eval_steps
  artifacts.evaluate_checkpoint(config, FLAGS.workdir, FLAGS.step,
                                eval_steps=steps)


def _predict(config) -> None:
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  artifacts.predict_file(config, FLAGS.workdir, FLAGS.input, FLAGS.output,
                         step=FLAGS.step)


def _export(config) -> None:
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  artifacts.export_params(config, FLAGS.workdir, FLAGS.output, step=FLAGS.step,
                          overwrite=FLAGS.overwrite)


def _verify(config) -> None:
  """Prints every checkpoint step's state; exits 1 when one is damaged."""
  del config   # each step is read by its own metadata
  from hypermixer_jax.train import verify  # pylint: disable=g-import-not-at-top
  rows = verify.verify(FLAGS.workdir)
  print(verify.format_table(rows), flush=True)
  bad = [r.step for r in rows if r.status == verify.DAMAGED]
  if bad:
    exported = bool(_exported_steps(FLAGS.workdir))
    sys.exit(f"Damaged: step(s) {', '.join(bad)} of {FLAGS.workdir}; " + (
        "an exported folder is not trained on: export those steps again "
        "from their run (--mode=export --step=N --overwrite)." if exported
        else "training on this workdir resumes from the newest step that "
        "restores and moves the damaged steps newer than it to "
        "checkpoints_damaged/."))


def _exported_steps(workdir: str) -> list[int]:
  """The steps of an exported folder (step folders at its top); none for a
  run (it has checkpoints/) or a run's own checkpoints/ folder."""
  from hypermixer_jax.train import storage  # pylint: disable=g-import-not-at-top
  folder = storage.path(workdir)
  if (not folder.is_dir() or folder.name == "checkpoints"
      or (folder / "checkpoints").exists()):
    return []
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def _compile(config) -> None:
  """Prints the per-chip report for ``--topology``, or stops with why the
  configuration does not fit and what would."""
  from hypermixer_jax.train import compile as compile_lib  # pylint: disable=g-import-not-at-top
  try:
    report = compile_lib.compile_for_topology(config, FLAGS.topology,
                                              FLAGS.num_slices)
  except ValueError as e:
    sys.exit(f"Stopped: {e}")
  print(compile_lib.format_report(report))


# --mode -> (what it does, the flags it needs).
MODES = {
    "train": (_train, ("workdir",)),
    "evaluate": (_evaluate, ("workdir",)),
    "predict": (_predict, ("workdir", "input", "output")),
    "export": (_export, ("workdir", "output")),
    "compile": (_compile, ("config", "topology")),
    "verify": (_verify, ("workdir",)),
}
# Modes that read a checkpoint, and so start from the workdir's saved config
# (``train`` does when it resumes).
FROM_CHECKPOINT = ("evaluate", "predict", "export")
# Where ``--config=FILE`` is looked for when a given one is missing.
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs")

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics "
                    "(evaluate/predict: also an exported folder).")
config_flags.DEFINE_config_file(
    "config", None, "Configuration file (ml_collections), e.g. "
    "configs/glue.py:sst2,hypermixer. Optional when --workdir holds a saved "
    "config (evaluate, predict, export, a resumed run).", lock_config=True)
flags.DEFINE_enum("mode", "train", list(MODES),
                  "train | evaluate (a checkpoint of --workdir, no training) "
                  "| predict (--input file -> --output JSONL) | export "
                  "(parameters, config and vocabulary, to --output) | compile "
                  "(for --topology, without a TPU) | verify (every checkpoint "
                  "step of --workdir read and checked against its "
                  "fingerprints).")
flags.DEFINE_integer("step", None, "evaluate/predict/export: checkpoint step "
                     "of --workdir (default: the latest).")
flags.DEFINE_integer("eval_steps", -1, "evaluate: batches of eval_batch_size "
                     "to score (-1: the whole eval_split; training's "
                     "evaluations take --config.eval_steps, which evaluate "
                     "takes too where given).")
flags.DEFINE_string("input", None, "predict: input file (.txt one example a "
                    "line, .tsv/.jsonl with the task's columns).")
flags.DEFINE_string("output", None, "predict: JSONL file; export: directory.")
flags.DEFINE_bool("overwrite", False, "export: replace a step that --output "
                  "already holds, or write into a folder that holds other "
                  "files than an export's.")
flags.DEFINE_enum("distributed", "auto", ("auto", "on", "off"),
                  "jax.distributed.initialize(): auto = with the flags below, "
                  "or on a detected TPU pod / SLURM job; on = always (JAX "
                  "detects the cluster); off = never.")
flags.DEFINE_string("coordinator_address", None,
                    "HOST:PORT of process 0 (explicit multi-process start).")
flags.DEFINE_integer("num_processes", None, "Number of processes.")
flags.DEFINE_integer("process_id", None, "This process's index.")
flags.DEFINE_string("topology", None, "compile: a Cloud TPU topology, "
                    "GENERATION:SHAPE (v4:2x2x4, v5e:16x16, v5p:4x4x4, "
                    "v6e:16x16).")
flags.DEFINE_integer("num_slices", 1, "compile: slices of --topology joined "
                     "over the data-center network (multi-slice).")


class _QuietLibraries:
  """Drops INFO records of Orbax (several per save) and seqio's repeated
  "Length validation is skipped" from the absl log."""

  def filter(self, record) -> bool:
    if record.levelno >= 30:
      return True
    if f"{os.sep}orbax{os.sep}" in record.pathname:
      return False
    return not (f"{os.sep}seqio{os.sep}" in record.pathname and
                str(record.msg).startswith("Length validation is skipped"))


def _saved_config_argv(argv: list[str]) -> list[str]:
  """``argv`` with ``--config`` set to the workdir's saved config when it is
  absent and the mode reads one (so ``--config.field`` overrides apply)."""
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  workdir = run_config.flag_value(argv, "workdir")
  mode = run_config.flag_value(argv, "mode") or "train"
  if (workdir is None or mode == "verify"
      or run_config.flag_value(argv, "config") is not None):
    return argv
  if mode not in FROM_CHECKPOINT and not run_config.has_checkpoint(workdir):
    return argv
  saved = run_config.find(workdir)
  if saved is None:
    run_config.check_present(workdir)
    return argv
  run_config.load_complete(saved)   # an error here reads better than later
  return [argv[0], f"--config={run_config.__file__}:{saved.parent}",
          *argv[1:]]


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with config mistakes stopped in one line.

  Config files import no TensorFlow (``hypermixer_jax.data`` imports it only
  to build a tf.data pipeline), so a mistake stops before it is loaded.
  """
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  try:
    argv = _saved_config_argv(list(argv))
    spec = run_config.flag_value(argv, "config")
    if spec:
      run_config.check_config_file(spec, CONFIGS_DIR)
    try:
      return FLAGS(argv)
    except flags.Error as e:
      raise run_config.ConfigFlagError(
          run_config.flag_error(str(e), spec)) from None
    except (AttributeError, KeyError):   # config_flags: an unknown field
      line = spec and run_config.unknown_fields(
          run_config.load_config_file(spec), argv)
      if not line:
        raise
      raise run_config.ConfigFlagError(line) from None
  except run_config.ConfigFlagError as e:
    sys.exit(f"Stopped: {e}")


def _config(mode: str):
  """``FLAGS.config``, or the workdir's saved config with the overrides."""
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  saved = (run_config.find(FLAGS.workdir)
           if mode in FROM_CHECKPOINT or run_config.has_checkpoint(
               FLAGS.workdir) else None)
  if saved is None:
    from hypermixer_jax.train import storage  # pylint: disable=g-import-not-at-top
    folder = storage.path(FLAGS.workdir)
    exported = _exported_steps(FLAGS.workdir)
    if mode == "train" and exported:
      # Training there would write a run over the export (its config.json
      # too) and ignore its parameters.
      raise app.UsageError(
          f"--workdir={FLAGS.workdir} is an exported folder (step(s) "
          f"{exported}), not a run to resume: fine-tune from it with "
          f"--config.init_checkpoint={FLAGS.workdir} and another --workdir "
          "(evaluate or predict it with --workdir as it is).")
    if FLAGS.config is None and mode != "train" and exported:
      raise app.UsageError(
          f"--mode={mode}: {FLAGS.workdir} holds exported steps but no "
          f"{run_config.CONFIG_FILE}; pass --config=FILE[:arg] of the run it "
          f"was exported from, or copy that run's {run_config.CONFIG_FILE} "
          "into it.")
    from hypermixer_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
    if FLAGS.config is None and mode == "train" and (
        folder / workdir_lib.LOCK_FILE).exists():
      # A job still before its first checkpoint: named, as its lock would.
      workdir_lib.WorkdirLock(FLAGS.workdir).acquire().release()
    if FLAGS.config is None:
      raise app.UsageError(
          f"--config is required: {FLAGS.workdir} holds no checkpoint"
          if mode == "train" else
          f"--mode={mode}: {FLAGS.workdir} holds no checkpoint and no saved "
          f"{run_config.CONFIG_FILE}; pass the --workdir of a trained run or "
          "an exported folder.")
    # Paths saved absolute: later commands may run from another folder.
    return run_config.absolute_paths(FLAGS.config)
  file = config_flags.get_config_filename(FLAGS["config"])
  given = (None if file.startswith(run_config.__file__) else FLAGS.config)
  return run_config.resolve(saved, run_config.absolute_overrides(
      config_flags.get_override_values(FLAGS["config"]), saved), given=given)


def unexpanded_home(paths: dict[str, str | None]) -> str | None:
  """The line for a path flag starting with ``~``, which the shell leaves
  as it is after ``=``: it would make a folder named ``~`` here."""
  from hypermixer_jax.train import storage  # pylint: disable=g-import-not-at-top
  lines = [storage.unexpanded_home(f"--{name}", value)
           for name, value in paths.items() if value]
  return next((line for line in lines if line), None)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  from hypermixer_jax import runtime  # pylint: disable=g-import-not-at-top
  try:
    how = runtime.initialize_distributed(
        FLAGS.distributed, coordinator_address=FLAGS.coordinator_address,
        num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  import jax  # pylint: disable=g-import-not-at-top

  logging.info("JAX process %d/%d (distributed: %s), local devices %s",
               jax.process_index(), jax.process_count(), how or "no",
               jax.local_devices())
  run_mode, needs = MODES[FLAGS.mode]
  missing = [f"--{n}" for n in needs if not FLAGS[n].value]
  if missing:
    hint = "."
    if FLAGS.mode == "compile":
      from hypermixer_jax.train import compile as compile_lib  # pylint: disable=g-import-not-at-top
      hint = " (e.g. --topology=v5e:16x16); " + compile_lib.GPU_ANSWER
    # One line, not absl's usage text above it.
    sys.exit(f"Stopped: --mode={FLAGS.mode} needs "
             f"{' and '.join(missing)}{hint}")
  tilde = unexpanded_home({n: FLAGS[n].value for n in ("workdir", "input",
                                                       "output")})
  if tilde:
    sys.exit(f"Stopped: {tilde}")
  try:
    if FLAGS.mode == "verify":   # reads no config
      run_mode(None)
      return
    config = FLAGS.config if FLAGS.mode == "compile" else _config(FLAGS.mode)
    # TensorFlow (input pipelines) must not take the accelerators from JAX.
    # Only the synthetic task reads no tf.data pipeline: its runs never
    # import TensorFlow (about 3 s of CPU per process).
    if (config.data.task != "synthetic_pairs"
        or "tensorflow" in sys.modules):
      runtime.hide_accelerators_from_tensorflow()
    run_mode(config)
  except FloatingPointError as e:
    sys.exit(f"Training stopped: {e}")
  except app.UsageError as e:     # the workdir and flags do not fit together
    sys.exit(f"Stopped: {e}")
  except Exception as e:  # pylint: disable=broad-except
    # Bad data, config, checkpoints or a busy workdir: the message says
    # what and where; a traceback would only bury it. Printed once (absl's
    # log goes to the same stderr).
    from hypermixer_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
    if not isinstance(e, workdir_lib.user_errors()):
      raise
    sys.exit(f"Stopped: {e}")


def run():
  """Console entry point (``hypermixer-train``): the help of ``python -m
  hypermixer_jax.main`` (absl shows the main module's flags and docstring)."""
  main_module = sys.modules["__main__"]
  if main_module.__doc__ is None:
    main_module.__doc__ = __doc__
  for flag in FLAGS.get_flags_for_module(__name__):
    FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  from hypermixer_jax import runtime  # pylint: disable=g-import-not-at-top
  runtime.prepare_host()   # before any device query
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
