"""The experiment harness: one command per table or figure of a paper.

Every script in ``experiments/`` that reproduces a paper result is one
command with the same flags and the same outputs:

    python experiments/<name>.py --scale=small|paper --out=DIR [--shared=DIR]

* ``--scale=small`` is sized for a 2-core CPU machine (or one lent GPU) and
  ``--scale=paper`` is the paper's setting, meant for a pod;
* ``DIR/results.json`` holds every run's measurements, written after each
  run, so a killed experiment restarted with the same ``--out`` skips the
  runs it already has (and each training run resumes from its checkpoint);
* ``DIR/table.md`` is the Markdown table (with the paper's numbers beside
  ours where the paper has them) and ``DIR/<figure>.png`` the figure.

The modules, by concern (everything is re-exported here, so a script writes
``from hypermixer_jax import experiment`` and ``experiment.grid(...)``):

* ``flags``: the shared flags (``parser``, ``parse``, ``split``), the configs
  runs start from (``load_config``) and the data samples (``require``);
* ``records``: the grid of a study (``grid``, ``cell_key``) and its record,
  ``Experiment`` (``results.json``: each cell run once, shared by
  processes; ``baseline`` the trivial baselines, ``adopt`` another
  experiment's identical run, ``supersede`` a retired one);
* ``digests``: ``file_digest`` and ``config_fingerprint``;
* ``runs``: ``train`` (one run through the library's ``train_and_evaluate``,
  with its learning curves), ``trained_params``, ``pipeline_arrays`` /
  ``held_out_arrays`` (the tokens the trivial baselines of
  ``hypermixer_jax.baselines`` are fitted and scored on), ``match_field``,
  ``flops_per_step``;
* ``vocab``: ``small_vocab``, a study's in-domain SentencePiece vocabulary;
* ``stats``: seeds turned into a table's cells (``mean_sd``,
  ``fmt_mean_sd``, ``seed_summary``, ``fmt_seed_summary``, ``mean_ci``)
  and verdicts (``verdict``,
  ``against_baseline``: Welch's test, ``welch``, with the evaluation set's
  noise for accuracies; equality only by ``tost``);
* ``tables`` / ``figures``: Markdown tables and the learning-curve plots;
* ``timing``: interleaved timing rounds and compiled memory.

Modules imported by name, not re-exported. The shared infrastructure:
``bench`` (the benchmarks' matmul ceiling, interleaved rounds and MFU; it
loads JAX), ``train_steps`` (the train steps the benchmarks time),
``tuning`` (expected best of n trials and the paired bootstrap of a
tuning curve), ``selection`` (equal tuning on a validation split carved
from the training data), ``kit`` (the accelerator kit's measurements) and ``claims`` (the claims table of the papers against the
committed records: ``python -m hypermixer_jax.experiment.claims``). The
parts of one study that several scripts or tests share: ``glue`` (the GLUE
configs, budgets and bag-of-words baseline), ``mlm`` (the MLM perplexity
study), ``nli`` (the 80/20 NLI splits), ``synthetic`` (the synthetic task's
pseudo-attention maps and trivial predictors), ``pretraining`` (the
pretrain-then-fine-tune study's configs, encoder probe and report) and
``causal`` (the causal-LM study's FLOP-matched models, held-out set,
scoring and report), ``sparse_lm`` (the sMLP-vs-MoE study's models and
ablations, training configs, FLOPs matched by depth, held-out scoring on
each row's last 80%, baselines, tables and figure), ``images`` (the
image-classification study's configs, CIFAR-10 TSVs, pixel baselines and
report), ``input_rates`` (what ``bench_input`` measures: the input
pipelines' throughput, checkpoint cost and the train step each feeds) and
``pods`` (the pod plan's grid, compile records and tables).

The re-exported modules know no model or task (the scripts declare their
runs as configs); what one study knows lives in its own module.
"""
# pylint: disable=g-importing-member
from hypermixer_jax.experiment.digests import config_fingerprint
from hypermixer_jax.experiment.digests import file_digest
from hypermixer_jax.experiment.figures import baseline_lines
from hypermixer_jax.experiment.figures import curve
from hypermixer_jax.experiment.figures import figure
from hypermixer_jax.experiment.figures import mean_curve
from hypermixer_jax.experiment.figures import plot_curves
from hypermixer_jax.experiment.figures import style_axes
from hypermixer_jax.experiment.flags import check_budget
from hypermixer_jax.experiment.flags import check_tune
from hypermixer_jax.experiment.flags import default_shared_dir
from hypermixer_jax.experiment.flags import load_config
from hypermixer_jax.experiment.flags import parse
from hypermixer_jax.experiment.flags import parser
from hypermixer_jax.experiment.flags import REPO
from hypermixer_jax.experiment.flags import require
from hypermixer_jax.experiment.flags import SCALES
from hypermixer_jax.experiment.flags import split
from hypermixer_jax.experiment.flags import tune_flags
from hypermixer_jax.experiment.records import cell_key
from hypermixer_jax.experiment.records import Experiment
from hypermixer_jax.experiment.records import grid
from hypermixer_jax.experiment.records import where_ran
from hypermixer_jax.experiment.runs import decay_rule_pairs
from hypermixer_jax.experiment.runs import decay_rules_differ
from hypermixer_jax.experiment.runs import flops_per_step
from hypermixer_jax.experiment.runs import held_out_arrays
from hypermixer_jax.experiment.runs import match_field
from hypermixer_jax.experiment.runs import pipeline_arrays
from hypermixer_jax.experiment.runs import retire_other_decay_rule
from hypermixer_jax.experiment.runs import train
from hypermixer_jax.experiment.runs import trained_params
from hypermixer_jax.experiment.stats import against_baseline
from hypermixer_jax.experiment.stats import ALPHA
from hypermixer_jax.experiment.stats import fmt_mean_sd
from hypermixer_jax.experiment.stats import fmt_seed_summary
from hypermixer_jax.experiment.stats import mean_sd
from hypermixer_jax.experiment.stats import mean_ci
from hypermixer_jax.experiment.stats import MIN_SEEDS
from hypermixer_jax.experiment.stats import NO_VERDICT
from hypermixer_jax.experiment.stats import seed_summary
from hypermixer_jax.experiment.stats import tost
from hypermixer_jax.experiment.stats import verdict
from hypermixer_jax.experiment.stats import UNTUNED_NOTE
from hypermixer_jax.experiment.stats import VERDICT_NOTE
from hypermixer_jax.experiment.stats import welch
from hypermixer_jax.experiment.tables import markdown_table
from hypermixer_jax.experiment.tables import perplexity_baseline_rows
from hypermixer_jax.experiment.tables import table_row
from hypermixer_jax.experiment.timing import compiled_bytes
from hypermixer_jax.experiment.timing import time_rounds
from hypermixer_jax.experiment.vocab import small_vocab
