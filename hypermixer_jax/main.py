"""Trains, evaluates, predicts or exports; the logic lives in ``hypermixer_jax.train``.

    python -m hypermixer_jax.main --config=configs/default.py --workdir=/tmp/hm
    hypermixer-train --config=configs/glue.py:sst2,hypermixer \
        --config.learning_rate=1e-4 --workdir=/tmp/sst2
    # without training: evaluate the latest (or --step) checkpoint, predict
    # on a file (JSONL out), export the parameters alone:
    hypermixer-train --mode=evaluate --config=... --workdir=/tmp/sst2
    hypermixer-train --mode=predict --config=... --workdir=/tmp/sst2 \
        --input=sentences.txt --output=predictions.jsonl
    hypermixer-train --mode=export --config=... --workdir=/tmp/sst2 \
        --output=/tmp/sst2_params
    # compile for a TPU topology without owning it (no --workdir; needs
    # the [tpu] extra): per-chip memory, FLOPs, collectives, estimated MFU
    hypermixer-train --mode=compile --config=configs/c4_mlm.py:hypermixer \
        --topology=v5e:16x16 [--num_slices=2]

The config is locked: ``--config.some_field=value`` must name an existing
field. A run restarted with the same ``--workdir`` resumes from its latest
checkpoint.

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

MODES = ("train", "evaluate", "predict", "export", "compile")

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
config_flags.DEFINE_config_file(
    "config", None, "Training configuration file (ml_collections).",
    lock_config=True)
flags.DEFINE_enum("mode", "train", MODES,
                  "train | evaluate (a checkpoint of --workdir, no training) "
                  "| predict (--input file -> --output JSONL) | export "
                  "(parameters alone, to --output) | compile (for "
                  "--topology, without a TPU).")
flags.DEFINE_integer("step", None, "evaluate/predict/export: checkpoint step "
                     "of --workdir (default: the latest).")
flags.DEFINE_string("input", None, "predict: input file (.txt one example a "
                    "line, .tsv/.jsonl with the task's columns).")
flags.DEFINE_string("output", None, "predict: JSONL file; export: directory.")
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
flags.mark_flags_as_required(["config"])


class _QuietLibraries:
  """Drops INFO records of Orbax (several per save) from the absl log."""

  def filter(self, record) -> bool:
    return (record.levelno >= 30 or
            f"{os.sep}orbax{os.sep}" not in record.pathname)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  from hypermixer_jax import runtime  # pylint: disable=g-import-not-at-top
  # TensorFlow (input pipelines) must not take the accelerators from JAX.
  runtime.hide_accelerators_from_tensorflow()
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
  if FLAGS.mode == "compile":
    _compile_for_topology()
    return
  if not FLAGS.workdir:
    raise app.UsageError(f"--mode={FLAGS.mode} needs --workdir.")
  if FLAGS.mode in ("predict", "export") and not FLAGS.output:
    raise app.UsageError(f"--mode={FLAGS.mode} needs --output.")
  if FLAGS.mode == "predict" and not FLAGS.input:
    raise app.UsageError("--mode=predict needs --input.")
  try:
    if FLAGS.mode == "train":
      from hypermixer_jax.train import loop  # pylint: disable=g-import-not-at-top
      loop.train_and_evaluate(FLAGS.config, FLAGS.workdir)
    else:
      from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
      if FLAGS.mode == "evaluate":
        artifacts.evaluate_checkpoint(FLAGS.config, FLAGS.workdir, FLAGS.step)
      elif FLAGS.mode == "predict":
        artifacts.predict_file(FLAGS.config, FLAGS.workdir, FLAGS.input,
                               FLAGS.output, step=FLAGS.step)
      else:
        artifacts.export_params(FLAGS.config, FLAGS.workdir, FLAGS.output,
                                step=FLAGS.step)
  except FloatingPointError as e:
    logging.error("%s", e)
    sys.exit(f"Training stopped: {e}")
  except Exception as e:  # pylint: disable=broad-except
    # Bad data, config, checkpoints or a busy workdir: the message says
    # what and where; a traceback would only bury it.
    from hypermixer_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
    if not isinstance(e, workdir_lib.user_errors()):
      raise
    logging.error("%s", e)
    sys.exit(f"Stopped: {e}")


def _compile_for_topology():
  """``--mode=compile``: prints the per-chip report, or stops with why the
  configuration does not fit and what would."""
  from hypermixer_jax.train import compile as compile_lib  # pylint: disable=g-import-not-at-top
  if not FLAGS.topology:
    raise app.UsageError("--mode=compile needs --topology (e.g. v5e:16x16); "
                         + compile_lib.GPU_ANSWER)
  try:
    report = compile_lib.compile_for_topology(FLAGS.config, FLAGS.topology,
                                              FLAGS.num_slices)
  except ValueError as e:
    sys.exit(f"Stopped: {e}")
  print(compile_lib.format_report(report))


def run():
  """Console entry point (``hypermixer-train``)."""
  app.run(main)


if __name__ == "__main__":
  run()
