r"""MLM perplexity at equal capacity: gMLP, aMLP and BERT (Liu et al. 2021, §4).

The gMLP paper pretrains BERT-style masked LMs (15% of the tokens selected;
80% [MASK], 10% random, 10% kept) and finds that gMLP, with Toeplitz
spatial weights and no position embeddings, reaches the perplexity of a
Transformer of the same capacity (BERT-base 12 layers 110M: 4.26, gMLP 36
layers 102M: 4.35), and that aMLP, gMLP with a tiny single-head attention of
size 64, does at least as well as BERT.

  --scale=paper  BERT-base (12 post-LN layers, d=768, d_ffn=3072, 12 heads,
                 learned positions) against gMLP-base and aMLP-base (36
                 layers, d=512, d_ffn=3072, Toeplitz W, no positions; aMLP's
                 tiny attention d_attn=64), the ablation setting of the
                 paper's scaling table: full English C4 from TFDS
                 (``--data_dir``), length 128, batch 2048, 125k steps, AdamW
                 (0.9, 0.999), 10k warm-up steps, peak lr 7e-4, linear decay;
                 held-out perplexity on C4 validation (what the paper reports).
  --scale=small  one CPU core: the three models at width 128 (see
                 ``SMALL``): BERT 2 post-LN layers d_ffn 512, 2 heads; gMLP
                 and aMLP 6 layers (the paper's 3:1 depth ratio) with d_ffn
                 set so that each has BERT's parameter count (``match``);
                 an 8k SentencePiece vocabulary trained on the C4 train
                 sample (``--vocab=t5``: T5's 32k); trained on the local C4
                 sample (1,000 documents), held-out perplexity on
                 WikiText-2 validation read as articles
                 (``data.text_layout='wikitext'``): its first 512 rows of
                 128 tokens (the unshuffled split's first 8 batches of 64)
                 at every evaluation; seeds ``--seeds``; beside them unigram
                 and add-k bigram perplexity on the same scored positions
                 (``lm_baselines``). 2,000 steps of batch 32 (``--steps``): the
                 budget at which every model clears 0.6 x unigram and
                 the bigram (at 1,000 steps BERT does not).

BERT's diagnostics (``DIAGNOSTICS``, not run by default): BERT with pre-LN
blocks, or with sinusoidal positions (and sqrt(d)-scaled token embeddings,
as in Vaswani et al.), each at BERT's size
(``--models=attention_pre_ln,attention_sinusoidal --seeds=0``), and BERT
with 1.5x / 2x its layers and the FFN narrowed to its parameter count
(``DEPTH_DIAGNOSTICS``, ``--models=attention_deeper,attention_deepest``):
whether BERT's gap to gMLP comes from its post-LN layout, from learning its
position table, or from its depth (gMLP has 3x BERT's layers).

Every model trains with the same optimizer, schedule, batches and seed, and
is evaluated on the same held-out rows with the same masked positions (the
evaluation pipeline is unshuffled and its masking is seeded by
``config.seed``: equal for all models of one seed). Perplexity = exp(mean
cross-entropy over all selected tokens of the held-out set). Our tokens are
SentencePiece pieces, so our perplexities are not comparable in absolute
value with the paper's (BERT's WordPiece vocabulary, a C4 validation set,
models trained ~10^4 times longer): only the comparison between the models
and against the baselines is.

  python experiments/mlm_perplexity.py --scale=small \
      --out=experiments/results/mlm_perplexity

``--tune`` (small scale): every model tuned alike, its learning rate and
warm-up chosen among ``mlm.tune_settings`` on C4 documents carved from the
training sample (``mlm.carve_validation``), then the seeds at the chosen
setting: ``table_tuned.md``.

Writes ``results.json``, ``table.md`` and ``mlm_perplexity.png`` (held-out
perplexity against step) into ``--out``.
"""
from __future__ import annotations

import pathlib

import numpy as np

from hypermixer_jax import experiment
from hypermixer_jax.experiment import mlm
from hypermixer_jax.experiment import selection as selection_lib

def main() -> None:
  p = experiment.parser("mlm_perplexity", __doc__, report_only=True,
                        data_dir="", models=mlm.MODELS, seeds="0,1,2", steps=0,
                        vocab="small")
  experiment.tune_flags(p, "C4 documents", budget_check=True)
  args = experiment.parse(p)
  experiment.check_tune(args, "the local C4 sample")
  experiment.check_budget(args)
  models = experiment.split(args.models)
  unknown = sorted(set(models) - set(mlm.CHOICES))
  if unknown:
    raise SystemExit(f"--models: {', '.join(unknown)} unknown; the models "
                     f"are {', '.join(mlm.CHOICES)}.")
  exp = experiment.Experiment(args.out, args)
  shared = pathlib.Path(args.shared)
  vocab = None
  if args.scale == "small" and args.vocab == "small":
    vocab = mlm.c4_vocab(exp, shared)
  configs = mlm.model_configs(args.scale, vocab)
  sizes = {m: {"model": c.to_dict(), "params": mlm.params(c)}
           for m, c in configs.items()}
  exp.save(sizes=sizes)
  seeds = experiment.split(args.seeds, int)
  steps = args.steps or (mlm.SMALL if args.scale == "small"
                         else mlm.PAPER_SIZES)["steps"]
  prefix = f"{args.scale}/s{steps}/vocab={'small' if vocab else 't5'}"

  def config(model, seed=0, length=steps):
    return mlm.train_config(configs[model], args.scale, shared,
                            args.data_dir, length, seed=seed, vocab=vocab)
  if args.tune:
    _tuned(exp, args, models, seeds, steps, prefix, config, sizes, shared,
           vocab)
    return
  if args.scale == "small":
    for seed in seeds:   # the masked positions follow the seed
      exp.baseline(f"{prefix}/seed={seed}",
                   lambda seed=seed: mlm.lm_baselines(
                       config("attention", seed)))

  def run(cell, key):
    c = config(cell["model"], cell["seed"])
    return dict(experiment.train(c, exp.workdir(key)),
                params=sizes[cell["model"]]["params"],
                held_out=mlm.held_out(c) if args.scale == "small" else None)
  runs = exp.cells(prefix, experiment.grid(model=models, seed=seeds), run)
  # The seeds' baselines on the whole sample (not --tune's carved ones).
  seed_bases = [b for k, b in exp.data.get("baselines", {}).items()
                if k.startswith(prefix + "/seed=")]
  _report(exp, args, runs, sizes, steps, seed_bases, vocab,
          config("attention"))


def _tuned(exp, args, models, seeds, steps, prefix, config, sizes, shared,
           vocab) -> None:
  """``--tune``: each model's search (``mlm.tune_settings``) on the carved
  validation split, then the seeds at its choice (carved train split)."""
  split = mlm.carve_validation(shared / mlm.C4_TRAIN,
                               pathlib.Path(exp.workdir("c4_split")))
  exp.save(c4_split=mlm.split_record(split))
  bases = [exp.baseline(f"{prefix}/carved/seed={seed}",
                        lambda seed=seed: mlm.lm_baselines(mlm.carved_config(
                            config("attention", seed), split)))
           for seed in seeds]

  def one(model, seed, setting, key, select):
    c = mlm.carved_config(config(model, seed), split, setting, select=select)
    out = mlm.lean(experiment.train(c, exp.workdir(key)))
    return out if select else dict(out, params=sizes[model]["params"],
                                   held_out=mlm.held_out(c))
  lrs = experiment.split(args.lrs, float) or None
  tuned = mlm.tune(exp, models, seeds, steps, f"{prefix}/", one, lrs,
                   split=split, reverse=args.order == "reverse")
  lengths = experiment.split(args.budget_check, int)
  budget = mlm.budget_check(exp, f"{prefix}/", tuned[0], tuned[1], lengths,
                            steps, config, split, models) if lengths else None
  _tuned_report(exp, args, steps, split, tuned, sizes,
                bases, vocab, config("attention"), lrs, budget)


def _tuned_report(exp, args, steps, split, tuned, sizes, bases, vocab,
                  c, lrs=None, budget=None) -> None:
  """``table_tuned.md``: the tuned models' seeds against the baselines, and
  every model's search (``tuned``: selection runs, choices, final runs)."""
  selection, chosen, runs = tuned
  base = {k: float(np.mean([b[k] for b in bases]))
          for k in ("unigram", "bigram", "bigram_k")}
  notes = (mlm.tuned_notes(split, steps, args.seeds, lrs)
           + _notes(args, steps, bases, vocab, c, tuned=True,
                    checked=budget is not None))
  exp.write_table(
      f"MLM perplexity, every model tuned alike ({steps} steps)",
      experiment.markdown_table(mlm.HEADERS,
                                mlm.table_rows(runs, sizes, base))
      + "\n\n" + selection_lib.search_section(
          selection, chosen, mlm.LABELS, lrs or mlm.TUNE_LRS,
          shares=mlm.TUNE_WARMUP_SHARES, what="perplexity",
          cell=lambda r: f"{mlm.final_perplexity(r):.2f}")
      + (mlm.budget_section(*budget, experiment.split(args.models), steps)
         if budget else ""),
      notes, name=mlm.report_names(args.scale, steps)[0] + "_tuned")


def _notes(args, steps: int, seed_bases: list, vocab: dict | None, c,
           tuned: bool = False, checked: bool = False) -> str:
  """The table's notes (``c``: BERT's training config): the setting all
  models share, the held-out set and the vocabulary; ``tuned``: each
  model's own learning rate and warm-up."""
  schedule = ("each model's chosen warm-up and peak lr" if tuned else
              f"{c.warmup_steps} warm-up steps to lr {c.learning_rate:g}")
  notes = ("" if tuned else experiment.UNTUNED_NOTE) + (
      f"Same for all models: AdamW (b1 0.9, b2 0.999, weight decay "
      f"{c.weight_decay}), {schedule} then linear decay to 0, clip norm "
      f"{c.clip_norm}, "
      f"batch {c.batch_size} x length {c.data.seq_len}, {steps} steps, "
      f"dropout {c.model.dropout_rate}, seeds {args.seeds} (initialisation, "
      "data order and the held-out masks); 15% of the tokens selected (80% "
      "[MASK], 10% random, 10% kept), unpacked rows. Perplexity = exp(mean "
      "cross-entropy over the selected held-out tokens), mean ± sd over "
      "seeds; 'vs BERT': whether the seeds back the paper's order (gMLP "
      "slightly above BERT, aMLP at most BERT): the difference of the "
      "perplexities (the model's minus BERT's) by Welch's test on the "
      "seeds, 95% interval and p; 'not decided' where p >= 0.05. "
      "Baselines: counts of the train tokens, scored on the same selected "
      "held-out positions (mean over the seeds' masks).")
  if seed_bases:
    ho = seed_bases[0]["held_out"]
    vocab_text = (f"{mlm.VOCAB_PIECES} SentencePiece pieces trained on the "
                  f"C4 sample (sha256 {vocab['sha256'][:12]}...)" if vocab
                  else "the T5 SentencePiece vocabulary (32,128 ids)")
    notes += (
        f" Held out: the first {ho['rows']} rows of WikiText-2 validation "
        f"read as articles, {ho['tokens']:,} tokens of which "
        f"{ho['scored_tokens']:,} selected and scored; {vocab_text}. "
        f"Trained on the C4 sample ({mlm.C4_TRAIN}). Our perplexities are not "
        "comparable in absolute value with the paper's (another vocabulary "
        "and held-out set, ~10^4 x less training), only between the models "
        "and against the baselines.")
  notes += f" Paper, other sizes: {mlm.PAPER_OTHER_SIZES}."
  if args.scale == "small" and steps == mlm.SMALL["steps"]:
    notes += " " + mlm.SMALL_BUDGET_NOTE.format(
        selection_lib.length_note(checked, tuned))
  return notes


def _report(exp, args, runs, sizes, steps, seed_bases, vocab, c) -> None:
  base = ({k: float(np.mean([b[k] for b in seed_bases]))
           for k in ("unigram", "bigram", "bigram_k")} if seed_bases else None)
  prefix = f"{args.scale}/s{steps}/vocab={'small' if vocab else 't5'}/"
  notes = _notes(args, steps, seed_bases, vocab, c,
                 checked=selection_lib.length_confirmed(
                     exp.data, prefix, steps, mlm.MODELS))
  table_name, figure_name = mlm.report_names(args.scale, steps)
  exp.write_table(
      f"MLM perplexity at equal capacity ({args.scale} scale, {steps} "
      "steps)",
      experiment.markdown_table(mlm.HEADERS,
                                mlm.table_rows(runs, sizes, base,
                                               untuned=True)),
      notes, name=table_name)
  fig, axes = experiment.figure(size=(8.0, 3.6))
  ax = axes[0, 0]
  experiment.plot_curves(ax, runs, "perplexity", mlm.LABELS.get)
  if base:
    experiment.baseline_lines(ax, {"unigram": base["unigram"],
                                   "0.6 x unigram": 0.6 * base["unigram"]})
  experiment.style_axes(ax, "step", "held-out MLM perplexity", yscale="log",
                        legend=8, legend_outside=True)
  exp.save_figure(fig, figure_name)


if __name__ == "__main__":
  main()
