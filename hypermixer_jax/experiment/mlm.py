"""What the masked- and causal-LM experiments share: the gMLP paper's MLM
setting (Liu et al. 2021, §4) at both scales, its models at equal capacity,
one run's training config, the held-out set and its n-gram baselines, and
the perplexity table.

``experiments/mlm_perplexity.py`` runs the comparison; ``causal_lm``,
``smlp_vs_moe`` and ``pretrain_finetune`` start from the same sizes, data
and vocabulary.
"""
from __future__ import annotations

import hashlib
import pathlib

import ml_collections
import numpy as np

from hypermixer_jax import baselines
from hypermixer_jax import experiment
from hypermixer_jax.experiment import selection

MODELS = ("attention", "gmlp", "amlp")
# BERT with one of its choices changed, at its parameter count (one seed,
# ``--models=attention_pre_ln``, ...): which of them the gap to gMLP comes
# from. Pre-LN moves the embedding LayerNorm to the stack's end (the same
# parameters); sinusoidal positions drop the learned table (N x d fewer)
# and take the Transformer's sqrt(d)-scaled token embeddings with them
# (BERT's N(0, 0.02) tokens would be drowned by the unit sinusoids).
DIAGNOSTICS = {"attention_pre_ln": dict(block="pre_ln"),
               "attention_sinusoidal": dict(position_embeddings="sinusoidal",
                                            scale_embeddings=True)}
# Depth: BERT with 1.5x / 2x its layers, the FFN narrowed to its parameter
# count (small scale: 3 / 4 layers at d_ffn 256 / 128; a layer's attention
# alone is 66k of the two layers' 397k block parameters at d = 128, so
# gMLP's 6 layers are out of reach).
DEPTH_DIAGNOSTICS = {"attention_deeper": 1.5, "attention_deepest": 2.0}
CHOICES = MODELS + tuple(DIAGNOSTICS) + tuple(DEPTH_DIAGNOSTICS)
LABELS = {"attention": "BERT (Transformer)", "gmlp": "gMLP", "amlp": "aMLP",
          "attention_pre_ln": "BERT, pre-LN blocks (diagnostic)",
          "attention_sinusoidal": "BERT, sinusoidal positions (diagnostic)",
          "attention_deeper": "BERT, 1.5x the layers, narrower FFN "
                              "(diagnostic)",
          "attention_deepest": "BERT, 2x the layers, narrower FFN "
                               "(diagnostic)"}
# PAPERS.md §2, scaling table (C4 validation perplexity of the MLM ablation
# setting): the base-size pair; the digest gives no aMLP perplexity (the
# paper's claim is aMLP <= BERT).
PAPER = {
    "attention": {"layers": 12, "params": 110e6, "ppl": 4.26},
    "gmlp": {"layers": 36, "params": 102e6, "ppl": 4.35},
    "amlp": {"layers": 36, "params": None, "ppl": None},
}
PAPER_OTHER_SIZES = ("6-layer BERT 67M 4.91 vs 18-layer gMLP 59M 5.25; "
                     "24-layer BERT 195M 3.83 vs 72-layer gMLP 187M 3.79")
# The sizes of each scale: width, BERT's layers / d_ffn / heads, the MLPs'
# layers (and d_ffn at paper scale; matched to BERT at small scale).
SMALL = dict(d_model=128, bert_layers=2, bert_d_ffn=512, bert_heads=2,
             mlp_layers=6, mlp_d_ffn=None, seq_len=128, batch_size=32,
             steps=2000, lr=1e-3, warmup=20, evals=4, eval_batch_size=64,
             eval_batches=8, dropout=0.0)
# How the small scale's length was set: on the reported held-out set.
SMALL_BUDGET_NOTE = (
    "Training length: 2,000 steps, set as the budget at which every model "
    "clears 0.6 x unigram and the bigram on this held-out set (at 1,000 "
    "steps BERT does not): a choice made on the reported data, the same "
    "for every model, {}. ")
PAPER_SIZES = dict(d_model=768, bert_layers=12, bert_d_ffn=3072, bert_heads=12,
                   mlp_d_model=512, mlp_layers=36, mlp_d_ffn=3072,
                   seq_len=128, batch_size=2048, steps=125_000, lr=7e-4,
                   warmup=10_000, evals=25, eval_batch_size=256,
                   eval_batches=50, dropout=0.1)
TINY_ATTENTION_DIM = 64   # aMLP: one head of size 64 (the paper's MLM models)
C4_TRAIN = "c4/c4_en_tfds_minimal_train_1000.jsonl"
WIKITEXT_VALID = "wikitext-2-raw/wiki.valid.raw"
VOCAB_PIECES = 8000


def model_config(mixer: str, *, d_model: int, num_layers: int, d_ffn: int,
                 seq_len: int, num_heads: int = 1, dropout: float = 0.0
                 ) -> ml_collections.ConfigDict:
  """The MLM model of the paper's setting for ``mixer``.

  ``attention``: BERT, post-LN blocks (LN after each residual, LN on the
  embeddings), learned positions, ``num_heads`` heads. ``gmlp`` / ``amlp``:
  gMLP's own pre-LN block, Toeplitz spatial weights W[i, j] = w[i - j], no
  position embeddings (position comes from W); aMLP adds the tiny attention
  (``TINY_ATTENTION_DIM``). All: BERT's unscaled N(0, 0.02) token
  embeddings, tied MLM output head, no token types.
  """
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train.config import TEXT_VOCAB_SIZE  # pylint: disable=g-import-not-at-top
  m = models.default_model_config()
  m.update(family="text", head="mlm", mixer=mixer, num_layers=num_layers,
           d_model=d_model, d_ffn=d_ffn, max_len=seq_len,
           vocab_size=TEXT_VOCAB_SIZE, type_vocab_size=0,
           dropout_rate=dropout, scale_embeddings=False)
  if mixer == "attention":
    m.update(block="post_ln", position_embeddings="learned")
    m.mixer_kwargs = ml_collections.ConfigDict(dict(num_heads=num_heads))
  elif mixer in ("gmlp", "amlp"):
    m.update(block="gmlp", position_embeddings="none")
    kwargs = dict(toeplitz=True)
    if mixer == "amlp":
      kwargs["tiny_attention_dim"] = TINY_ATTENTION_DIM
    m.mixer_kwargs = ml_collections.ConfigDict(kwargs)
  else:
    raise ValueError(f"mixer {mixer!r}; this experiment compares "
                     f"{', '.join(MODELS)}.")
  return m


def params(m: ml_collections.ConfigDict) -> dict[str, int]:
  """Total parameters and those outside the token embedding."""
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  total = models.count_params(m)
  return {"total": total,
          "non_embedding": total - models.count_params(m, "token_embed")}


def match(m: ml_collections.ConfigDict, target: int, multiple: int = 16
          ) -> ml_collections.ConfigDict:
  """``m`` with the ``d_ffn`` (a multiple of ``multiple``) whose parameter
  count is nearest ``target``.

  A gMLP/aMLP block's parameters are affine in d_ffn (U, V, the gate's LN,
  aMLP's output projection), so two counts give the line.
  """
  return experiment.match_field(
      m, "d_ffn", lambda c: params(c)["total"], target, lo=2 * multiple,
      hi=4 * multiple, multiple=multiple)


def model_configs(scale: str, vocab: dict | None = None
                  ) -> dict[str, ml_collections.ConfigDict]:
  """The three models of ``scale`` (small: the MLPs matched to BERT, on
  ``vocab``'s embedding size when given) and BERT's ``DIAGNOSTICS``."""
  out = _model_configs(scale, vocab)
  bert = out["attention"]
  for name, change in DIAGNOSTICS.items():
    out[name] = ml_collections.ConfigDict(bert.to_dict())
    out[name].update(change)
  for name, factor in DEPTH_DIAGNOSTICS.items():
    deeper = ml_collections.ConfigDict(bert.to_dict())
    deeper.num_layers = round(bert.num_layers * factor)
    out[name] = match(deeper, params(bert)["total"])
  return out


def _model_configs(scale: str, vocab: dict | None
                   ) -> dict[str, ml_collections.ConfigDict]:
  if scale == "paper":
    s = PAPER_SIZES
    bert = model_config("attention", d_model=s["d_model"],
                        num_layers=s["bert_layers"], d_ffn=s["bert_d_ffn"],
                        seq_len=s["seq_len"], num_heads=s["bert_heads"],
                        dropout=s["dropout"])
    out = {"attention": bert}
    for mixer in ("gmlp", "amlp"):
      out[mixer] = model_config(mixer, d_model=s["mlp_d_model"],
                                num_layers=s["mlp_layers"],
                                d_ffn=s["mlp_d_ffn"], seq_len=s["seq_len"],
                                dropout=s["dropout"])
    return out
  s = SMALL
  bert = model_config("attention", d_model=s["d_model"],
                      num_layers=s["bert_layers"], d_ffn=s["bert_d_ffn"],
                      seq_len=s["seq_len"], num_heads=s["bert_heads"],
                      dropout=s["dropout"])
  if vocab:
    bert.vocab_size = vocab["model_vocab_size"]
  target = params(bert)["total"]
  out = {"attention": bert}
  for mixer in ("gmlp", "amlp"):
    m = model_config(mixer, d_model=s["d_model"], num_layers=s["mlp_layers"],
                     d_ffn=s["bert_d_ffn"], seq_len=s["seq_len"],
                     dropout=s["dropout"])
    m.vocab_size = bert.vocab_size
    out[mixer] = match(m, target)
  return out


def train_config(model: ml_collections.ConfigDict, scale: str,
                 shared: pathlib.Path | None, data_dir: str = "",
                 steps: int | None = None, seed: int = 0,
                 vocab: dict | None = None) -> ml_collections.ConfigDict:
  """The training config of one run: ``configs/c4_mlm.py``'s BERT setting
  with ``model``, the same for every model but the model (and ``seed``);
  ``vocab``: an ``experiment.small_vocab`` record, else T5's vocabulary."""
  c = lm_train_config("c4_mlm.py", model,
                      SMALL if scale == "small" else PAPER_SIZES, steps, seed)
  # Unpacked rows for every model: one document chunk per row, so every
  # selected token keeps its loss (a packed row keeps only its first
  # ceil(0.15 N) selections) and all models see the same rows.
  c.data.packing = False
  c.decay = "linear"
  if vocab:
    c.data.vocab_path = vocab["path"]
  elif scale == "small":
    c.data.vocab_path = experiment.require(
        shared / "t5_spm/sentencepiece.model", "SentencePiece vocabulary")
  if scale == "small":
    small_text_data(c, shared)
    c.log_every = 10
  else:
    c.data.data_dir = data_dir or None
  return c


def lm_train_config(file: str, model: ml_collections.ConfigDict, s: dict,
                    steps: int | None, seed: int) -> ml_collections.ConfigDict:
  """``configs/<file>``'s ``attention`` config with ``model``, the batch,
  length and schedule of the sizes ``s`` (``SMALL``, ``PAPER_SIZES`` or
  another language model study's) and ``steps`` (None: the sizes') and
  ``seed``: the same for every model of a study but the model."""
  c = experiment.load_config(file, "attention")
  c.model = model
  c.data.seq_len = s["seq_len"]
  c.batch_size = s["batch_size"]
  c.eval_batch_size = s["eval_batch_size"]
  c.num_train_steps = steps or s["steps"]
  c.learning_rate = s["lr"]
  c.warmup_steps = min(s["warmup"], c.num_train_steps)
  c.eval_every = max(1, c.num_train_steps // s["evals"])
  # A fixed held-out set: the first eval_batches batches of the unshuffled
  # split (the same rows, and masked positions, at every evaluation).
  c.eval_steps = s["eval_batches"]
  c.seed = seed
  return c


def small_text_data(c: ml_collections.ConfigDict,
                    shared: pathlib.Path) -> None:
  """The small scale's text: trains on the local C4 sample, holds out
  WikiText-2 validation read as articles; no periodic checkpoints."""
  c.data.local_files.train = experiment.require(shared / C4_TRAIN,
                                                "C4 sample")
  c.data.local_files.validation = experiment.require(
      shared / WIKITEXT_VALID, "WikiText-2 validation")
  c.data.text_layout = "wikitext"
  c.checkpoint_every = 0
  c.keep_checkpoints = 1


def held_out(config: ml_collections.ConfigDict) -> dict:
  """The held-out set a run is evaluated on: rows, real tokens, selected
  (scored) tokens, and a digest of its inputs, targets and weights (equal
  digests: the same rows with the same masked positions)."""
  arrays = experiment.held_out_arrays(config)
  digest = hashlib.sha256()
  bs = config.eval_batch_size
  for i in range(0, len(arrays["inputs"]), bs):    # batch by batch
    for key in ("inputs", "targets", "weights", "masked_positions"):
      digest.update(np.ascontiguousarray(arrays[key][i:i + bs]).tobytes())
  return {"rows": len(arrays["inputs"]),
          "tokens": int((arrays["segment_ids"] > 0).sum()),
          "scored_tokens": int(arrays["weights"].sum()),
          "digest": digest.hexdigest()[:16]}


def lm_baselines(config: ml_collections.ConfigDict) -> dict:
  """``baselines.lm_baselines`` of the selected positions of ``config``'s
  held-out set (described by ``held_out``), counted on the train split's
  tokens."""
  train = experiment.pipeline_arrays(config.data, "train")["targets"]
  return dict(baselines.lm_baselines(
      train, experiment.held_out_arrays(config),
      vocab_size=config.model.vocab_size, causal=False),
              train_tokens=int((train != 0).sum()), held_out=held_out(config))


def final_perplexity(run: dict) -> float:
  """Held-out perplexity at the run's last evaluation."""
  return float(run["eval"]["perplexity"])


def table_rows(runs: dict, sizes: dict, base: dict | None = None,
               untuned: bool = False) -> list[list]:
  """One row per model (``runs``: {model: [run of each seed]}), ours beside
  the paper's: mean ± sd over seeds, the ratio to the unigram baseline of
  the same positions, and whether the seeds back the paper's order against
  BERT."""
  rows = []
  bert = [final_perplexity(r) for r in runs.get("attention", [])]
  # The paper's models always (a missing one: "not run"), BERT's
  # diagnostics where they ran (no verdict, no paper number).
  for mixer in MODELS + tuple(d for d in CHOICES[len(MODELS):]
                              if runs.get(d)):
    m, p = sizes[mixer]["model"], sizes[mixer]["params"]
    ppl = [final_perplexity(r) for r in runs.get(mixer, [])]
    paper, paper_ppl = PAPER.get(mixer), ""
    if paper:
      paper_ppl = (f"{paper['ppl']} ({paper['layers']} layers, "
                   f"{paper['params'] / 1e6:.0f}M)" if paper["ppl"]
                   else "not in PAPERS.md")
    ratio = (f"{experiment.mean_sd(ppl)[0] / base['unigram']:.2f}"
             if ppl and base else "")
    vs_bert = ""
    if mixer in ("gmlp", "amlp") and ppl and bert:
      # gMLP: slightly higher perplexity than BERT; aMLP: at most BERT's.
      vs_bert = experiment.verdict(
          ppl, bert, "higher" if mixer == "gmlp" else "lower",
          untuned=untuned).text()
    rows.append([LABELS[mixer], m["num_layers"], m["d_model"], m["d_ffn"],
                 f"{p['total'] / 1e6:.3f}M", f"{p['non_embedding'] / 1e6:.3f}M",
                 experiment.fmt_mean_sd(ppl) or "not run", ratio, vs_bert,
                 paper_ppl])
  if base:
    rows += experiment.perplexity_baseline_rows(
        HEADERS, base, "held-out ppl (ours)", "/ unigram")
  return rows


HEADERS = ["model", "layers", "d", "d_ffn", "params", "non-embedding",
           "held-out ppl (ours)", "/ unigram", "vs BERT",
           "C4 valid ppl (paper)"]


def c4_vocab(exp: experiment.Experiment, shared: pathlib.Path) -> dict:
  """The small-scale vocabulary: SentencePiece on the C4 train documents,
  built into and recorded by ``exp``."""
  return exp.vocab(experiment.require(shared / C4_TRAIN, "C4 sample"),
                   ("text",), VOCAB_PIECES, trained_on=C4_TRAIN)


def report_names(scale: str, steps: int) -> tuple[str, str]:
  """The table's and the figure's file names: ``table`` and
  ``mlm_perplexity`` at the scale's own budget, ``_s<steps>`` added for any
  other, so that a longer or shorter run in the same ``--out`` keeps the
  main report."""
  default = (SMALL if scale == "small" else PAPER_SIZES)["steps"]
  suffix = "" if steps == default else f"_s{steps}"
  return f"table{suffix}", f"mlm_perplexity{suffix}"


# Equal tuning: every model gets the same search (learning rate x warm-up
# share of the steps), chosen on C4 documents carved from the training
# sample (every ``VALIDATION_EVERY``-th), never on the reported held-out
# set; the selection runs use a seed none of the reported runs uses, and
# every tuned model then trains on the rest of the sample (untuned runs on
# the whole sample).
TUNE_LRS = selection.LRS
TUNE_WARMUP_SHARES = selection.WARMUP_SHARES
TUNE_SEED = selection.SEED
VALIDATION_EVERY = selection.VALIDATION_EVERY


def tune_settings(steps: int, lrs=None) -> list[dict]:
  """The search of every model (``selection.settings``; ``lrs``: the
  search's rates, default ``TUNE_LRS``)."""
  return selection.settings(steps, lrs or TUNE_LRS, TUNE_WARMUP_SHARES)


def carve_validation(source: pathlib.Path, folder: pathlib.Path) -> dict:
  """``folder/train.jsonl`` and ``folder/validation.jsonl`` (every
  ``VALIDATION_EVERY``-th document) of the JSON-lines ``source``
  (``selection.carve_lines``)."""
  return selection.carve_lines(source, folder)


split_record = selection.split_record


def tuned_notes(split: dict, steps: int, seeds: str, lrs=None) -> str:
  """How ``--tune`` chose and what it reports (the table's notes' start)."""
  return (
      f"Equal tuning: each model trained {steps} steps at each of the "
      f"{len(tune_settings(steps, lrs))} settings (seed {TUNE_SEED}) and "
      f"scored on the carved validation split, every {VALIDATION_EVERY}th "
      f"document of the C4 sample ({split['validation']['documents']} documents, "
      f"sha256 {split['validation']['sha256'][:12]}...); the chosen setting "
      f"(*) then trained with seeds {seeds} on the other "
      f"{split['train']['documents']} documents (sha256 "
      f"{split['train']['sha256'][:12]}...) and scored on the held-out "
      "WikiText-2 rows; baselines counted on that train split. ")


# ``c`` on the carved train part; ``select``: scored on the carved rest.
carved_config = selection.carved
lean = selection.lean


def choose(runs_by_model: dict) -> dict:
  """Each model's setting of lowest validation perplexity at the end of
  its selection run (``selection.choose``)."""
  return selection.choose(runs_by_model, final_perplexity, higher=False)


def tune(exp, models, seeds, steps: int, prefix: str, run, lrs=None, *,
         split: dict, reverse: bool = False) -> tuple[dict, dict, dict]:
  """Every model's search (``tune_settings`` over ``lrs``) and its seeds at
  its choice (``choose``): ``selection.tune`` with ``run(model, seed,
  setting, key, select)``, every run recording ``split``'s digest;
  ``reverse``: a second process's order."""
  return selection.tune(exp, models, seeds, tune_settings(steps, lrs),
                        prefix, run, final_perplexity, higher=False,
                        reverse=reverse, tag=selection.split_tag(split))


# The small scale's length rule: the shortest training length at which every
# model's perplexity is below this share of the unigram's and below the
# bigram's, judged on the carved validation split (``budget_check``).
BUDGET_SHARE = 0.6


def budget_check(exp, prefix: str, searched: dict, chosen: dict, lengths,
                 steps: int, config, split: dict, models) -> tuple[dict, dict]:
  """``({length: {model: validation perplexity}}, baselines)``
  (``selection.length_check``): each model at its chosen lr and warm-up
  share trained for each of ``lengths`` on ``split``'s carved train part
  and scored on its carved validation part, and the unigram and bigram
  perplexity of those validation positions. ``config(model, seed,
  length)``: the run config. The length the rule picks for ``models`` is
  recorded (``selection.record_length``)."""
  base = exp.baseline(f"{prefix}carved_validation/seed={TUNE_SEED}",
                      lambda: lm_baselines(carved_config(config(
                          "attention", TUNE_SEED, steps), split, select=True)))

  def run(model, setting, n, key):
    c = carved_config(config(model, TUNE_SEED, n), split, setting,
                      select=True)
    return lean(experiment.train(c, exp.workdir(key)))
  tag = selection.split_tag(split)
  ppl = selection.length_check(exp, prefix, searched, chosen, lengths,
                               steps, run, final_perplexity, tag=tag)
  selection.record_length(exp, prefix, steps, budget_rule(ppl, base, models),
                          ppl, chosen, tag)
  return ppl, base


def budget_bar(base: dict) -> float:
  """The length rule's bar: below ``BUDGET_SHARE`` x the unigram
  perplexity and below the bigram's."""
  return min(BUDGET_SHARE * base["unigram"], base["bigram"])


def budget_rule(ppl: dict, base: dict, models) -> int | None:
  """The shortest length of ``ppl`` (``budget_check``'s) at which every one
  of ``models`` is below ``budget_bar``; None where none is."""
  return selection.shortest_length(ppl, budget_bar(base), models)


def budget_section(ppl: dict, base: dict, models, steps: int) -> str:
  """The tuned table's section on the training length
  (``selection.length_section``)."""
  return selection.length_section(
      ppl, budget_bar(base), f"min({BUDGET_SHARE:g} x unigram "
      f"{base['unigram']:.1f}, bigram {base['bigram']:.1f})", models, steps,
      LABELS)
