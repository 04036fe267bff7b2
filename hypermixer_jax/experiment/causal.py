"""The causal-LM study (``experiments/causal_lm.py``): its models matched
in forward FLOPs per token, its training config, the held-out set read at
several lengths, per-token scoring, and its tables and figure."""
from __future__ import annotations

import functools
import hashlib
import json
import math
import pathlib
import statistics

import ml_collections
import numpy as np

from hypermixer_jax import experiment
from hypermixer_jax.experiment import mlm
from hypermixer_jax.experiment import selection

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
                  chunks=(), recorded: dict | None = None
                  ) -> dict[str, ml_collections.ConfigDict]:
  """The matched models: ``{name: config}``, those of ``mixers`` (the
  Transformer always, the reference) and the HyperMixer ablations
  ``hypermixer_h<d'>_c<C>``; a name in ``recorded`` (``recorded_models``:
  a report's) is taken from it, not matched again."""
  recorded = recorded or {}
  bert = recorded.get("attention") or model_config("attention", s,
                                                   vocab_size)
  target = functools.cache(lambda: forward_flops(bert, s["seq_len"]))
  out = {"attention": bert}
  for mixer in mixers:
    if mixer != "attention":
      out[mixer] = recorded.get(mixer) or match_flops(
          model_config(mixer, s, vocab_size), target(), s["seq_len"])
  cells = [(h, s["chunk"]) for h in hyper_dims] + [
      (s["hyper_dim"], c) for c in chunks]
  for h, c in cells:
    name = f"hypermixer_h{h}_c{c}"
    if (h, c) == (s["hyper_dim"], s["chunk"]):
      continue
    if name in recorded:
      out[name] = recorded[name]
      continue
    m = model_config("hypermixer", s, vocab_size, hyper_dim=h, chunk=c)
    matched = match_flops(m, target(), s["seq_len"])
    # A mixing that alone nearly fills the budget keeps the Transformer's
    # FFN instead of losing it (and is reported with its larger FLOPs).
    out[name] = matched if matched.d_ffn >= MIN_FFN else m
  return out


def recorded_models(exp) -> dict[str, ml_collections.ConfigDict] | None:
  """A report's models (``--report_only``): the configs the record's
  ``sizes`` hold, those its runs trained (a report trains nothing, so it
  does not compile every model again to match FLOPs); None when training
  (the models are matched afresh and checked against the record)."""
  if not exp.report_only:
    return None
  return {name: ml_collections.ConfigDict(rec["model"])
          for name, rec in exp.data.get("sizes", {}).items()}


def hyper_dim_name(s: dict, hyper_dim: int) -> str:
  """The study's name of the matched HyperMixer of width ``hyper_dim`` at
  the default chunk: the main model's at the default width."""
  return ("hypermixer" if hyper_dim == s["hyper_dim"]
          else f"hypermixer_h{hyper_dim}_c{s['chunk']}")


def selection_configs(s: dict, vocab_size: int, hyper_dims,
                      recorded: dict | None = None
                      ) -> dict[str, ml_collections.ConfigDict]:
  """The candidates of the d' selection (``{name: config}``, the
  Transformer first: the reference of the FLOP match), each matched to the
  Transformer's FLOPs as ``model_configs`` matches them (``recorded``: a
  report's, taken as they are); a width whose mixing leaves no FFN of
  ``MIN_FFN`` is refused (an unmatched candidate would buy its score with
  FLOPs)."""
  recorded = recorded or {}
  bert = recorded.get("attention") or model_config("attention", s,
                                                   vocab_size)
  target = functools.cache(lambda: forward_flops(bert, s["seq_len"]))
  out = {"attention": bert}
  for h in hyper_dims:
    name = hyper_dim_name(s, h)
    m = recorded.get(name) or match_flops(
        model_config("hypermixer", s, vocab_size, hyper_dim=h), target(),
        s["seq_len"])
    if m.d_ffn < MIN_FFN:
      raise ValueError(
          f"--select_hyper_dims: d'={h} leaves an FFN of {m.d_ffn} (< "
          f"{MIN_FFN}) at the Transformer's FLOPs, so it cannot be matched; "
          "choose among narrower widths.")
    out[name] = m
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
                 data_dir: str = "", steps: int | None = None, seed: int = 0,
                 sizes: dict | None = None) -> ml_collections.ConfigDict:
  """``configs/c4_lm.py``'s training config with ``model``: the same for
  every model but the model (and ``seed``); ``sizes``: the scale's setting
  (default ``SMALL`` or ``PAPER_SIZES``)."""
  if sizes is None:
    sizes = SMALL if scale == "small" else PAPER_SIZES
  c = mlm.lm_train_config("c4_lm.py", model, sizes, steps, seed)
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


def masked_nll(model, params, batch):
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
  nll = jax.jit(lambda p, batch: masked_nll(model, p, batch))
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
def ppl_at(run: dict, n: int) -> float:
  return float(run["lengths"][str(n)]["perplexity"])


def table_rows(runs: dict, sizes: dict, base: dict | None, n: int,
               chosen: str | None = None) -> list:
  rows = []
  ref = [ppl_at(r, n) for r in runs.get("attention", [])]
  for name, seed_runs in runs.items():
    m, sz = sizes[name]["model"], sizes[name]
    ppl = [ppl_at(r, n) for r in seed_runs]
    mean = experiment.mean_sd(ppl)[0] if ppl else float("nan")
    gap = (f"{100 * (mean / experiment.mean_sd(ref)[0] - 1):+.1f}%"
           if ref and ppl and name != "attention" else "")
    tps = [r["train_tokens_per_sec"] for r in seed_runs]
    mixer = m["mixer_kwargs"]
    extra = (f"d'={mixer['hyper_dim']}, C={mixer['causal_chunk_size']}"
             if m["mixer"] == "hypermixer" else "")
    rows.append([label(name, chosen=chosen), extra, m["num_layers"],
                 m["d_model"],
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


def label(name: str, ablation_name: bool = False,
          chosen: str | None = None) -> str:
  """The table's name of a model; an ablation's with its key when
  ``ablation_name``; ``chosen``: the HyperMixer whose d' the validation
  split chose (``select_hyper_dim``)."""
  if name in LABELS:
    return LABELS[name]
  if name == chosen:
    return "HyperMixer (causal), d' chosen on validation"
  return f"HyperMixer ablation ({name})" if ablation_name else (
      "HyperMixer ablation")


def length_rows(runs: dict, bases: dict, lengths,
                chosen: str | None = None) -> list:
  rows = []
  for name, seed_runs in runs.items():
    rows.append([label(name, ablation_name=True, chosen=chosen)]
                + [experiment.fmt_mean_sd([ppl_at(r, n) for r in seed_runs])
                   for n in lengths])
  for kind in ("unigram", "bigram"):
    rows.append([kind] + [f"{bases[str(n)][kind]:.1f}" for n in lengths])
  return rows


def plot_lm(exp, runs, base, lengths, chosen: str | None = None) -> None:
  fig, axes = experiment.figure(ncols=2)
  ax, bx = axes[0, 0], axes[0, 1]
  experiment.plot_curves(ax, runs, "perplexity", lambda name: (
      label(name, chosen=chosen) if name in LABELS or name == chosen
      else name))
  for i, seed_runs in enumerate(runs.values()):
    means = [experiment.mean_sd([ppl_at(r, n) for r in seed_runs])[0]
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


def record_sizes(exp, configs: dict, names, n: int) -> dict:
  """Each model's config, parameters and FLOPs in ``exp``'s ``sizes`` (kept
  where the config is unchanged: counting FLOPs compiles the model)."""
  sizes = exp.data.get("sizes", {})
  for name in names:
    # (Compared as JSON holds it: a tuple field reads back as a list.)
    model = json.loads(json.dumps(configs[name].to_dict()))
    if name not in sizes or sizes[name]["model"] != model:
      sizes[name] = {"model": model, **sizes_of(configs[name], n)}
  exp.save(sizes=sizes)
  return sizes


def count_baselines(config: ml_collections.ConfigDict, held: dict, lengths,
                    vocab_size: int) -> dict:
  """Unigram and bigram counts of ``config``'s train tokens scored on the
  held-out set at each length."""
  from hypermixer_jax import baselines  # pylint: disable=g-import-not-at-top
  train = experiment.pipeline_arrays(config.data, "train")
  return {**{str(n): dict(baselines.lm_baselines(
      train["targets"], held[n], vocab_size=vocab_size, causal=True),
                          digest=digest(held[n])) for n in lengths},
          "train_tokens": int(train["weights"].sum())}


def gap_verdicts(runs: dict, n: int, hyper: str = "hypermixer", *,
                 untuned: bool = False) -> list[str]:
  """HyperMixer's (the model ``hyper``'s) perplexity against the
  Transformer's at length ``n``: the gap to ``TARGET_GAP`` and Welch's test
  of "lower" (``untuned``: every model at one shared setting, no verdict)."""
  if not (runs.get("attention") and runs.get(hyper)):
    return []
  hm = [ppl_at(r, n) for r in runs[hyper]]
  tf = [ppl_at(r, n) for r in runs["attention"]]
  return [
      "Causal HyperMixer / Transformer perplexity - 1 = "
      f"{target(hm, tf, untuned)}; HyperMixer's perplexity lower than the "
      "Transformer's (Welch's test on the seeds): "
      f"{experiment.verdict(hm, tf, 'lower', untuned=untuned)}."]


def target(hm: list[float], tf: list[float], untuned: bool = False) -> str:
  """The gap of the perplexities ``hm`` to ``tf`` (seeds) and whether it
  meets ``TARGET_GAP``: tested as equality within that share of the
  Transformer's mean (TOST, after Welch's test finds no difference;
  ``untuned``: no verdict)."""
  ref = experiment.mean_sd(tf)[0]
  gap = experiment.mean_sd(hm)[0] / ref - 1
  v = experiment.verdict(hm, tf, "equal", margin=TARGET_GAP * ref)
  met = (experiment.NO_VERDICT if untuned else
         {"agrees": "met", "disagrees": "not met"}.get(v.word, "not decided"))
  return (f"{100 * gap:+.1f}% (target: within {100 * TARGET_GAP:.0f}%: "
          f"{met}; {v.detail()})")


def _validation_ppl(run: dict) -> float:
  """A selection run's perplexity on the carved split; inf where it
  diverged or its perplexity is not finite (never chosen)."""
  ppl = math.inf if selection.DIVERGED in run else mlm.final_perplexity(run)
  return ppl if math.isfinite(ppl) else math.inf


def choose_hyper_dim(found: dict) -> str | None:
  """The candidate (``found``: {name: [its selection run]}) of lowest
  perplexity on the carved validation split at the end of its run; None
  until every candidate has run. A run that diverged is never chosen; all
  of them diverged: a one-line error."""
  if not found or not all(found.values()):
    return None
  ppl = {m: _validation_ppl(runs[0]) for m, runs in found.items()}
  if all(math.isinf(v) for v in ppl.values()):
    raise SystemExit("--select_hyper_dims: every width diverged on the carved "
                     "split; lower the study's learning rate (train_config).")
  return min(ppl, key=ppl.get)   # ties: the first listed


def selection_section(selection: dict, chosen: str | None, runs: dict,
                      sizes: dict, split: dict, s: dict) -> str:
  """The d' selection's table (each candidate's width, FFN and validation
  perplexity, the choice marked) and the chosen model's verdict against the
  Transformer at the training length."""
  def width(name):
    return sizes[name]["model"]["mixer_kwargs"]["hyper_dim"]
  rows = []
  for name, sel in selection.items():
    ppl = "not run"
    if sel:
      v = _validation_ppl(sel[0])
      ppl = (f"{v:.1f}" if math.isfinite(v) else "diverged") + (
          " *" if name == chosen else "")
    rows.append([width(name), sizes[name]["model"]["d_ffn"],
                 f"{sizes[name]['flops_per_token'] / 1e6:.2f}M", ppl])
  text = (
      "\n\n### d' chosen on a validation split carved from the C4 sample"
      "\n\n" + experiment.markdown_table(
          ["d'", "d_ffn", "fwd FLOPs/token", "validation ppl"], rows)
      + "\n\nEach width matched in FLOPs to the Transformer, trained once "
      f"(seed {mlm.TUNE_SEED}, the study's setting) on the "
      f"{split['train']['documents']:,} other documents of the sample "
      f"(sha256 {split['train']['sha256'][:12]}...) and scored on every "
      f"{mlm.VALIDATION_EVERY}th one ({split['validation']['documents']:,} "
      f"documents, sha256 {split['validation']['sha256'][:12]}...); the "
      "held-out WikiText rows are never read in the choice. The "
      "Transformer gets no search of its own (one configuration), so this "
      "comparison favours HyperMixer: a verdict for it is optimistic, one "
      "against it stands. ")
  if chosen is None:
    return text + "Not chosen yet: a candidate's run is missing.\n"
  n = s["seq_len"]
  hm = [ppl_at(r, n) for r in runs.get(chosen, [])]
  tf = [ppl_at(r, n) for r in runs.get("attention", [])]
  text += (f"The chosen d' = {width(chosen)} then trains the reported seeds "
           "on the whole sample, as every model of the table does")
  if not (hm and tf):
    return text + ": not run yet.\n"
  return text + (
      f": {experiment.fmt_mean_sd(hm)} against the Transformer's "
      f"{experiment.fmt_mean_sd(tf)} at N = {n}, {target(hm, tf, True)}; "
      "lower than the Transformer's (Welch's test on the seeds): "
      f"{experiment.verdict(hm, tf, 'lower', untuned=True)}." + "".join(
          f" At N = {m} (trained at {n}): "
          f"{experiment.fmt_mean_sd([ppl_at(r, m) for r in runs[chosen]])} "
          "against "
          f"{experiment.fmt_mean_sd([ppl_at(r, m) for r in runs['attention']])}"
          ", lower: " + str(experiment.verdict(
              [ppl_at(r, m) for r in runs[chosen]],
              [ppl_at(r, m) for r in runs["attention"]], "lower",
              untuned=True)) + "."
          for m in s["eval_lengths"] if m != n) + "\n")


def select_hyper_dim(exp, args, study, vocab: dict, configs: dict,
                     runs: dict, run) -> tuple[str, str | None]:
  """``experiments/causal_lm.py --select_hyper_dims``: each width, matched
  in FLOPs, trained once on the C4 sample less a carved validation split
  and scored there; the chosen width's seeds (``run(cell, key)``, on the
  whole sample, as every model) join ``runs`` (and ``configs``: the
  candidates). Returns the selection's section of the report and the
  chosen model's name (``study``: the sizes, steps and key prefix of the
  main grid)."""
  s, steps, prefix = study
  found, chosen, sizes, split = hyper_dim_choice(exp, args, study, vocab,
                                                 configs)
  if chosen is not None:   # its seeds, as every model's (a report: recorded)
    runs.update(exp.cells(prefix, experiment.grid(
        model=[chosen], seed=experiment.split(args.seeds, int)), run,
        expect=lambda cell: {"params": sizes[cell["model"]]["params"]}))
  return selection_section(found, chosen, runs, sizes, split, s), chosen


def hyper_dim_choice(exp, args, study, vocab: dict, configs: dict
                     ) -> tuple[dict, str | None, dict, dict]:
  """``--select_hyper_dims``' search (``select_hyper_dim``): each width,
  matched in FLOPs (added to ``configs``), trained once (seed
  ``mlm.TUNE_SEED``, the study's setting) on the C4 sample less every 10th
  document and scored on those. Returns ``({candidate: [its run]}, the
  chosen name or None until all ran, sizes, the split)``."""
  s, steps, prefix = study
  shared = pathlib.Path(args.shared)
  candidates = selection_configs(
      s, vocab["model_vocab_size"],
      experiment.split(args.select_hyper_dims, int), recorded_models(exp))
  names = [n for n in candidates if n != "attention"]
  configs.update({n: candidates[n] for n in names})
  sizes = record_sizes(exp, configs, names, s["seq_len"])
  split = mlm.carve_validation(shared / mlm.C4_TRAIN,
                               pathlib.Path(exp.workdir("c4_split")))
  exp.save(c4_split=mlm.split_record(split))

  def select(cell, key):
    cfg = train_config(configs[cell["model"]], args.scale, shared, vocab,
                       steps=steps, seed=mlm.TUNE_SEED, sizes=s)
    c = mlm.carved_config(cfg, split, select=True)
    return dict(selection.or_diverged(
        lambda: mlm.lean(experiment.train(c, exp.workdir(key)))),
                params=sizes[cell["model"]]["params"],
                **selection.split_tag(split))
  ran = exp.cells(
      f"{prefix}/select_hyper_dim", experiment.grid(model=names), select,
      expect=lambda cell: {"params": sizes[cell["model"]]["params"],
                           **selection.split_tag(split)})
  found = {n: ran.get(n, []) for n in names}
  return found, choose_hyper_dim(found), sizes, split


def lm_notes(c: ml_collections.ConfigDict, s: dict, *, steps: int,
             seeds: str, ablation_seeds, bases: dict, vocab: dict,
             tuned: bool = False) -> str:
  """The LM table's notes: the shared training setting, data and held-out
  set (``c``: the reference training config, ``s``: the sizes; ``tuned``:
  each model at its chosen lr and warm-up, on the carved documents)."""
  lengths = tuple(s["eval_lengths"])
  base = bases[str(s["seq_len"])]
  schedule = ("each model's chosen warm-up and peak lr" if tuned else
              f"{c.warmup_steps} warm-up steps to lr {c.learning_rate:g}")
  return (
      f"Same for all models: AdamW (b1 {c.b1}, b2 {c.b2}, weight decay "
      f"{c.weight_decay}), {schedule} "
      f"then cosine decay to {c.end_learning_rate_factor:g}"
      f" x, clip norm {c.clip_norm}, batch {c.batch_size} x length "
      f"{c.data.seq_len} (unpacked rows), {steps} steps, no dropout, seeds "
      f"{seeds} (initialisation and data order; HyperMixer ablations: "
      f"seeds {ablation_seeds} where run, n per row; an ablation with more "
      "than one seed got the others after its first was seen on the "
      "held-out set, so it is no unselected result: the width chosen on "
      "validation has its own row). Every model's forward FLOPs per token at N = "
      f"{s['seq_len']} (XLA's count) matched to the Transformer's through "
      "d_ffn. Trained on the C4 sample "
      f"({mlm.C4_TRAIN}{', less the carved documents' if tuned else ''}, "
      f"{bases['train_tokens']:,} train tokens); "
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
      "the same positions. ")


def write_lm_report(exp, runs: dict, bases: dict, s: dict, notes: str,
                    extra: str = "", chosen: str | None = None, *,
                    name: str = "table", title: str = "") -> None:
  """The LM table (at the training length, then at every evaluation
  length) and, for the main table, its figure; ``extra``: text after the
  notes (a selection's section), ``chosen``: the model it chose; ``name``,
  ``title``: another table (``table_tuned``: no figure)."""
  lengths = tuple(s["eval_lengths"])
  base = bases[str(s["seq_len"])]
  table = experiment.markdown_table(
      HEADERS, table_rows(runs, exp.data["sizes"], base, s["seq_len"],
                          chosen))
  table += ("\n\n### Trained at N = 256, evaluated at longer N (the same "
            "tokens)\n\n" + experiment.markdown_table(
                ["model"] + [f"N = {n}" for n in lengths],
                length_rows(runs, bases, lengths, chosen)))
  exp.write_table(title or "Causal language models at matched FLOPs (small "
                  "scale)", table, notes + (
                      " Length: gMLP's Toeplitz weights beyond offset 255 "
                      "are untrained (near-zero init), so its context stays "
                      "256 tokens; the sinusoidal models see untrained "
                      "positions beyond 255.") + extra, name=name)
  if name == "table":
    plot_lm(exp, runs, base, lengths, chosen)


def tune(exp, args, study, vocab: dict, configs: dict, sizes: dict,
         held: dict, names, base_cfg: ml_collections.ConfigDict) -> None:
  """``experiments/causal_lm.py --tune``: every model of ``names``, at its
  FLOP-matched size, searches ``selection.settings`` (``--lrs``) with seed
  ``selection.SEED`` on the C4 sample less every 10th document, scored by
  perplexity on those documents; then ``--seeds`` at each model's choice on
  the carved train part (the sample less every 10th document), scored on the held-out WikiText rows at every
  length as the main grid (``study``: its sizes, steps and key prefix;
  ``base_cfg``: the Transformer's training config). With
  ``--select_hyper_dims`` HyperMixer is searched at the d' chosen on the
  same split (``hyper_dim_choice``; every width must have run). Writes
  ``table_tuned.md``, baselines counted on the carved train part."""
  s, steps, prefix = study
  hyper = None
  if args.select_hyper_dims and "hypermixer" in names:
    _, hyper, sizes, _ = hyper_dim_choice(exp, args, study, vocab, configs)
    if hyper is None:
      raise SystemExit("--tune --select_hyper_dims: the d' selection has not "
                       "run every width yet; run it first (without --tune).")
    names = [hyper if n == "hypermixer" else n for n in names]
  shared = pathlib.Path(args.shared)
  split = mlm.carve_validation(shared / mlm.C4_TRAIN,
                               pathlib.Path(exp.workdir("c4_split")))
  exp.save(c4_split=mlm.split_record(split))
  lengths = tuple(s["eval_lengths"])
  bases = exp.baseline(f"{prefix}/carved", lambda: count_baselines(
      mlm.carved_config(base_cfg, split), held, lengths,
      vocab["model_vocab_size"]))

  def one(name, seed, setting, key, select):
    cfg = train_config(configs[name], args.scale, shared, vocab,
                       steps=steps, seed=seed, sizes=s)
    c = mlm.carved_config(cfg, split, setting, select=select)
    if select:
      return dict(mlm.lean(experiment.train(c, exp.workdir(key))),
                  params=sizes[name]["params"])
    return run_cell(c, exp.workdir(key), held, {
        k: v for k, v in sizes[name].items() if k != "model"})
  lrs = experiment.split(args.lrs, float) or None
  searched, chosen, runs = selection.tune(
      exp, names, experiment.split(args.seeds, int),
      selection.settings(steps, lrs), f"{prefix}/", one,
      mlm.final_perplexity, higher=False, reverse=args.order == "reverse",
      tag=selection.split_tag(split),
      fields=lambda name: {"params": sizes[name]["params"]})
  notes = lm_notes(base_cfg, s, steps=steps, seeds=args.seeds,
                   ablation_seeds="none", bases=bases, vocab=vocab,
                   tuned=True)
  if hyper:
    width = sizes[hyper]["model"]["mixer_kwargs"]["hyper_dim"]
    notes += (f"HyperMixer enters at d' = {width}, the width chosen on "
              "the same carved documents at the study's shared setting (its "
              "section in table.md); the other models get no search of "
              "their shape, so the search is not equal and its tests give "
              "no verdict. ")
  write_lm_report(
      exp, runs, bases, s, notes + " ".join(gap_verdicts(
          runs, s["seq_len"], hyper or "hypermixer", untuned=bool(hyper))),
      tuned_section(split, searched, chosen, steps, args.seeds, lrs, hyper),
      hyper, name="table_tuned", title="Causal language models at matched FLOPs, "
      "every model tuned alike (small scale)")


def tuned_section(split: dict, searched: dict, chosen: dict, steps: int,
                  seeds: str, lrs=None, hyper: str | None = None) -> str:
  """The tuned table's search: each model's validation perplexity at every
  setting, and how the choice was made (``hyper``: the HyperMixer of the d'
  chosen on validation)."""
  return (
      "\n\n" + selection.search_section(
          searched, chosen, {n: label(n, chosen=hyper) for n in searched}, lrs,
          what="perplexity", cell=lambda r: f"{mlm.final_perplexity(r):.1f}")
      + "\n\n" + selection.notes(
          "document of the C4 sample", split, steps, seeds,
          len(selection.settings(steps, lrs)),
          "the held-out WikiText-2 rows", "perplexity at the last step"))


def compiled_train_step(m: ml_collections.ConfigDict, n: int):
  """``(compiled, params, batch)``: forward + backward of the LM loss of
  ``m`` on one row of ``n`` tokens, compiled."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  m = ml_collections.ConfigDict(m.to_dict())
  m.max_len = max(n, m.max_len)
  model = models.build_model(m)
  tokens = jnp.ones((1, n), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens,
           "weights": jnp.ones((1, n), jnp.float32), "segment_ids": tokens}
  params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
  compiled = jax.jit(jax.grad(
      lambda p, b: jnp.mean(masked_nll(model, p, b)))).lower(
          params, batch).compile()
  return compiled, params, batch


def plot_scaling(exp, names) -> None:
  """Time and memory per token against N, one line per model."""
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
