"""Input pipelines: seqio tasks, feature converters and resumable iterators.

Entry points: ``build_pipeline``, ``default_data_config``, ``task_metrics``;
the seqio tasks are registered in ``hypermixer_jax.data.tasks``. Importing
this package does not import TensorFlow: building the pipeline of a task
read through tf.data does (``seqio_pipeline``).
"""
from hypermixer_jax.data.checks import DataError
from hypermixer_jax.data.config import default_data_config
from hypermixer_jax.data.metrics import task_metrics
from hypermixer_jax.data.pipeline import Pipeline
from hypermixer_jax.data.pipeline import build_pipeline
from hypermixer_jax.data.pipeline import check_fits_model
from hypermixer_jax.data.task_specs import TASK_NAMES

__all__ = ["DataError", "Pipeline", "TASK_NAMES", "build_pipeline",
           "check_fits_model", "default_data_config", "task_metrics"]
