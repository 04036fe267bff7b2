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

import hashlib
import pathlib
import statistics

import ml_collections
import numpy as np

from hypermixer_jax import baselines
from hypermixer_jax import experiment
from hypermixer_jax.experiment import mlm

MODELS = ("attention", "hypermixer", "gmlp", "linear_attention")
LABELS = {"attention": "Transformer", "hypermixer": "HyperMixer (causal)",
          "gmlp": "gMLP (causal)", "linear_attention": "Linear attention"}
SMALL = dict(d_model=128, num_layers=4, d_ffn=512, heads=2, gmlp_depth=3,
             hyper_dim=64, chunk=16, seq_len=256, max_len=1024,
             batch_size=16, steps=400, lr=2e-3, warmup=40, evals=5,
             eval_batch_size=16, eval_batches=4, eval_rows=48,
             eval_lengths=(256, 512, 1024))
PAPER_SIZES = dict(d_model=768, num_layers=12, d_ffn=3072, heads=12,
                   gmlp_depth=3, hyper_dim=256, chunk=64, seq_len=1024,
                   max_len=4096, batch_size=128, steps=100_000, lr=6e-4,
                   warmup=2_000, evals=20, eval_batch_size=64,
                   eval_batches=50, eval_rows=2048,
                   eval_lengths=(1024, 2048, 4096))
SCALING_LENGTHS = tuple(2 ** k for k in range(8, 14))      # 256 ... 8192
MIN_FFN = 64         # ablation cells matched only down to this FFN width
TARGET_GAP = 0.05    # HyperMixer within 5% of the Transformer's perplexity


# ---------------------------------------------------------------------------
# Models.
# ---------------------------------------------------------------------------
def model_config(mixer: str, s: dict, vocab_size: int, *,
                 hyper_dim: int | None = None, chunk: int | None = None
                 ) -> ml_collections.ConfigDict:
  """The causal LM of ``mixer`` at the sizes ``s`` (before FLOP matching)."""
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  m = models.default_model_config()
  m.update(family="text", head="causal_lm", mixer=mixer,
           num_layers=s["num_layers"], d_model=s["d_model"],
           d_ffn=s["d_ffn"], max_len=s["max_len"], vocab_size=vocab_size,
           type_vocab_size=0, dropout_rate=0.0, block="pre_ln",
           position_embeddings="sinusoidal")
  if mixer in ("attention", "linear_attention"):
    m.mixer_kwargs = ml_collections.ConfigDict(dict(num_heads=s["heads"]))
  elif mixer == "hypermixer":
    # Positions enter the hypernetworks only (the zoo's HyperMixer models).
    m.position_embeddings = "none"
    m.mixer_kwargs = ml_collections.ConfigDict(dict(
        hyper_dim=hyper_dim or s["hyper_dim"], tied=True,
        causal_chunk_size=chunk or s["chunk"]))
  elif mixer == "gmlp":
    m.update(block="gmlp", position_embeddings="none",
             num_layers=s["gmlp_depth"] * s["num_layers"])
    m.mixer_kwargs = ml_collections.ConfigDict(dict(toeplitz=True))
  else:
    raise ValueError(f"mixer {mixer!r}; this experiment compares "
                     f"{', '.join(MODELS)}.")
  return m


def _counted(m: ml_collections.ConfigDict, n: int):
  """``(config, length)`` whose XLA FLOP count, divided by its tokens, is
  ``m``'s forward FLOPs per token at length ``n``.

  XLA's cost analysis counts a loop body once. Causal HyperMixing scans N / C
  chunks whose work per token does not depend on N, so it is counted on one
  chunk (length C); attention is counted on its materialised form (the CPU
  runs long rows block-wise in a scan).
  """
  c = ml_collections.ConfigDict(m.to_dict())
  if c.mixer == "hypermixer":
    chunk = int(c.mixer_kwargs.causal_chunk_size)
    if n % chunk:
      raise ValueError(f"length {n} is not a multiple of the HyperMixer "
                       f"chunk {chunk}; pick N a multiple of the chunk.")
    return c, chunk
  if c.mixer == "attention":
    c.mixer_kwargs.implementation = "xla"
  return c, n


def forward_flops(m: ml_collections.ConfigDict, n: int) -> float:
  """XLA's count of ``m``'s forward FLOPs per token on one row of ``n``
  tokens (all real; the unpacked rows' ``segment_ids`` given, as in
  training)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import metrics  # pylint: disable=g-import-not-at-top
  c, length = _counted(m, n)
  model = models.build_model(c)
  x = jax.ShapeDtypeStruct((1, length), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.key(0), x)

  def fwd(p, tokens):
    return model.apply(p, tokens, segment_ids=jnp.ones_like(tokens),
                       deterministic=True)
  flops = metrics.step_flops(jax.jit(fwd).lower(params, x).compile())
  return float(flops) / length


def match_flops(m: ml_collections.ConfigDict, target: float, n: int,
                multiple: int = 16) -> ml_collections.ConfigDict:
  """``m`` with the ``d_ffn`` (a multiple of ``multiple``, at least
  ``multiple``) whose forward FLOPs per token are nearest ``target``.

  FLOPs are affine in d_ffn (the FFN, or gMLP's channel projections, and
  gMLP's spatial product), so two counts give the line.
  """
  return experiment.match_field(
      m, "d_ffn", lambda c: forward_flops(c, n), target, lo=4 * multiple,
      hi=16 * multiple, multiple=multiple)


def model_configs(s: dict, vocab_size: int, mixers=MODELS, hyper_dims=(),
                  chunks=()) -> dict[str, ml_collections.ConfigDict]:
  """The matched models: ``{name: config}``, those of ``mixers`` (the
  Transformer always, the reference) and the HyperMixer ablations
  ``hypermixer_h<d'>_c<C>``."""
  bert = model_config("attention", s, vocab_size)
  target = forward_flops(bert, s["seq_len"])
  out = {"attention": bert}
  for mixer in mixers:
    if mixer != "attention":
      out[mixer] = match_flops(model_config(mixer, s, vocab_size), target,
                               s["seq_len"])
  cells = [(h, s["chunk"]) for h in hyper_dims] + [
      (s["hyper_dim"], c) for c in chunks]
  for h, c in cells:
    if (h, c) == (s["hyper_dim"], s["chunk"]):
      continue
    m = model_config("hypermixer", s, vocab_size, hyper_dim=h, chunk=c)
    matched = match_flops(m, target, s["seq_len"])
    # A mixing that alone nearly fills the budget keeps the Transformer's
    # FFN instead of losing it (and is reported with its larger FLOPs).
    out[f"hypermixer_h{h}_c{c}"] = matched if matched.d_ffn >= MIN_FFN else m
  return out


def sizes_of(m: ml_collections.ConfigDict, n: int) -> dict:
  """Parameters (total, non-embedding) and forward FLOPs per token at n."""
  p = mlm.params(m)
  return {"params": p["total"], "non_embedding": p["non_embedding"],
          "flops_per_token": forward_flops(m, n)}


# ---------------------------------------------------------------------------
# Training and the held-out set.
# ---------------------------------------------------------------------------
def train_config(model: ml_collections.ConfigDict, scale: str,
                 shared: pathlib.Path | None, vocab: dict | None,
                 data_dir: str = "", steps: int | None = None, seed: int = 0
                 ) -> ml_collections.ConfigDict:
  """``configs/c4_lm.py``'s training config with ``model``: the same for
  every model but the model (and ``seed``)."""
  c = mlm.lm_train_config("c4_lm.py", model,
                          SMALL if scale == "small" else PAPER_SIZES, steps,
                          seed)
  if scale == "small":
    # Unpacked rows: each row one document's chunk, the same rows for all.
    c.data.packing = False
    c.data.vocab_path = vocab["path"]
    mlm.small_text_data(c, shared)
    c.log_every = 20
  else:
    c.data.data_dir = data_dir or None
  return c


def held_out_rows(config: ml_collections.ConfigDict, n: int, ref_len: int,
                  ref_rows: int) -> dict[str, np.ndarray]:
  """The held-out set at length ``n``: the rows of the unshuffled validation
  split holding exactly the tokens of its first ``ref_rows`` rows at length
  ``ref_len`` (documents are cut at multiples of the length, so rows of a
  length dividing ``ref_len`` tile them). ``{'inputs', 'targets', 'weights',
  'segment_ids', ...}``."""
  return held_out_sets(config, (n,), ref_len, ref_rows)[n]


def held_out_sets(config: ml_collections.ConfigDict, lengths, ref_len: int,
                  ref_rows: int) -> dict[int, dict[str, np.ndarray]]:
  """``held_out_rows`` of each length in ``lengths``, the reference rows
  read once."""
  def rows(length, count=None):
    c = ml_collections.ConfigDict(config.data.to_dict())
    c.seq_len = length
    arrays = experiment.pipeline_arrays(c, config.eval_split, batch_size=64)
    return {k: v[:count] for k, v in arrays.items()}
  for n in lengths:
    if ref_len % n:
      raise ValueError(f"evaluation length {n} must divide the longest, "
                       f"{ref_len}.")
  ref = rows(ref_len, ref_rows)
  total = int(ref["weights"].sum())
  held = {}
  for n in lengths:
    if n == ref_len:
      held[n] = ref
      continue
    out = rows(n)
    cum = np.cumsum(out["weights"].sum(1))
    k = int(np.searchsorted(cum, total)) + 1
    if k > len(cum) or cum[k - 1] != total:
      raise ValueError(f"rows of length {n} do not tile the first "
                       f"{ref_rows} rows of length {ref_len}.")
    held[n] = {key: v[:k] for key, v in out.items()}
  return held


def digest(arrays: dict[str, np.ndarray]) -> str:
  """Digest of the scored tokens (targets where weight > 0, in order)."""
  return hashlib.sha256(np.ascontiguousarray(
      arrays["targets"][arrays["weights"] > 0]).tobytes()).hexdigest()[:16]


def _nll(model, params, batch):
  """``[B, N]`` weighted negative log-likelihood of every target."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import heads  # pylint: disable=g-import-not-at-top
  inputs, kwargs = heads.model_inputs(batch, "causal_lm")
  logits = model.apply({"params": params}, inputs, deterministic=True,
                       **kwargs)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  tok = jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
  return -tok * batch["weights"]


def token_nll(model_config_: ml_collections.ConfigDict, params,
              arrays: dict[str, np.ndarray], batch_size: int = 16
              ) -> np.ndarray:
  """``[rows, N]`` negative log-likelihood of every target (0 on padding):
  the loss the training loop's evaluation sums, kept per position."""
  import jax  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  model = models.build_model(model_config_)
  nll = jax.jit(lambda p, batch: _nll(model, p, batch))
  keys = ("inputs", "targets", "weights", "segment_ids", "positions")
  out = []
  for i in range(0, len(arrays["inputs"]), batch_size):
    batch = {k: arrays[k][i:i + batch_size] for k in keys if k in arrays}
    pad = batch_size - len(batch["inputs"])
    if pad:  # one compiled shape: zero rows, zero weights
      batch = {k: np.pad(v, ((0, pad), (0, 0))) for k, v in batch.items()}
    out.append(np.asarray(nll(params, batch))[:batch_size - pad])
  return np.concatenate(out)


def perplexity(nll: np.ndarray, weights: np.ndarray) -> float:
  return float(np.exp(nll.sum() / weights.sum()))


def run_cell(config, workdir: str, held: dict[int, dict], sizes: dict
             ) -> dict:
  """Trains one cell and scores it on the held-out tokens at every length."""
  result = experiment.train(config, workdir, with_params=True)
  params = result.pop("params")
  lengths = {}
  for n, arrays in held.items():
    c = ml_collections.ConfigDict(config.model.to_dict())
    nll = token_nll(c, params, arrays, batch_size=max(1, 4096 // n))
    lengths[str(n)] = {"perplexity": perplexity(nll, arrays["weights"]),
                       "digest": digest(arrays)}
  rates = [r["tokens_per_sec"] for s, r in sorted(result["train_curve"].items())
           if "tokens_per_sec" in r][1:]   # the first window includes compile
  return dict(result, lengths=lengths, **sizes,
              train_tokens_per_sec=(statistics.median(rates) if rates
                                    else float("nan")))


# ---------------------------------------------------------------------------
# Tables and figures.
# ---------------------------------------------------------------------------
def _ppl(run: dict, n: int) -> float:
  return float(run["lengths"][str(n)]["perplexity"])


def table_rows(runs: dict, sizes: dict, base: dict | None, n: int) -> list:
  rows = []
  ref = [_ppl(r, n) for r in runs.get("attention", [])]
  for name, seed_runs in runs.items():
    m, sz = sizes[name]["model"], sizes[name]
    ppl = [_ppl(r, n) for r in seed_runs]
    mean = experiment.mean_sd(ppl)[0] if ppl else float("nan")
    gap = (f"{100 * (mean / experiment.mean_sd(ref)[0] - 1):+.1f}%"
           if ref and ppl and name != "attention" else "")
    tps = [r["train_tokens_per_sec"] for r in seed_runs]
    mixer = m["mixer_kwargs"]
    extra = (f"d'={mixer['hyper_dim']}, C={mixer['causal_chunk_size']}"
             if m["mixer"] == "hypermixer" else "")
    rows.append([label(name), extra, m["num_layers"], m["d_model"],
                 m["d_ffn"], f"{sz['params'] / 1e6:.3f}M",
                 f"{sz['non_embedding'] / 1e6:.3f}M",
                 f"{sz['flops_per_token'] / 1e6:.2f}M",
                 f"{statistics.median(tps):.0f}" if tps else "",
                 experiment.fmt_mean_sd(ppl) or "not run",
                 f"{mean / base['unigram']:.2f}" if base and ppl else "",
                 gap])
  if base:
    rows += experiment.perplexity_baseline_rows(HEADERS, base, "held-out ppl",
                                                "/ unigram")
  return rows


HEADERS = ["model", "mixer", "layers", "d", "d_ffn", "params", "non-embedding",
           "fwd FLOPs/token", "train tokens/s", "held-out ppl", "/ unigram",
           "vs Transformer"]


def label(name: str, ablation_name: bool = False) -> str:
  """The table's name of a model; an ablation's with its key when
  ``ablation_name``."""
  if name in LABELS:
    return LABELS[name]
  return f"HyperMixer ablation ({name})" if ablation_name else (
      "HyperMixer ablation")


def length_rows(runs: dict, bases: dict, lengths) -> list:
  rows = []
  for name, seed_runs in runs.items():
    rows.append([label(name, ablation_name=True)]
                + [experiment.fmt_mean_sd([_ppl(r, n) for r in seed_runs])
                   for n in lengths])
  for kind in ("unigram", "bigram"):
    rows.append([kind] + [f"{bases[str(n)][kind]:.1f}" for n in lengths])
  return rows


def _plot(exp, runs, base, lengths) -> None:
  fig, axes = experiment.figure(ncols=2)
  ax, bx = axes[0, 0], axes[0, 1]
  experiment.plot_curves(ax, runs, "perplexity",
                         lambda name: LABELS.get(name, name))
  for i, seed_runs in enumerate(runs.values()):
    means = [experiment.mean_sd([_ppl(r, n) for r in seed_runs])[0]
             for n in lengths]
    bx.plot(lengths, means, marker="o", color=f"C{i}")
  if base:
    for a in (ax, bx):
      experiment.baseline_lines(a, {"unigram": base["unigram"],
                                    "0.6 x unigram": 0.6 * base["unigram"]})
  experiment.style_axes(ax, "step",
                        "held-out perplexity (N = 256, curve subset)",
                        yscale="log")
  experiment.style_axes(bx, "evaluation length N (trained at 256)",
                        "held-out perplexity, mean of seeds", xscale="log2",
                        yscale="log", legend=0)
  exp.save_figure(fig, "causal_lm")


# ---------------------------------------------------------------------------
# Parts.
# ---------------------------------------------------------------------------
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
                          experiment.split(args.ablate_chunks, int))
  names = models + [k for k in configs if k not in MODELS]
  sizes = exp.data.get("sizes", {})
  for name in names:
    if name not in sizes or sizes[name]["model"] != configs[name].to_dict():
      sizes[name] = {"model": configs[name].to_dict(),
                     **sizes_of(configs[name], s["seq_len"])}
  exp.save(sizes=sizes)
  steps = args.steps or s["steps"]
  prefix = f"{args.scale}/s{steps}"
  lengths = tuple(s["eval_lengths"])
  base_cfg = train_config(configs["attention"], args.scale, shared, vocab,
                          steps=steps)
  held = held_out_sets(base_cfg, lengths, max(lengths), s["eval_rows"])
  if len({digest(a) for a in held.values()}) != 1:
    raise AssertionError("the held-out lengths score different tokens.")
  def count_baselines():
    train = experiment.pipeline_arrays(base_cfg.data, "train")
    return {**{str(n): dict(baselines.lm_baselines(
        train["targets"], held[n], vocab_size=vocab["model_vocab_size"],
        causal=True), digest=digest(held[n])) for n in lengths},
            "train_tokens": int(train["weights"].sum())}
  bases = exp.baseline(prefix, count_baselines)
  runs: dict[str, list] = {}
  seeds = experiment.split(args.seeds, int)
  ablation_seeds = seeds[:args.ablation_seeds]

  def run(cell, key):
    name = cell["model"]
    cfg = train_config(configs[name], args.scale, shared, vocab,
                       steps=steps, seed=cell["seed"])
    return run_cell(cfg, exp.workdir(key), held, {
        k: v for k, v in sizes[name].items() if k != "model"})
  for name in names:
    # A run recorded at another FFN width (an earlier FLOP match) is retired.
    runs.update(exp.cells(prefix, experiment.grid(
        model=[name], seed=seeds if name in MODELS else ablation_seeds), run,
        expect=lambda cell: {"params": sizes[cell["model"]]["params"]}))
  base = bases[str(s["seq_len"])]
  c = base_cfg
  verdicts = []
  if runs.get("attention") and runs.get("hypermixer"):
    hm = [_ppl(r, s["seq_len"]) for r in runs["hypermixer"]]
    tf = [_ppl(r, s["seq_len"]) for r in runs["attention"]]
    gap = experiment.mean_sd(hm)[0] / experiment.mean_sd(tf)[0] - 1
    verdicts.append(
        f"Causal HyperMixer / Transformer perplexity - 1 = {100 * gap:+.1f}% "
        f"(target: within {100 * TARGET_GAP:.0f}%: "
        f"{'met' if gap <= TARGET_GAP else 'not met'}); HyperMixer's "
        "perplexity lower than the Transformer's (Welch's test on the "
        f"seeds): {experiment.verdict(hm, tf, 'lower')}.")
  notes = (
      f"Same for all models: AdamW (b1 {c.b1}, b2 {c.b2}, weight decay "
      f"{c.weight_decay}), {c.warmup_steps} warm-up steps to lr "
      f"{c.learning_rate:g} then cosine decay to {c.end_learning_rate_factor:g}"
      f" x, clip norm {c.clip_norm}, batch {c.batch_size} x length "
      f"{c.data.seq_len} (unpacked rows), {steps} steps, no dropout, seeds "
      f"{args.seeds} (initialisation and data order; HyperMixer ablations: "
      f"seeds {ablation_seeds}). Every model's forward FLOPs per token at N = "
      f"{s['seq_len']} (XLA's count) matched to the Transformer's through "
      "d_ffn. Trained on the C4 sample "
      f"({mlm.C4_TRAIN}, {bases['train_tokens']:,} train tokens); "
      f"{mlm.VOCAB_PIECES} SentencePiece pieces trained on it (sha256 "
      f"{vocab['sha256'][:12]}...). Held out: the first "
      f"{s['eval_rows']} rows of WikiText-2 validation at N = {max(lengths)} "
      "read "
      f"as articles, {base['scored_tokens']:,} scored tokens (digest "
      f"{base['digest']}), the same at every length. Perplexity = exp(mean "
      "cross-entropy over those tokens), mean ± sd over seeds; 'vs "
      "Transformer': perplexity / the Transformer's - 1. tokens/s: median "
      "training throughput of the run (one CPU core shared with other jobs: "
      "compare within one run only). Baselines: train-token counts scored on "
      "the same positions. " + " ".join(verdicts))
  table = experiment.markdown_table(
      HEADERS, table_rows(runs, exp.data["sizes"], base, s["seq_len"]))
  table += ("\n\n### Trained at N = 256, evaluated at longer N (the same "
            "tokens)\n\n" + experiment.markdown_table(
                ["model"] + [f"N = {n}" for n in lengths],
                length_rows(runs, bases, lengths)))
  exp.write_table("Causal language models at matched FLOPs (small scale)",
                  table, notes + (
                      " Length: gMLP's Toeplitz weights beyond offset 255 "
                      "are untrained (near-zero init), so its context stays "
                      "256 tokens; the sinusoidal models see untrained "
                      "positions beyond 255."))
  _plot(exp, runs, base, lengths)


def scaling_part(args, exp) -> None:
  """Time and memory per token of forward + backward against N."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  vocab_size = -(-(mlm.VOCAB_PIECES + 100) // 128) * 128
  names = experiment.split(args.models)
  configs = model_configs(dict(SMALL), vocab_size, names)
  prepared = {}
  rows = []
  for n in experiment.split(args.lengths, int):
    calls = {}
    for name in names:
      m = ml_collections.ConfigDict(configs[name].to_dict())
      m.max_len = max(n, m.max_len)
      model = models.build_model(m)
      tokens = jnp.ones((1, n), jnp.int32)
      batch = {"inputs": tokens, "targets": tokens,
               "weights": jnp.ones((1, n), jnp.float32),
               "segment_ids": tokens}
      params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
      compiled = jax.jit(jax.grad(
          lambda p, b, model=model: jnp.mean(_nll(model, p, b)))).lower(
              params, batch).compile()
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
      if rec["n"] != n:
        continue
      if key in times:
        rec["time_s"] = statistics.median(times[key])
      exp.runs[key] = rec
      rows.append([label(rec["model"]), n,
                   f"{1e6 * rec['time_s'] / n:.1f}" if "time_s" in rec
                   else rec.get("skipped", ""),
                   f"{rec['memory_bytes'] / n / 1024:.1f}"])
      print(rows[-1], flush=True)
    exp.save()
  exp.write_table(
      "Causal LMs: training step cost per token against N (one row)",
      experiment.markdown_table(
          ["model", "N", "fwd+bwd µs / token", "memory KiB / token"], rows),
      "The small-scale matched models (no training), forward + backward of "
      "the LM loss on one row of N tokens, float32, on this machine's CPU "
      f"(shared: compare within this run); time: median of {args.rounds} "
      "interleaved rounds; memory: XLA's compiled memory analysis "
      "(temporaries + arguments + outputs) per token.")
  fig, axes = experiment.figure(ncols=2)
  for i, name in enumerate(names):
    recs = sorted((r for r in exp.runs.values()
                   if r.get("model") == name and "n" in r),
                  key=lambda r: r["n"])
    timed = [r for r in recs if "time_s" in r]
    axes[0, 0].plot([r["n"] for r in timed],
                    [1e6 * r["time_s"] / r["n"] for r in timed], marker="o",
                    color=f"C{i}", label=label(name))
    axes[0, 1].plot([r["n"] for r in recs],
                    [r["memory_bytes"] / r["n"] / 1024 for r in recs],
                    marker="o", color=f"C{i}", label=label(name))
  for ax, ylabel in zip(axes[0], ("fwd+bwd µs per token",
                                  "memory KiB per token (XLA)")):
    experiment.style_axes(ax, "N", ylabel, xscale="log2", yscale="log")
  exp.save_figure(fig, "causal_lm_scaling")


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
