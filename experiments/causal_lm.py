r"""A causal HyperMixer language model against Transformer, causal gMLP and
linear attention, at matched FLOPs per token.

The HyperMixer paper (Mai et al. 2023) leaves causal token mixing open. Here
query m's TM-MLP hidden layer is the prefix sum over keys n <= m,
``out_m = W2_m GELU(sum_{n<=m} W1_n v_n^T)``, computed by a chunked scan of
C tokens per step (``configs/c4_lm.py``, ``HyperMixing.causal``). Each token
needs its own [d, d'] hidden layer (the GELU sits between the prefix sum and
the output), so the mixing costs about ``2 C d d'`` FLOPs per token and layer
(the in-chunk prefix sum is a [C, C] product): its cost per token does not
grow with N, but a wide hypernetwork (d') or chunk (C) is expensive.

``--part=lm`` (default): four causal LMs of one width, each matched in
forward FLOPs per token at the training length N to the Transformer's (XLA's
count of the compiled forward, ``forward_flops``) through its FFN width:

* Transformer: pre-LN blocks, causal softmax attention, sinusoidal positions;
* HyperMixer: pre-LN blocks, causal HyperMixing (tied hypernetworks, the
  paper's default; hypernetwork width ``hyper_dim``, chunk ``chunk``),
  positions only in the hypernetworks (sinusoidal, Algorithm 1);
* gMLP: gMLP's own blocks (3x the layers, the gMLP paper's depth ratio),
  causal Toeplitz spatial weights W[i, j] = w[i - j], no position
  embeddings;
* linear attention: pre-LN blocks, causal elu+1 kernel attention,
  sinusoidal positions;

plus HyperMixer ablations along two axes, the hypernetwork width d'
(``--ablate_hyper_dims``, at the default C) and the chunk C
(``--ablate_chunks``, at the default d'; the function does not depend on C,
only its cost, so at matched FLOPs a smaller C leaves a wider FFN), each
matched the same way where its mixing leaves an FFN of at least
``MIN_FFN`` (else it keeps the Transformer's FFN and its larger FLOPs are
reported). All are trained on the C4 train sample (unpacked rows of N = 256
tokens, the 8k SentencePiece vocabulary trained on that sample), 3 seeds,
with the same optimiser, schedule and batches, and scored on held-out
WikiText-2 validation articles (long documents, so that a 1,024-token
context exists; ``data.text_layout='wikitext'``): every token of the first
``eval_rows`` rows the unshuffled split gives at N = 1,024, read again as
rows of 256 and 512 (the documents are cut at multiples of N, so the same
tokens are scored at every length, only their context differs). Beside them
unigram and add-k bigram perplexity of the same scored positions, counted on
the train tokens (the bigram reads the row's previous token; the first token
of a row, whose previous input is BOS, is scored by the unigram).

``--select_hyper_dims=16,32,64``: HyperMixer's hypernetwork width chosen
among these, each matched in FLOPs, by one run per width (seed 100) trained
on the C4 sample less every 10th document and scored on those documents
(their digests recorded under ``c4_split``); the held-out WikiText rows are
never read in the choice. The chosen width then trains ``--seeds`` on the
whole sample, as every model does, and is judged against the Transformer.

``--tune``: every model of ``--models`` tuned alike, its learning rate and
warm-up chosen among ``selection.settings`` on the same carved documents
(seed 100), then ``--seeds`` at each model's choice trained on the other
documents and scored on the held-out rows: ``table_tuned.md`` (with
``--select_hyper_dims``: HyperMixer at the d' that selection chose).

Length: every run, trained at N = 256, is evaluated at 256 / 512 / 1,024.
All four models are built with ``max_len = 1024`` so all can run there:
sinusoidal positions (Transformer, linear attention, HyperMixer's
hypernetworks) extrapolate to positions never trained; gMLP's Toeplitz
weights for offsets >= 256 keep their initial values (|w| <= 1e-3 / 1024),
so its context stays the trained 256 tokens. A learned position table could
not run beyond its trained rows and is not used.

``--scale=paper`` declares the paper-size setting (``PAPER_SIZES``, full C4
from TFDS, N = 1,024) but is not run by this script: train those configs with
``hypermixer_jax.main`` on a pod.

``--part=scaling``: time and memory per token of one training step's
forward + backward (gradient of the LM loss) of each matched model on one
row of N = 256 ... 8,192 tokens: memory from XLA's compiled memory analysis
(temporaries + arguments + outputs), time the median of interleaved rounds.

  python experiments/causal_lm.py --scale=small \
      --out=experiments/results/causal_lm
  python experiments/causal_lm.py --part=scaling \
      --out=experiments/results/causal_lm_scaling

Writes ``results.json``, ``table.md`` and ``causal_lm.png`` (held-out
perplexity against step; against evaluation length) into ``--out``
(``--part=scaling``: ``causal_lm_scaling.png``). The machine's other load
changes the measured tokens/s and times: compare them only within one run.
"""
from __future__ import annotations

import pathlib
import statistics

from hypermixer_jax import experiment
from hypermixer_jax.experiment import causal
from hypermixer_jax.experiment import mlm
# The study's models, configs and scoring, named here for tests and readers.
# pylint: disable=g-importing-member,unused-import
from hypermixer_jax.experiment.causal import digest
from hypermixer_jax.experiment.causal import forward_flops
from hypermixer_jax.experiment.causal import held_out_rows
from hypermixer_jax.experiment.causal import held_out_sets
from hypermixer_jax.experiment.causal import model_config
from hypermixer_jax.experiment.causal import model_configs
from hypermixer_jax.experiment.causal import MODELS
from hypermixer_jax.experiment.causal import PAPER_SIZES
from hypermixer_jax.experiment.causal import perplexity
from hypermixer_jax.experiment.causal import run_cell
from hypermixer_jax.experiment.causal import SCALING_LENGTHS
from hypermixer_jax.experiment.causal import SMALL
from hypermixer_jax.experiment.causal import token_nll
from hypermixer_jax.experiment.causal import train_config
# pylint: enable=g-importing-member,unused-import


def lm_part(args, exp) -> None:
  shared = pathlib.Path(args.shared)
  s = dict(SMALL if args.scale == "small" else PAPER_SIZES)
  if args.scale == "paper":
    raise NotImplementedError(
        "--scale=paper needs the full C4 from TFDS and a pod; its sizes are "
        "PAPER_SIZES, run them with main.py and configs/c4_lm.py.")
  vocab = mlm.c4_vocab(exp, shared)
  models = experiment.split(args.models)
  configs = model_configs(s, vocab["model_vocab_size"], models,
                          experiment.split(args.ablate_hyper_dims, int),
                          experiment.split(args.ablate_chunks, int),
                          causal.recorded_models(exp))
  names = models + [k for k in configs if k not in MODELS]
  sizes = causal.record_sizes(exp, configs, names, s["seq_len"])
  steps = args.steps or s["steps"]
  prefix = f"{args.scale}/s{steps}"
  lengths = tuple(s["eval_lengths"])
  base_cfg = train_config(configs["attention"], args.scale, shared, vocab,
                          steps=steps, sizes=s)
  held = held_out_sets(base_cfg, lengths, max(lengths), s["eval_rows"])
  if len({digest(a) for a in held.values()}) != 1:
    raise AssertionError("the held-out lengths score different tokens.")
  bases = exp.baseline(prefix, lambda: causal.count_baselines(
      base_cfg, held, lengths, vocab["model_vocab_size"]))
  if args.tune:   # every model's search, then its seeds at its choice
    causal.tune(exp, args, (s, steps, prefix), vocab, configs, sizes, held,
                models, base_cfg)
    return
  seeds = experiment.split(args.seeds, int)
  ablation_seeds = seeds[:args.ablation_seeds]

  def run(cell, key):
    name = cell["model"]
    cfg = train_config(configs[name], args.scale, shared, vocab,
                       steps=steps, seed=cell["seed"], sizes=s)
    return run_cell(cfg, exp.workdir(key), held, {
        k: v for k, v in sizes[name].items() if k != "model"})
  runs: dict[str, list] = {}
  for name in names:
    # A run recorded at another FFN width (an earlier FLOP match) is retired.
    runs.update(exp.cells(prefix, experiment.grid(
        model=[name], seed=seeds if name in MODELS else ablation_seeds), run,
        expect=lambda cell: {"params": sizes[cell["model"]]["params"]}))
  extra, chosen = "", None
  if args.select_hyper_dims:
    extra, chosen = causal.select_hyper_dim(
        exp, args, (s, steps, prefix), vocab, configs, runs, run)
  notes = causal.lm_notes(base_cfg, s, steps=steps, seeds=args.seeds,
                          ablation_seeds=ablation_seeds, bases=bases,
                          vocab=vocab)
  causal.write_lm_report(exp, runs, bases, s, notes + " ".join(
      causal.gap_verdicts(runs, s["seq_len"], untuned=True)), extra, chosen)


def _time_length(exp, args, configs, names, n: int, rows: list) -> None:
  """Compiles and times every model's training step at length ``n`` (those
  within ``--max_gib``), recording each in ``exp`` and a row in ``rows``."""
  import jax  # pylint: disable=g-import-not-at-top
  calls, prepared = {}, {}
  for name in names:
    compiled, params, batch = causal.compiled_train_step(configs[name], n)
    need = experiment.compiled_bytes(compiled)
    key = experiment.cell_key("scaling", {"model": name, "n": n})
    prepared[key] = dict(
        model=name, n=n, memory_bytes=need,
        temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes))
    if need > args.max_gib * 2 ** 30:
      prepared[key]["skipped"] = f"needs {need / 2 ** 30:.1f} GiB"
      continue
    jax.block_until_ready(compiled(params, batch))
    calls[key] = (lambda f=compiled, p=params, b=batch:
                  jax.block_until_ready(f(p, b)))
  times = experiment.time_rounds(calls, args.rounds)
  for key, rec in prepared.items():
    if key in times:
      rec["time_s"] = statistics.median(times[key])
    exp.runs[key] = rec
    rows.append([causal.label(rec["model"]), n,
                 f"{1e6 * rec['time_s'] / n:.1f}" if "time_s" in rec
                 else rec.get("skipped", ""),
                 f"{rec['memory_bytes'] / n / 1024:.1f}"])
    print(rows[-1], flush=True)
  exp.save()


def scaling_part(args, exp) -> None:
  """Time and memory per token of forward + backward against N."""
  vocab_size = -(-(mlm.VOCAB_PIECES + 100) // 128) * 128
  names = experiment.split(args.models)
  configs = model_configs(dict(SMALL), vocab_size, names)
  rows = []
  for n in experiment.split(args.lengths, int):
    _time_length(exp, args, configs, names, n, rows)
  exp.write_table(
      "Causal LMs: training step cost per token against N (one row)",
      experiment.markdown_table(
          ["model", "N", "fwd+bwd µs / token", "memory KiB / token"], rows),
      "The small-scale matched models (no training), forward + backward of "
      "the LM loss on one row of N tokens, float32, on this machine's CPU "
      f"(shared: compare within this run); time: median of {args.rounds} "
      "interleaved rounds; memory: XLA's compiled memory analysis "
      "(temporaries + arguments + outputs) per token.")
  causal.plot_scaling(exp, names)


def main() -> None:
  p = experiment.parser("causal_lm", __doc__, report_only=True, data_dir="",
                        models=MODELS, seeds="0,1,2", steps=0,
                        lengths=SCALING_LENGTHS)
  p.add_argument("--part", choices=("lm", "scaling"), default="lm")
  p.add_argument("--ablate_hyper_dims", default="32,128",
                 help="HyperMixer ablation axis: hypernetwork widths d' (at "
                 "the default chunk)")
  p.add_argument("--ablate_chunks", default="8,64",
                 help="HyperMixer ablation axis: chunk sizes C (at the "
                 "default d')")
  p.add_argument("--select_hyper_dims", default="",
                 help="choose HyperMixer's hypernetwork width d' among "
                 "these (each matched in FLOPs) on a validation split carved "
                 "from the C4 sample, then run the chosen width's --seeds "
                 "(e.g. 16,32,64; empty: no selection)")
  experiment.tune_flags(p, "C4 documents")
  p.add_argument("--ablation_seeds", type=int, default=1,
                 help="seeds of each ablation cell (the first of --seeds)")
  p.add_argument("--rounds", type=int, default=3,
                 help="--part=scaling: interleaved timing rounds")
  p.add_argument("--max_gib", type=float, default=6.0,
                 help="--part=scaling: skip a step needing more memory")
  args = experiment.parse(p)
  exp = experiment.Experiment(args.out, args)
  if args.part == "scaling":
    scaling_part(args, exp)
  else:
    lm_part(args, exp)


if __name__ == "__main__":
  main()
