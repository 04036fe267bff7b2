"""Trains and evaluates a model; the logic lives in ``hypermixer_jax.train``.

    python -m hypermixer_jax.main --config=configs/default.py --workdir=/tmp/hm
    hypermixer-train --config=configs/glue.py:sst2,hypermixer \
        --config.learning_rate=1e-4 --workdir=/tmp/sst2

The config is locked: ``--config.some_field=value`` must name an existing
field. A run restarted with the same ``--workdir`` resumes from its latest
checkpoint.
"""
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
config_flags.DEFINE_config_file(
    "config", None, "Training configuration file (ml_collections).",
    lock_config=True)
flags.mark_flags_as_required(["config", "workdir"])


class _QuietLibraries:
  """Drops INFO records of Orbax (several per save) from the absl log."""

  def filter(self, record) -> bool:
    return (record.levelno >= 30 or
            f"{os.sep}orbax{os.sep}" not in record.pathname)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_QuietLibraries())
  # TensorFlow (input pipelines) must not take the accelerators from JAX.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  import jax  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import loop  # pylint: disable=g-import-not-at-top

  logging.info("JAX process %d/%d, local devices %s", jax.process_index(),
               jax.process_count(), jax.local_devices())
  try:
    loop.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except FloatingPointError as e:
    logging.error("%s", e)
    sys.exit(f"Training stopped: {e}")


def run():
  """Console entry point (``hypermixer-train``)."""
  app.run(main)


if __name__ == "__main__":
  run()
