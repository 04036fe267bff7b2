r"""Latency vs sequence length: gMLP (dense and FFT-Toeplitz W) and a Transformer.

The gMLP paper's authors answered a reviewer (NeurIPS 2021, OpenReview
discussion of paper 7105, in ``../shared/papers/gmlp_pay_attention_to_mlps_zh.txt``)
with the inference latency of gMLP-base for text classification on a V100:
13 ms at 32 tokens up to 386 ms at 4096, sub-linear while the channel
projections (O(n d^2)) dominate, super-linear once the spatial projection
(O(d n^2)) does. They note that a Toeplitz W could be applied by FFT in
O(n log n) but do not measure it. This experiment measures, per sequence
length, the forward latency (jitted, batch 1, ``deterministic=True``, median
of repeats after a warm-up call; the three models timed in alternation, so
that the load of a shared machine hits them alike) of three text classifiers
built by the zoo:

  * gMLP, dense W [n, n] (``toeplitz=False``), no position embeddings;
  * gMLP, Toeplitz W applied by FFT (``toeplitz=True, use_fft=True``);
  * a BERT-style post-LN Transformer (heads of 64, learned positions).

  --scale=paper  gMLP-base as in the paper's scaling table matched to
                 BERT-base (36 layers, d=512, d_ffn=3072, ~102M with a 30,522
                 vocabulary) against BERT-base (12 layers, d=768, d_ffn=3072,
                 12 heads, ~110M); sequence 32 ... 4096. The rebuttal does not
                 give its batch size or the exact gMLP-base config: batch 1
                 and this pairing are our reading.
  --scale=small  the same pairing shrunk for a shared 2-core CPU: gMLP 3
                 layers d=256 d_ffn=1536 against a Transformer of 1 layer
                 d=384 d_ffn=1536 (6 heads); about the same non-embedding
                 parameters outside the spatial weights, the paper's 3:1 layer
                 ratio; sequence 32 ... 4096 (``--lengths`` to change).

  python experiments/gmlp_latency.py --scale=small --out=experiments/results/gmlp_latency

Writes ``results.json``, ``table.md`` and ``gmlp_latency.png`` (latency
against length, log-log) into ``--out``. Latencies on a CPU shared with other
jobs are upper bounds; compare the models' curves with each other, and the
paper's numbers (V100) only in shape.
"""
from __future__ import annotations

import platform
import statistics
import time
from typing import Any, Callable, Sequence

import ml_collections

from hypermixer_jax import experiment

# gMLP-base text classification, V100 (authors' rebuttal), ms.
PAPER_MS = {32: 13, 64: 13, 128: 14, 256: 22, 512: 31, 1024: 65, 2048: 148,
            4096: 386}
LENGTHS = tuple(PAPER_MS)
VARIANTS = ("gmlp_dense", "gmlp_fft", "transformer")
LABELS = {"gmlp_dense": "gMLP, dense W", "gmlp_fft": "gMLP, Toeplitz W by FFT",
          "transformer": "Transformer"}
# scale -> (gMLP layers, d, d_ffn), (Transformer layers, d, d_ffn)
SIZES = {
    "paper": ((36, 512, 3072), (12, 768, 3072)),
    "small": ((3, 256, 1536), (1, 384, 1536)),
}
VOCAB = 30522            # BERT's WordPiece vocabulary, as in the paper's setup


def model_config(variant: str, length: int, scale: str = "small",
                 sizes: dict | None = None) -> ml_collections.ConfigDict:
  """The zoo model config of ``variant`` for sequences of ``length``."""
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  if variant not in VARIANTS:
    raise ValueError(f"variant {variant!r}: expected one of {VARIANTS}.")
  gmlp_size, tf_size = (sizes or SIZES)[scale]
  c = models.default_model_config()
  c.update(family="text", head="classify", num_classes=2, vocab_size=VOCAB,
           max_len=length, dropout_rate=0.0, type_vocab_size=0)
  if variant == "transformer":
    layers, d, f = tf_size
    c.update(mixer="attention", block="post_ln", num_layers=layers,
             d_model=d, d_ffn=f, position_embeddings="learned")
    c.mixer_kwargs = ml_collections.ConfigDict(
        dict(num_heads=max(1, d // 64)))
  else:
    layers, d, f = gmlp_size
    fft = variant == "gmlp_fft"
    c.update(mixer="gmlp", block="gmlp", num_layers=layers, d_model=d,
             d_ffn=f, position_embeddings="none")
    c.mixer_kwargs = ml_collections.ConfigDict(
        dict(toeplitz=fft, use_fft=fft))
  return c


def _prepare(config: ml_collections.ConfigDict, batch: int, seed: int):
  """``(call, params count, params without the token table)`` of a model."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  model = models.build_model(config)
  tokens = jax.random.randint(jax.random.key(seed), (batch, config.max_len),
                              1, config.vocab_size)
  params = jax.jit(model.init)(jax.random.key(seed + 1), tokens)["params"]
  fwd = jax.jit(lambda p, x: model.apply({"params": p}, x,
                                         deterministic=True))
  count = embed = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    size = int(np.prod(leaf.shape))
    count += size
    if "token_embed" in [getattr(k, "key", None) for k in path]:
      embed += size
  return (lambda: jax.block_until_ready(fwd(params, tokens))), count, (
      count - embed)


def measure_many(configs: dict[str, ml_collections.ConfigDict], *,
                 batch: int = 1, repeats: int = 5, min_seconds: float = 0.0,
                 seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter
                 ) -> dict[str, dict[str, Any]]:
  """Forward latency of each config's model on ``[batch, max_len]`` tokens.

  Per model one jitted ``apply`` (inference, no dropout); its first call
  (compilation + one run) is timed apart as ``compile_s``. Then the models
  are timed in rounds, one call of each per round (so a change of the
  machine's load hits all of them alike), for at least ``repeats`` rounds
  and more while each model's calls add up to less than ``min_seconds``;
  every call is timed to ``block_until_ready``. Returns per name, in
  milliseconds: ``median_ms``, ``min_ms``, ``times_ms`` (every call), and
  ``params`` / ``params_non_embedding`` (without the token table).
  """
  if repeats < 1:
    raise ValueError(f"repeats={repeats}: need at least one timed call.")
  calls, out = {}, {}
  for name, config in configs.items():
    call, count, non_embed = _prepare(config, batch, seed)
    t0 = clock()
    call()
    calls[name] = call
    out[name] = {"compile_s": clock() - t0, "params": count,
                 "params_non_embedding": non_embed, "batch": batch,
                 "length": config.max_len}
  times = experiment.time_rounds(calls, repeats, min_seconds, clock)
  for name, r in out.items():
    r["times_ms"] = [1e3 * t for t in times[name]]
    r["median_ms"] = statistics.median(r["times_ms"])
    r["min_ms"] = min(r["times_ms"])
  return out


def measure(config: ml_collections.ConfigDict, **kw) -> dict[str, Any]:
  """``measure_many`` of one model."""
  return measure_many({"model": config}, **kw)["model"]


def table_rows(runs: dict[str, Any], lengths: Sequence[int],
               variants: Sequence[str] = VARIANTS) -> list[list[Any]]:
  """One row per length: our "median (min)" ms per variant, the paper's ms."""
  rows = []
  for n in lengths:
    row = [n]
    for v in variants:
      r = runs.get(f"{v}/n{n}")
      row.append("-" if r is None else
                 f"{r['median_ms']:.4g} ({r['min_ms']:.4g})")
    row.append(PAPER_MS.get(n, "-"))
    rows.append(row)
  return rows


def main() -> None:
  p = experiment.parser("gmlp_latency", __doc__, lengths=LENGTHS)
  p.add_argument("--repeats", type=int, default=5,
                 help="timed calls per point (after one warm-up call)")
  p.add_argument("--min_seconds", type=float, default=1.0,
                 help="keep timing a point until its calls add up to this")
  p.add_argument("--batch", type=int, default=1)
  args = experiment.parse(p)
  import jax  # pylint: disable=g-import-not-at-top
  lengths = experiment.split(args.lengths, int)
  exp = experiment.Experiment(args.out, args)
  device = jax.devices()[0]
  exp.save(device=f"{device.platform}: {device.device_kind}",
           host=platform.processor() or platform.machine())
  for n in lengths:
    exp.run(f"n{n}", lambda n=n: {"variants": measure_many(
        {v: model_config(v, n, args.scale) for v in VARIANTS},
        batch=args.batch, repeats=args.repeats,
        min_seconds=args.min_seconds)})
  runs = {f"{v}/n{n}": r for n in lengths if f"n{n}" in exp.runs
          for v, r in exp.runs[f"n{n}"]["variants"].items()}
  headers = (["sequence"] + [f"{LABELS[v]}, ms" for v in VARIANTS]
             + ["paper gMLP-base, V100 (ms)"])
  table = experiment.markdown_table(headers, table_rows(runs, lengths))
  (gl, gd, gf), (tl, td, tf) = SIZES[args.scale]
  n0 = lengths[0]
  sizes = ", ".join(
      f"{LABELS[v]} {runs[f'{v}/n{n0}']['params_non_embedding']:,}"
      for v in VARIANTS if f"{v}/n{n0}" in runs)
  notes = (
      f"Forward latency, jitted, batch {args.batch}: median (min) of at least "
      f"{args.repeats} calls after a warm-up, the models called in turn, on {exp.data['device']}. "
      f"gMLP: {gl} layers, d={gd}, d_ffn={gf}; Transformer: {tl} layers, "
      f"d={td}, d_ffn={tf}, heads of 64; vocabulary {VOCAB}. Parameters "
      f"without the token embedding at length {n0}: {sizes}. The paper's "
      "column is gMLP-base on a V100 (authors' rebuttal); compare shapes, "
      "not values.")
  exp.write_table(f"gMLP latency vs sequence length ({args.scale} scale)",
                  table, notes)
  _plot(exp, runs, lengths)


def _plot(exp, runs, lengths) -> None:
  fig, axes = experiment.figure()
  ax = axes[0, 0]
  for v in VARIANTS:
    pts = [(n, runs[f"{v}/n{n}"]["median_ms"]) for n in lengths
           if f"{v}/n{n}" in runs]
    ax.plot(*zip(*pts), marker="o", label=f"{LABELS[v]} (ours, CPU)")
  paper = [(n, PAPER_MS[n]) for n in lengths if n in PAPER_MS]
  if paper:
    ax.plot(*zip(*paper), marker="s", ls="--", color="grey",
            label="gMLP-base, V100 (paper)")
  experiment.style_axes(ax, "sequence length", "forward latency (ms)",
                        xscale="log2", yscale="log")
  exp.save_figure(fig, "gmlp_latency")


if __name__ == "__main__":
  main()
