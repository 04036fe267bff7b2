"""The sMLP-vs-MoE study (``experiments/smlp_vs_moe.py``, Yu et al. 2022,
§4.3): its models and ablations, training configs, FLOPs matched by depth,
held-out scoring on each row's last 80%, count baselines, and its tables
and figure."""
from __future__ import annotations

import math
import pathlib
from typing import Any, Callable, Mapping, Sequence

import ml_collections

from hypermixer_jax import baselines
from hypermixer_jax import experiment
from hypermixer_jax.experiment import selection

# name -> (label, family fields, moe fields).
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "smlp_deterministic": ("sMLP (deterministic)", dict(token_mixer="gmlp"),
                           dict(tmoe_router="base",
                                smoe_routing="deterministic")),
    "smlp_partial": ("sMLP (partial prediction)", dict(token_mixer="gmlp"),
                     dict(tmoe_router="base", smoe_routing="partial")),
    "switch": ("Switch Transformer", dict(token_mixer="attention"),
               dict(tmoe_router="switch")),
    "gshard": ("GShard", dict(token_mixer="attention"),
               dict(tmoe_router="gshard")),
    "base_layers": ("Base Layers", dict(token_mixer="attention"),
                    dict(tmoe_router="base")),
    "hash": ("HASH Layers", dict(token_mixer="attention"),
             dict(tmoe_router="hash")),
    "gmlp": ("gMLP (dense)", dict(token_mixer="gmlp"), {}),
    "transformer": ("Transformer (dense)", dict(token_mixer="attention"), {}),
}
DENSE = ("gmlp", "transformer")
REFERENCE = "smlp_deterministic"
# Ablations: name -> (label, base model, moe overrides); sMLP's depth.
ABLATIONS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "smlp_e2": ("sMLP det., 2 experts", REFERENCE, dict(num_experts=2)),
    "smlp_e8": ("sMLP det., 8 experts", REFERENCE, dict(num_experts=8)),
    "smlp_switch_tmoe": ("sMLP det., Switch tMoE", REFERENCE,
                         dict(tmoe_router="switch")),
}
# The paper's claims (§4.3, Fig. 5, Table 4 top; the table's numbers are not
# in the text at hand): at ~0.8 TFLOPs, d=1024, d_ffn=4096, 25k steps.
PAPER = {
    "smlp_deterministic": "best valid ppl and highest WPS (both routings)",
    "smlp_partial": "best valid ppl and highest WPS (both routings)",
    "hash": "best of the Transformer MoEs, least time",
    "switch": "worse than sMLP", "gshard": "worse than sMLP",
    "base_layers": "worse than sMLP", "gmlp": "worse than sMLP",
    "transformer": "worse than sMLP",
}
SCALES = {
    "small": dict(d_model=64, d_ffn=256, num_experts=4, num_heads=1,
                  seq_len=128, smlp_depth=(2, 2), batch_size=8, steps=250,
                  lr=3e-3, warmup=25, evals=5, eval_steps=16, max_layers=12),
    "paper": dict(d_model=1024, d_ffn=4096, num_experts=16, num_heads=16,
                  seq_len=1024, smlp_depth=(12, 4), batch_size=256,
                  steps=25_000, lr=6e-4, warmup=2_000, evals=25,
                  eval_steps=50, max_layers=48),
}
# The small scale on the 8k vocabulary: width 128, so that the blocks hold
# more of the train step's FLOPs than the embedding and output layer, and
# the budget that takes the models below 0.6 x the unigram perplexity.
SMALL_BUDGET_NOTE = (
    "Training length: 1,000 steps, set as the budget that takes the models "
    "below 0.6 x the unigram perplexity on this held-out set: a choice made "
    "on the reported data, the same for every model, {}. ")
SMALL_VOCAB = dict(d_model=128, d_ffn=512, num_heads=2, smlp_depth=(3, 3),
                   batch_size=16, steps=1000, warmup=50, evals=5)
# How the MoE layers move tokens (tMoE) and columns (partial sMoE) to their
# experts in this study: GShard's one-hot dispatch and combine einsums, whose
# FLOPs XLA counts, so the FLOP matching counts them too. Every run and FLOP
# fit recorded here ran them (records from before the layers had the choice
# hold no ``dispatch`` field: ``recorded_dispatch``). The layers' default,
# 'index' (gathers, ~0 FLOPs), computes the same outputs; matched on its
# counts, four depths differ (the results page lists them).
DISPATCH = "einsum"
# A run's measured train-step FLOPs/token against its plan's fit: beyond this
# relative difference one of them was made by other code.
FLOPS_TOLERANCE = 0.01


def recorded_dispatch(record: Mapping[str, Any]) -> str:
  """The dispatch a recorded run or FLOP fit ran (the einsums where the
  record predates the field)."""
  return record.get("dispatch", "einsum")


def retire_other_dispatch(exp: experiment.Experiment, key: str,
                          dispatch: str = DISPATCH) -> None:
  """Retires ``key``'s record when it ran another dispatch than
  ``dispatch`` (its FLOPs, and so the depths matched on them, differ)."""
  exp.reload()
  record = exp.runs.get(key)
  if record is not None and recorded_dispatch(record) != dispatch:
    exp.supersede(key, f"ran dispatch={recorded_dispatch(record)!r}, "
                  f"expected dispatch={dispatch!r}")


def recorded_fit(exp: experiment.Experiment, key: str,
                 measure: Callable[[], dict[str, float]],
                 dispatch: str = DISPATCH) -> dict[str, Any]:
  """A FLOP fit recorded under ``key`` (``measure()`` where none is, or
  where the recorded one counted another dispatch than ``dispatch``, the
  one ``measure`` runs)."""
  retire_other_dispatch(exp, key, dispatch)
  return exp.run(key, lambda: {**measure(), "dispatch": dispatch})


def check_flops(name: str, plan_entry: Mapping[str, Any],
                run: Mapping[str, Any]) -> None:
  """Refuses a run whose own train-step FLOPs/token (``run_summary``)
  differ from its plan's fit by more than ``FLOPS_TOLERANCE``: the two were
  counted on different code, so the run's depth is not the matched one."""
  got, want = run["flops_per_token"], plan_entry["flops"]
  if abs(got / want - 1) > FLOPS_TOLERANCE:
    raise ValueError(
        f"{name}: a recorded run measured {got:,.0f} FLOPs/token, its FLOP "
        f"fit predicts {want:,.0f} at depth {tuple(plan_entry['depth'])}: "
        "one of them was made by other code; retire the stale record "
        "(Experiment.supersede) and run it again.")


def settings(scale: str, vocab: str) -> tuple[str, dict[str, Any]]:
  """(regime, sizes): the key prefix of the runs in results.json and the
  scale's sizes and budget for the vocabulary (``small`` or ``t5``)."""
  if vocab not in ("small", "t5"):
    raise ValueError(f"--vocab={vocab!r}: use small or t5.")
  if scale == "small" and vocab == "small":
    return "small8k", {**SCALES["small"], **SMALL_VOCAB}
  return scale, dict(SCALES[scale])


def model_config(name: str, scale: str, depth: tuple[int, int],
                 moe: Mapping[str, Any] | None = None,
                 small_vocab: bool = False) -> ml_collections.ConfigDict:
  """``config.model`` of ``name`` (a key of ``MODELS``) at ``depth`` =
  (N1 dense, N2 sparse blocks); ``moe`` overrides ``MODELS``' MoE fields;
  ``small_vocab``: the sizes of the small scale's 8k-vocabulary regime."""
  if name not in MODELS:
    raise ValueError(f"unknown model {name!r}; models: {', '.join(MODELS)}.")
  _, fields, moe_fields = MODELS[name]
  s = settings(scale, "small" if small_vocab else "t5")[1]
  c = experiment.load_config("smlp_lm.py", "base").model
  n1, n2 = depth
  if name in DENSE and n2:
    raise ValueError(f"{name} is dense: depth {depth} must have N2 = 0.")
  c.update(dict(d_model=s["d_model"], d_ffn=s["d_ffn"], max_len=s["seq_len"],
                num_heads=s["num_heads"], num_dense_layers=n1,
                num_sparse_layers=n2, **fields))
  if scale == "small":
    c.dtype = "float32"                    # bf16 is slow on CPUs
  c.moe.update({**dict(num_experts=s["num_experts"], expert_d_ffn=s["d_ffn"],
                       dispatch=DISPATCH), **moe_fields, **(moe or {})})
  return c


def run_config(name: str, scale: str, depth: tuple[int, int],
               shared: pathlib.Path | None, data_dir: str = "",
               vocab: dict | None = None, seed: int = 0,
               steps: int | None = None) -> ml_collections.ConfigDict:
  """The training config of a model (``MODELS``) or an ablation
  (``ABLATIONS``: its base model with its MoE overrides) at ``depth``."""
  base, moe = ABLATIONS[name][1:] if name in ABLATIONS else (name, {})
  return train_config(model_config(base, scale, depth, moe, bool(vocab)),
                      scale, shared, data_dir, vocab=vocab, seed=seed,
                      steps=steps)


def train_config(model: ml_collections.ConfigDict, scale: str,
                 shared: pathlib.Path | None, data_dir: str = "",
                 vocab: dict | None = None, seed: int = 0,
                 steps: int | None = None) -> ml_collections.ConfigDict:
  """The training config: ``configs/smlp_lm.py``'s optimiser and data with
  the scale's schedule; one document per row (no packing) for every model,
  since partial routing reads each row's own first 20%. ``vocab``: an
  ``experiment.small_vocab`` record (small scale: the 8k regime's model
  and budget), else T5's vocabulary."""
  if vocab and scale != "small":
    raise ValueError("train_config: a small vocabulary is for --scale=small.")
  s = settings(scale, "small" if vocab else "t5")[1]
  c = experiment.load_config("smlp_lm.py", "base")
  c.model = model
  c.seed = seed
  c.data.seq_len = s["seq_len"]
  c.data.packing = False
  c.batch_size = c.eval_batch_size = s["batch_size"]
  c.learning_rate = s["lr"]
  c.warmup_steps = s["warmup"]
  c.end_learning_rate_factor = 0.1
  steps = c.num_train_steps = steps or s["steps"]
  c.eval_every = max(1, steps // s["evals"])
  c.eval_steps = s["eval_steps"]
  c.log_every = max(1, steps // 25)
  c.checkpoint_every = steps if scale == "small" else steps // 10
  c.keep_checkpoints = 1
  c.mesh.expert = 1
  if scale == "small":
    c.async_checkpoints = False
    if vocab:
      c.data.vocab_path = vocab["path"]
      c.model.vocab_size = vocab["model_vocab_size"]
      # WikiText read as articles (headings and blank lines dropped), as
      # the other language-model experiments hold it out.
      c.data.text_layout = "wikitext"
    else:
      c.data.vocab_path = experiment.require(
          shared / "t5_spm/sentencepiece.model", "SentencePiece vocabulary")
    c.data.local_files.train = ",".join(
        experiment.require(shared / "c4" / f, "C4 sample") for f in (
            "c4_en_tfds_minimal_train_1000.jsonl",
            "c4_en_train_00000_first1000.jsonl"))
  else:
    c.data.data_dir = data_dir
  c.data.local_files.validation = experiment.require(
      shared / "wikitext-2-raw/wiki.valid.raw", "WikiText-2 valid")
  return c


# ---------------------------------------------------------------------------
# FLOP matching.
# ---------------------------------------------------------------------------
def fit_block_flops(measure: Callable[[tuple[int, int]], float]
                    ) -> dict[str, float]:
  """FLOPs/token = ``base + dense * N1 + sparse * N2`` from three measured
  depths ((0, 0), (1, 0), (0, 1)); every block of a kind costs the same."""
  base = measure((0, 0))
  return {"base": base, "dense": measure((1, 0)) - base,
          "sparse": measure((0, 1)) - base}


def layer_flops(fit: Mapping[str, float], depth: tuple[int, int]) -> float:
  """The blocks' share of the FLOPs per token at ``depth``."""
  return fit["dense"] * depth[0] + fit["sparse"] * depth[1]


def depth_candidates(dense: bool, max_layers: int
                     ) -> list[tuple[int, int]]:
  """Depths a model may take: L dense blocks, or N1 dense + N2 >= 1 sparse
  blocks with |N1 - N2| <= 1 (sparse blocks spread evenly, as in the MoE
  papers' every-other-layer layout), at most ``max_layers`` blocks."""
  if dense:
    return [(n, 0) for n in range(1, max_layers + 1)]
  return [(n1, n2) for n2 in range(1, max_layers + 1)
          for n1 in (n2 - 1, n2, n2 + 1) if n1 >= 0 and n1 + n2 <= max_layers]


def choose_depth(fit: Mapping[str, float], target: float,
                 candidates: Sequence[tuple[int, int]]
                 ) -> tuple[tuple[int, int], float]:
  """(depth, layer FLOPs / target) of the candidate closest to ``target``
  in log ratio (a model 1.1x over and one 1.1x under are equally far)."""
  if target <= 0 or not candidates:
    raise ValueError(f"choose_depth: target {target} FLOPs and "
                     f"{len(candidates)} candidate depths.")
  best = min(candidates,
             key=lambda d: abs(math.log(max(layer_flops(fit, d), 1e-9)
                                        / target)))
  return best, layer_flops(fit, best) / target


def train_step_flops(config: ml_collections.ConfigDict) -> float:
  """FLOPs per token of ``config``'s compiled train step (XLA's cost
  analysis, the number the training loop's throughput uses), compiled by
  ``train.compile.compile_steps`` for the config's batch on one device."""
  import jax  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  compiled = compile_lib.compile_steps(config, jax.devices()[:1],
                                       with_eval=False)
  return metrics_lib.step_flops(compiled.train) / (
      config.batch_size * config.data.seq_len)


def heldout_last80(config: ml_collections.ConfigDict, workdir: str
                   ) -> dict[str, float]:
  """Held-out metrics of the run in ``workdir`` counted on each row's last
  80% (from floor(0.2 n), n its real tokens): the positions partial routing's
  loss counts, here for every model alike. The validation batches and the
  evaluation step are the training loop's (``evaluation.make_eval_step``
  with these loss weights, ``evaluation.evaluate``)."""
  import functools  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import data as data_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import sharding  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.models.moe import smoe  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import evaluation  # pylint: disable=g-import-not-at-top
  params = experiment.trained_params(config, workdir)
  model = models.build_model(config.model)
  head = models.model_facts(config.model).head
  weights = functools.partial(smoe.partial_loss_weights,
                              fraction=config.model.moe.partial_fraction)
  eval_step = evaluation.make_eval_step(model, head, loss_weights=weights)
  step = jax.jit(lambda p, b: eval_step(types.SimpleNamespace(params=p), b))
  mesh = sharding.build_mesh(dict(data=1, fsdp=1, tensor=1, expert=1),
                             jax.devices()[:1])
  batches = data_lib.build_pipeline(
      config.data, config.eval_split, batch_size=config.eval_batch_size,
      seed=config.seed, repeat=False, shuffle=False)
  out = evaluation.evaluate(lambda _, b: step(params, b), None, batches, mesh,
                            sharding.get_rules(config.sharding), head,
                            config.eval_steps)
  return {k: v for k, v in out.items() if not k.startswith("moe/")}


def lm_baselines(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Unigram and add-k bigram perplexity (train counts of ``config``'s
  train split) of the held-out positions the models are scored on: every
  target (``all``) and each row's last 80% (``last80``, as
  ``heldout_last80``)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.models.moe import smoe  # pylint: disable=g-import-not-at-top
  train = experiment.pipeline_arrays(config.data, "train")["targets"]
  held = experiment.held_out_arrays(config)
  last80 = dict(held, weights=np.asarray(smoe.partial_loss_weights(
      jnp.asarray(held["weights"]), jnp.asarray(held["segment_ids"]),
      config.model.moe.partial_fraction)))
  v = config.model.vocab_size
  return {"all": baselines.lm_baselines(train, held, vocab_size=v,
                                        causal=True),
          "last80": baselines.lm_baselines(train, last80, vocab_size=v,
                                           causal=True),
          "train_tokens": int((train != 0).sum())}


# ---------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------
def run_summary(result: Mapping[str, Any], tokens_per_step: int
                ) -> dict[str, float]:
  """Final held-out perplexity, tokens/s (median over the logged intervals)
  and the run's own FLOPs per token (from its throughput log)."""
  train = result["train_curve"]
  logs = [train[s] for s in sorted(train, key=int)
          if "tokens_per_sec" in train[s]]
  if not logs:
    raise ValueError("the run logged no throughput (log_every > steps?).")
  tps = sorted(r["tokens_per_sec"] for r in logs)[len(logs) // 2]
  evals = result["eval_curve"]
  last = evals[max(evals, key=int)]
  # The median is robust to the few intervals that hold an evaluation or a
  # checkpoint.
  return {"perplexity": last["perplexity"], "tokens_per_sec": tps,
          "flops_per_token": (experiment.flops_per_step(result)
                              / tokens_per_step),
          "train_seconds": result["step"] * tokens_per_step / tps}


def table_rows(names: Sequence[str], labels: Mapping[str, str],
               runs: Mapping[str, Sequence[Mapping[str, Any]]],
               plan: Mapping[str, Mapping[str, Any]], reference: str,
               paper: Mapping[str, str], unigram: float | None = None,
               untuned: bool = False) -> list[list[Any]]:
  """One row per model: depth, parameters, FLOPs (total, layers, vs the
  reference), held-out perplexity over its seeds' runs (mean ± sd; as
  trained, over ``unigram``, on each row's last 80%), whether the
  reference's perplexity is lower (Welch's test), tokens/s (mean,
  and vs the reference), the paper's claim."""
  ref = plan[reference]["layer_flops"]
  ref_runs = runs.get(reference) or []
  ref_ppl = [r["perplexity"] for r in ref_runs]
  ref_tps = sum(r["tokens_per_sec"] for r in ref_runs) / max(len(ref_runs), 1)
  rows = []
  for name in names:
    p, rs = plan[name], runs.get(name) or []
    for r in rs:
      check_flops(name, p, r)
    n1, n2 = p["depth"]
    row = [labels[name], f"{n1}+{n2}", f"{p['params'] / 1e6:.2f}M",
           f"{rs[0]['flops_per_token'] / 1e6:.2f}" if rs else "not run",
           f"{p['layer_flops'] / 1e6:.2f}",
           f"{p['layer_flops'] / ref:.2f}"]
    if rs:
      ppl = [r["perplexity"] for r in rs]
      last80 = [r["last80"]["perplexity"] for r in rs if r.get("last80")]
      tps = sum(r["tokens_per_sec"] for r in rs) / len(rs)
      row += [experiment.fmt_mean_sd(ppl),
              f"{sum(ppl) / len(ppl) / unigram:.2f}" if unigram else "",
              experiment.fmt_mean_sd(last80),
              "" if name == reference else experiment.verdict(
                  ref_ppl, ppl, "lower", untuned=untuned).text(words={
                      "agrees": "yes", "disagrees": "no, higher"}),
              f"{tps:,.0f}", f"{tps / ref_tps:.2f}" if ref_runs else ""]
    else:
      row += ["not run", "", "", "", "", ""]
    rows.append(row + [paper.get(name, "")])
  return rows


HEADERS = ["model", "blocks N1+N2", "params", "MFLOPs/token (train step)",
           "layer MFLOPs/token", "layer FLOPs vs sMLP",
           "WikiText-2 valid ppl", "ppl / unigram",
           "ppl, last 80% of each row", "sMLP (det.) lower?", "tokens/s",
           "tokens/s vs sMLP", "paper (§4.3, Table 4)"]


def baseline_rows(base: Mapping[str, Any]) -> list[list[Any]]:
  """The unigram and bigram rows: all scored positions, and each row's last
  80% in that column."""
  rows = experiment.perplexity_baseline_rows(
      HEADERS, base["all"], "WikiText-2 valid ppl", "ppl / unigram")
  last = HEADERS.index("ppl, last 80% of each row")
  rows[0][last] = f"{base['last80']['unigram']:.1f}"
  rows[1][last] = f"{base['last80']['bigram']:.1f}"
  return rows


# ---------------------------------------------------------------------------
# The study's steps: depths, runs, report.
# ---------------------------------------------------------------------------
def plan_entry(name: str, fit: Mapping[str, float], depth: tuple[int, int],
               config: Callable[..., ml_collections.ConfigDict]) -> dict:
  """Depth, block FLOPs per token, train-step FLOPs and parameters of
  ``name`` at ``depth`` (``config(name, depth)``: its training config)."""
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  return dict(depth=depth, layer_flops=layer_flops(fit, depth),
              flops=fit["base"] + layer_flops(fit, depth),
              params=models.count_params(config(name, depth).model))


def matched_plan(s: Mapping[str, Any], names: Sequence[str], config,
                 fit_of) -> dict:
  """Each model's depth whose blocks match sMLP's FLOPs per token (the
  ablations keep sMLP's). ``s``: the sizes of ``settings``;
  ``fit_of(name)``: its ``fit_block_flops``."""
  target = layer_flops(fit_of(REFERENCE), s["smlp_depth"])
  plan = {}
  for name in names:
    fit = fit_of(name)
    if name == REFERENCE or name in ABLATIONS:
      depth = s["smlp_depth"]
    else:
      depth, _ = choose_depth(fit, target, depth_candidates(
          name in DENSE, s["max_layers"]))
    plan[name] = plan_entry(name, fit, depth, config)
  return plan


def dispatch_table(plans: Mapping[str, Mapping[str, Any]]) -> str:
  """The FLOP matching under each dispatch (``{dispatch: matched_plan}``):
  each main model's depth and its blocks' FLOPs per token against sMLP's.
  The einsums' FLOPs grow with the tokens x experts x slots of a routing
  group; the index dispatch's gathers count ~0."""
  ref = {d: p[REFERENCE]["layer_flops"] for d, p in plans.items()}
  headers = ["model"] + [f"{h} ({d} dispatch)" for d in plans for h in (
      "N1+N2", "layer MFLOPs/token", "vs sMLP")]
  rows = []
  for name in MODELS:
    if not all(name in p for p in plans.values()):
      continue
    row = [MODELS[name][0]]
    for d, p in plans.items():
      n1, n2 = p[name]["depth"]
      row += [f"{n1}+{n2}", f"{p[name]['layer_flops'] / 1e6:.2f}",
              f"{p[name]['layer_flops'] / ref[d]:.2f}"]
    rows.append(row)
  return experiment.markdown_table(headers, rows)


def record_plan(exp: experiment.Experiment, s: Mapping[str, Any],
                names: Sequence[str], config, fit_of) -> dict:
  """``matched_plan``, recorded and printed."""
  target = layer_flops(fit_of(REFERENCE), s["smlp_depth"])
  plan = matched_plan(s, names, config, fit_of)
  # Merged into the recorded plan: a command naming fewer models keeps the
  # others' entries.
  exp.save(plan={**exp.data.get("plan", {}), **{
      k: {**v, "depth": list(v["depth"])} for k, v in plan.items()}})
  for name, pl in plan.items():
    print(f"{name}: depth {pl['depth']}, layer FLOPs/token "
          f"{pl['layer_flops'] / 1e6:.3f}M ({pl['layer_flops'] / target:.2f}"
          f" of sMLP), {pl['params'] / 1e6:.2f}M params", flush=True)
  return plan


def train_runs(exp: experiment.Experiment, plan: Mapping[str, Any],
               seeds: Sequence[int], budget: str, config,
               tokens_per_step: int) -> dict:
  """{model: [run of each seed]} (ablations: the first seed), each with its
  held-out perplexity over the rows' last 80%; ``budget``: the key prefix
  of the runs in results.json."""
  runs = {}
  for name, pl in plan.items():
    for seed in seeds[:1] if name in ABLATIONS else seeds:
      key = f"{budget}/runs/{name}/seed={seed}"
      cfg = config(name, tuple(pl["depth"]), seed)
      retire_other_dispatch(exp, key)
      tail = f"{budget}/last80/{name}/seed={seed}"
      exp.reload()
      final = pathlib.Path(exp.workdir(key)) / "checkpoints" / str(
          cfg.num_train_steps)
      if (key in exp.runs and tail not in exp.runs and not exp.report_only
          and not final.exists()):
        # Its perplexity over the last 80% reads the final checkpoint, which
        # a new machine does not have: the run is trained again.
        exp.supersede(key, "its final checkpoint is gone, and the last-80% "
                      "perplexity needs it")
      result = exp.cell(key, lambda c=cfg, k=key: dict(
          experiment.train(c, exp.workdir(k)), dispatch=DISPATCH))
      if result is not None:
        last80 = exp.cell(tail, lambda c=cfg, k=key: heldout_last80(
            c, exp.workdir(k)))
        runs.setdefault(name, []).append(
            {**result, **run_summary(result, tokens_per_step),
             "last80": last80})
  return runs


def notes(scale: str, s: Mapping[str, Any], vocab: dict | None, steps: int,
          seeds: Sequence[int], tuned: bool = False,
          checked: bool = False) -> str:
  """The table's notes: the shared setting, how depths and verdicts are
  found, and what XLA's counts leave out (``tuned``: each model at its own
  chosen lr and warm-up)."""
  vocab_text = (f"the {vocab['model_vocab_size']:,}-id SentencePiece "
                "vocabulary of the C4 sample" if vocab else
                "T5's 32,128-id vocabulary")
  budget = SMALL_BUDGET_NOTE.format(
      "checked on the carved validation split in the table's last section"
      if checked else "not confirmed on a carved split") if (
          vocab and steps == SMALL_VOCAB["steps"]) else ""
  return ("" if tuned else experiment.UNTUNED_NOTE) + budget + (
      f"{scale} scale: d={s['d_model']}, d_ffn={s['d_ffn']}, "
      f"{s['num_experts']} experts, {s['num_heads']} head(s), sequence "
      f"{s['seq_len']}, batch {s['batch_size']}, {steps} steps, AdamW "
      + ("at each model's chosen lr and warm-up (cosine to 0.1)" if tuned
         else f"lr {s['lr']:g} (warm-up {s['warmup']}, cosine to 0.1), the "
         "same for every model")
      + f"; {vocab_text}; seeds {seeds} (mean ± sd; ablations: the first "
      "seed). Depths chosen so that the blocks' FLOPs per token match "
      "sMLP's (XLA cost analysis of the compiled train step; the embedding "
      "and the output layer, equal for all, are the rest of the "
      "train-step column, which each run measured itself). Perplexity: per "
      "SentencePiece token on WikiText-2 valid after the last step "
      f"({s['eval_steps']} batches of {s['batch_size']} rows); partial "
      "routing's counts each row's last 80% only, so the next column counts "
      "those positions for every model (`heldout_last80`). 'sMLP (det.) "
      "lower?': the difference of the perplexities (sMLP's minus the "
      "model's) by Welch's test on the seeds (yes / no, higher: p < 0.05; "
      "every model is scored on the same held-out tokens, whose own noise "
      "is not in the interval). Unigram and add-k bigram: train-split "
      "counts, the same positions. XLA counts Base "
      "Layers' auction loop body once (training only), so its FLOPs are "
      "under-counted; Base Layers' training assignment reads the whole row "
      "(its inference routing is causal).")


def write_report(exp: experiment.Experiment, scale: str,
                 s: Mapping[str, Any], plan: Mapping[str, Any], runs: dict,
                 base: dict | None, vocab: dict | None, steps: int,
                 seeds: Sequence[int]) -> None:
  """The main table, the ablations' table and the figure."""
  labels = {**{n: m[0] for n, m in MODELS.items()},
            **{n: a[0] for n, a in ABLATIONS.items()}}
  main_names = [n for n in MODELS if n in plan]
  unigram = base["all"]["unigram"] if base else None
  table = experiment.markdown_table(HEADERS, table_rows(
      main_names, labels, runs, plan, REFERENCE, PAPER, unigram,
      untuned=True) + (baseline_rows(base) if base else []))
  abl = [n for n in ABLATIONS if n in plan]
  if abl:
    table += ("\n\nAblations, sMLP N1+N2 = "
              f"{s['smlp_depth'][0]}+{s['smlp_depth'][1]}:\n\n")
    table += experiment.markdown_table(HEADERS[:-1], [
        r[:-1] for r in table_rows([REFERENCE] + abl, labels, runs, plan,
                                   REFERENCE, {}, unigram, untuned=True)])
  exp.write_table(f"sMLP vs MoE Transformers at equal FLOPs ({scale} "
                  f"scale, {'8k' if vocab else 'T5'} vocabulary)", table,
                  notes(scale, s, vocab, steps, seeds))
  plot_runs(exp, runs, labels, base)


def plot_runs(exp: experiment.Experiment, runs: dict,
              labels: Mapping[str, str], base: dict | None) -> None:
  """Held-out perplexity against step and against training time (the
  runs' mean per model; ablations dashed), with the count baselines."""
  fig, axes = experiment.figure(ncols=2)
  for name, rs in runs.items():
    steps, ppl = experiment.mean_curve(rs, "perplexity")
    ppl = ppl.mean(0)
    ls = "--" if name in ABLATIONS else "-"
    axes[0, 0].plot(steps, ppl, ls=ls, marker="o",
                    label=f"{labels[name]} (n={len(rs)})")
    # Time axis: the step's share of the runs' measured training time.
    seconds = sum(r["train_seconds"] for r in rs) / len(rs)
    axes[0, 1].plot([seconds * s / steps[-1] for s in steps], ppl,
                    ls=ls, marker="o", label=labels[name])
  for ax, x in zip(axes[0], ("step", "training time (s)")):
    if base:
      experiment.baseline_lines(ax, {"unigram": base["all"]["unigram"],
                                     "bigram": base["all"]["bigram"]})
    experiment.style_axes(ax, x, "WikiText-2 valid perplexity", yscale="log",
                          legend=7 if x == "step" else 0)
  exp.save_figure(fig, "smlp_vs_moe")




# ---------------------------------------------------------------------------
# Equal tuning (``--tune``, small scale).
# ---------------------------------------------------------------------------
def carve_c4(exp: experiment.Experiment, config) -> dict:
  """The small scale's C4 training documents (both local samples, joined in
  order into ``exp``'s ``c4_split`` folder) with every
  ``selection.VALIDATION_EVERY``-th document carved out
  (``selection.carve_lines``); ``config``: any run config of the study."""
  folder = pathlib.Path(exp.workdir("c4_split"))
  folder.mkdir(parents=True, exist_ok=True)
  joined = folder / "c4_sample.jsonl"
  selection.settle_file(joined, "".join(
      pathlib.Path(f).read_text(encoding="utf-8")
      for f in config.data.local_files.train.split(",")))
  return selection.carve_lines(joined, folder)


def run_tag(split: dict) -> dict[str, str]:
  """What every search and length-check run records: the MoE dispatch, the
  weight-decay rule and the digest of ``split``'s carved validation part
  (runs of another are retired and run again)."""
  from hypermixer_jax.train import optim  # pylint: disable=g-import-not-at-top
  return {"dispatch": DISPATCH, "weight_decay_mask": optim.DECAY_MASK_RULE,
          **selection.split_tag(split)}


def tune(exp: experiment.Experiment, plan: Mapping[str, Any], seeds,
         budget: str, config, tokens_per_step: int, lrs=None,
         reverse: bool = False) -> tuple[dict, dict, dict, dict, dict]:
  """Every model's search at its planned depth (``selection.tune``): each
  run trains on the carved train part (the C4 documents less every 10th)
  and is scored by its final perplexity on the held-out tenth; then the
  seeds at each model's choice, trained on the same part and scored on WikiText-2 valid as the
  untuned runs. Every run records the dispatch, the weight-decay rule and
  the carve's digest (``run_tag``: runs of another are retired and run
  again).
  Returns ``(split, searched, chosen, runs, baselines)``."""
  names = [n for n in MODELS if n in plan]
  split = carve_c4(exp, config(REFERENCE, tuple(plan[REFERENCE]["depth"])))
  exp.save(c4_split=selection.split_record(split))
  steps = config(REFERENCE, tuple(plan[REFERENCE]["depth"])).num_train_steps

  def one(name, seed, setting, key, select):
    c = selection.carved(config(name, tuple(plan[name]["depth"]), seed),
                         split, setting, select=select)
    r = experiment.train(c, exp.workdir(key))
    if select:
      return dict(selection.lean(r), perplexity=r["eval"]["perplexity"])
    return {**r, **run_summary(r, tokens_per_step),
            "last80": heldout_last80(c, exp.workdir(key))}
  # The baselines first (a count, seconds): a report of a search still
  # running has them.
  base = exp.baseline(f"{budget}/carved", lambda: lm_baselines(
      selection.carved(config(REFERENCE, tuple(plan[REFERENCE]["depth"])),
                       split)), tag=selection.split_tag(split))
  searched, chosen, runs = selection.tune(
      exp, names, seeds, selection.settings(steps, lrs), f"{budget}/", one,
      lambda r: r["perplexity"], higher=False, reverse=reverse,
      tag=run_tag(split))
  return split, searched, chosen, runs, base


# The small scale's length rule, judged on the carved validation split
# (``length_check``): the shortest length at which every model is below this
# share of the unigram perplexity of those positions.
LENGTH_SHARE = 0.6


def length_check(exp: experiment.Experiment, plan: Mapping[str, Any],
                 tuned: tuple, lengths, config, prefix: str
                 ) -> tuple[dict, dict]:
  """``selection.length_check`` of ``tune``'s search ``tuned``: each model
  at its choice trained for each of ``lengths`` on the carved train part
  and scored on the carved documents; with the baselines of those
  positions. ``config(name, depth, seed, length)``: the run config. The
  length the rule picks is recorded (``selection.record_length``)."""
  split, searched, chosen = tuned[:3]
  depth = {n: tuple(plan[n]["depth"]) for n in plan}
  steps = config(REFERENCE, depth[REFERENCE]).num_train_steps
  base = exp.baseline(
      f"{prefix}/carved_validation/seed={selection.SEED}",
      lambda: lm_baselines(selection.carved(config(
          REFERENCE, depth[REFERENCE], selection.SEED), split, select=True)))

  def run(name, setting, n, key):
    c = selection.carved(config(name, depth[name], selection.SEED, n), split,
                         setting, select=True)
    r = experiment.train(c, exp.workdir(key))
    return dict(selection.lean(r), perplexity=r["eval"]["perplexity"])
  scores = selection.length_check(
      exp, f"{prefix}/", searched, chosen, lengths, steps, run,
      lambda r: r["perplexity"], tag=run_tag(split))
  names = [n for n in MODELS if n in plan]
  selection.record_length(exp, f"{prefix}/", steps, selection.shortest_length(
      scores, length_bars(base, names), names), scores, chosen,
      run_tag(split))
  return scores, base


def length_bars(base: Mapping[str, Any], names) -> dict[str, float]:
  """Each model's bar of the length rule: ``LENGTH_SHARE`` x the unigram
  perplexity of the positions it is scored on (partial routing's
  evaluation counts each row's last 80% alone)."""
  return {n: LENGTH_SHARE * base["last80" if MODELS.get(n, ("", {}, {}))[2]
                                  .get("smoe_routing") == "partial"
                                  else "all"]["unigram"] for n in names}


def report_tuned(exp: experiment.Experiment, s: Mapping[str, Any],
                 plan: Mapping[str, Any], tuned: tuple, vocab: dict | None,
                 steps: int, seeds: Sequence[int], lrs=None,
                 check: tuple | None = None) -> None:
  """``table_tuned.md``: the main table's columns for the tuned runs, each
  model's choice, and every model's search (validation perplexity);
  ``check``: ``length_check``'s, as a last section."""
  split, searched, chosen, runs, base = tuned
  labels = {n: m[0] for n, m in MODELS.items()}
  names = [n for n in MODELS if n in plan]
  table = experiment.markdown_table(HEADERS, table_rows(
      names, labels, runs, plan, REFERENCE, PAPER,
      base["all"]["unigram"]) + baseline_rows(base))
  table += "\n\n" + selection.search_section(
      searched, chosen, labels, lrs, what="perplexity",
      cell=lambda r: f"{r['perplexity']:.1f}")
  if check:
    table += selection.length_section(
        check[0], length_bars(check[1], names), f"{LENGTH_SHARE:g} x the "
        "unigram of the positions scored (all; partial routing: each row's "
        "last 80%)", names, steps, labels)
  text = selection.notes(
      "document of the two C4 samples", split, steps,
      ",".join(map(str, seeds)), len(selection.settings(steps, lrs)),
      "WikiText-2 valid", "perplexity at the last step")
  text += notes("small", s, vocab, steps, seeds, tuned=True,
                checked=bool(check))
  exp.write_table(f"sMLP vs MoE Transformers at equal FLOPs, every model "
                  f"tuned alike (small scale, "
                  f"{'8k' if vocab else 'T5'} vocabulary)", table, text,
                  name="table_tuned")
