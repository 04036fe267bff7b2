r"""sMLP against token-routed MoE Transformers at equal FLOPs (Yu et al. 2022).

The main comparison (the paper's §4.3, Fig. 5 and Table 4): causal LMs of sMLP
(deterministic and partial-prediction sMoE routing, Base Layers tMoE) against
MoE Transformers with Switch, GShard, Base Layers and Hash token routing and
against a dense gMLP and a dense Transformer, every model at about the same
FLOPs per token; validation perplexity curves and tokens/s.
The ablations (``--ablations``): the number of experts (2, 4, 8) and the
tMoE router of sMLP (Switch instead of Base Layers).

All models are the ``smlp`` family (``models/smlp.py``): ``token_mixer='gmlp'``
is sMLP (a dense gMLP when it has no sparse block), ``'attention'`` the (MoE)
Transformer.
As in the paper, FLOPs are matched by the number of layers at fixed widths:
the FLOPs per token of a depth (N1 dense + N2 sparse blocks) are XLA's cost
analysis of the compiled train step (``metrics.step_flops``, what the
training loop reports) of the model with (0, 0), (1, 0) and (0, 1) blocks,
extended linearly (``sparse_lm.fit_block_flops``); each model but the
reference sMLP (deterministic) takes the depth whose *layer* FLOPs (the
step's minus the embedding/output part, the (0, 0) model) are closest to the
reference's (``sparse_lm.choose_depth``; partial routing costs more per
sparse block, so it may get another depth). The training runs measure their
own FLOPs again (reported), and their tokens/s. What the study knows (models,
configs, FLOP matching, scoring, tables, figure) lives in
``hypermixer_jax.experiment.sparse_lm``; this script is its flags and steps.

  --scale=small  one CPU core, sequence 128 (rows of one document, no
                 packing: partial routing reads each row's first 20%),
                 4 experts, AdamW lr 3e-3 (cosine to 0.1), the same for
                 every model. Train: the two local C4 samples (2,000
                 documents); held out: WikiText-2 valid (``wiki.valid.raw``,
                 16 batches), perplexity per SentencePiece token beside
                 unigram and add-k bigram perplexity of the same positions.
                 ``--vocab=small`` (default): the 8k SentencePiece
                 vocabulary of the C4 sample (``mlm.c4_vocab``) at width
                 128 (``sparse_lm.SMALL_VOCAB``: d_ffn 512, 2 heads of 64,
                 sMLP N1 = N2 = 3, so that the blocks hold more of the
                 train step's FLOPs than the embedding and output layer),
                 1,000 steps of batch 16, WikiText read as articles; seeds
                 ``--seeds``. ``--vocab=t5``: the first runs' setting, T5's
                 32,128 ids at width 64 (d_ffn 256, 1 head, sMLP 2 + 2),
                 250 steps of batch 8, WikiText line by line; the output
                 layer is 88% of the step's FLOPs there and no model clears
                 the unigram baseline.
  --scale=paper  the paper's setting (§4.3, ~0.8 TFLOPs): d=1024,
                 d_ffn=4096, 16 experts, 16 heads, T=1024, sMLP N1=12,
                 N2=4, 25k steps; C4 from TFDS (``--data_dir``), WikiText-2
                 valid held out. Not runnable on this machine.

  python experiments/smlp_vs_moe.py --scale=small --out=experiments/results/smlp_vs_moe
  python experiments/smlp_vs_moe.py --scale=small --out=experiments/results/smlp_vs_moe --ablations

``--tune`` (small scale): every main model's learning rate and warm-up
chosen alike among ``selection.settings`` at its FLOP-matched depth, each
search run scored on every 10th C4 document carved from the training
documents (seed 100), then the seeds at each model's choice trained on the
other documents and scored on WikiText-2 valid: ``table_tuned.md``.

(``--models=NAME`` runs one model or ablation, e.g. one per queued job;
the runs are recorded in ``results.json``, and the last command's table
holds every recorded run it names.)

Writes ``results.json``, ``table.md`` and ``smlp_vs_moe.png`` (held-out
perplexity against step and against training time) into ``--out``.

Caveats, also in the table notes: XLA counts a while loop's body once, so
Base Layers' auction (training only) is under-counted; Base Layers'
training-time assignment reads the whole row (not causal; inference routing
is); partial routing's loss and perplexity count each row's last 80% only.
"""
from __future__ import annotations

import pathlib

from hypermixer_jax import experiment
from hypermixer_jax.experiment import mlm
from hypermixer_jax.experiment import sparse_lm


def _flags():
  """The parsed flags and the models to run (ablations added)."""
  p = experiment.parser("smlp_vs_moe", __doc__, report_only=True,
                        data_dir="", models=sparse_lm.MODELS, seeds="0,1,2",
                        steps=0, vocab="small")
  p.add_argument("--ablations", action="store_true",
                 help="the expert-count and router ablations of sMLP too "
                 "(names in sparse_lm.ABLATIONS; the first seed)")
  p.add_argument("--plan_only", action="store_true",
                 help="measure FLOPs and choose depths, train nothing")
  experiment.tune_flags(p, "C4 documents", budget_check=True)
  args = experiment.parse(p)
  experiment.check_tune(args, "the local C4 documents")
  experiment.check_budget(args)
  names = experiment.split(args.models)
  if args.ablations:
    names += [n for n in sparse_lm.ABLATIONS if n not in names]
  unknown = [n for n in names
             if n not in sparse_lm.MODELS and n not in sparse_lm.ABLATIONS]
  if unknown:
    raise SystemExit(f"--models: unknown {unknown}; models: "
                     f"{', '.join(sparse_lm.MODELS)}; ablations: "
                     f"{', '.join(sparse_lm.ABLATIONS)}")
  return args, names


def fitter(exp, prefix, config, dispatch=sparse_lm.DISPATCH):
  """``fit_of(name)``: the model's FLOP fit under ``config`` (which runs
  ``dispatch``), recorded under ``{prefix}/{name}`` so that a restart does
  not recompile."""
  def fit_of(name):
    dense = name in sparse_lm.DENSE
    return sparse_lm.recorded_fit(
        exp, f"{prefix}/{name}", lambda: sparse_lm.fit_block_flops(
            lambda d: sparse_lm.train_step_flops(config(
                name, (d[0], 0) if dense else d))), dispatch)
  return fit_of


def write_dispatch_table(exp, s, regime, config) -> None:
  """``table_dispatch.md``: the main models' FLOP matching under the
  study's einsum dispatch and under the layers' default, index (its fits
  recorded under ``{regime}/flops_index/``)."""
  def index_config(name, depth, seed=0):
    c = config(name, depth, seed)
    c.model.moe.dispatch = "index"
    return c

  def fits(dispatch, prefix, cfg):
    return sparse_lm.matched_plan(s, list(sparse_lm.MODELS), cfg, fitter(
        exp, f"{regime}/{prefix}", cfg, dispatch))
  plans = {"einsum": fits("einsum", "flops", config),
           "index": fits("index", "flops_index", index_config)}
  exp.write_table(
      "FLOPs matched by depth under each dispatch", sparse_lm.dispatch_table(
          plans), "Each model's blocks (N1 dense + N2 sparse) chosen so "
      "that their FLOPs per token (XLA's count of the compiled train step) "
      "are closest to sMLP's, counted with the study's dispatch (GShard's "
      "one-hot einsums, which every run here trained with) and with the "
      "layers' default (gathers and scatters, the same outputs, ~0 FLOPs "
      "counted). The einsums' count grows with a routing group's tokens x "
      "experts x slots, so it weighs on the MoE models' sparse blocks, "
      "and on sMLP's own.", name="table_dispatch")


def main() -> None:
  args, names = _flags()
  exp = experiment.Experiment(args.out, args)
  shared = pathlib.Path(args.shared)
  regime, s = sparse_lm.settings(args.scale, args.vocab)
  vocab = (mlm.c4_vocab(exp, shared) if regime == "small8k" else None)
  steps = args.steps or s["steps"]
  seeds = experiment.split(args.seeds, int)

  def config(name, depth, seed=0, length=steps):
    return sparse_lm.run_config(name, args.scale, depth, shared,
                                args.data_dir, vocab=vocab, seed=seed,
                                steps=length)

  fit_of = fitter(exp, f"{regime}/flops", config)
  plan = sparse_lm.record_plan(exp, s, names, config, fit_of)
  if args.plan_only:
    if regime == "small8k":
      write_dispatch_table(exp, s, regime, config)
    return
  ref = sparse_lm.REFERENCE
  if args.tune:
    lrs = experiment.split(args.lrs, float) or None
    tuned = sparse_lm.tune(exp, plan, seeds, f"{regime}/s{steps}", config,
                           s["batch_size"] * s["seq_len"], lrs,
                           reverse=args.order == "reverse")
    lengths = experiment.split(args.budget_check, int)
    check = sparse_lm.length_check(exp, plan, tuned, lengths, config,
                                   f"{regime}/s{steps}") if lengths else None
    sparse_lm.report_tuned(exp, s, plan, tuned, vocab, steps, seeds, lrs,
                           check)
    return
  base = (exp.data.get("baselines", {}).get(regime) if exp.report_only else
          exp.baseline(regime, lambda: sparse_lm.lm_baselines(
              config(ref, s["smlp_depth"]))))
  runs = sparse_lm.train_runs(exp, plan, seeds, f"{regime}/s{steps}", config,
                              s["batch_size"] * s["seq_len"])
  plan.setdefault(ref, sparse_lm.plan_entry(ref, fit_of(ref),
                                            s["smlp_depth"], config))
  sparse_lm.write_report(exp, args.scale, s, plan, runs, base, vocab, steps,
                         seeds)


if __name__ == "__main__":
  main()
