"""Train-step efficiency of every zoo model family against a measured ceiling.

For each model: the full training step the loop runs (forward, backward,
AdamW with clipping; ``steps.make_train_step`` compiled by
``steps.jit_train_step`` on a one-device mesh, state donated), its time per
step, XLA's FLOP count of the compiled step, and MFU = FLOPs / time / the
FLOP/s of a jitted 2048 x 2048 matmul measured in the same process on the
same device and dtype. Families: the GLUE-size encoders (HyperMixer, MLP
Mixer, gMLP, Transformer, FNet) with MLM and classification heads, the gMLP
and MLP-Mixer image models at 224 x 224, and the sMLP LM with Switch and
Base Layers routers at equal FLOPs. Every row is measured in float32 and in
bfloat16 compute (``--dtypes``).

    taskset -c 1 python experiments/bench_train_step.py --out /tmp/bench
    taskset -c 1 python experiments/bench_train_step.py --quick
    python experiments/bench_train_step.py --models glue_hypermixer/mlm \
        --profile     # also the XLA ops that take the time

Notes. XLA's cost analysis counts a while loop's body once, so the FLOPs of
Base Layers' auction (a while loop) are under-counted; it is a small part of
the step's arithmetic. On a shared host pin the process (``taskset -c 1``):
the ceiling and the steps then run on the same single core, and the ratios
are comparable even when the absolute speed of the core varies.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_common as bc  # noqa: E402
from hypermixer_jax import models  # noqa: E402
from hypermixer_jax import sharding  # noqa: E402
from hypermixer_jax.data import preprocessors  # noqa: E402
from hypermixer_jax.models import smlp  # noqa: E402
from hypermixer_jax.train import optim  # noqa: E402
from hypermixer_jax.train import steps  # noqa: E402
from hypermixer_jax.train.config import base_config  # noqa: E402
from hypermixer_jax.train.config import text_model  # noqa: E402


def _glue(mixer, head):
  return lambda quick: _shrink(text_model(mixer, head), quick), 32, 128


def _image(name):
  return lambda quick: _shrink(models.get_model_config(name), quick), 8, None


def _smlp(router):
  def make(quick):
    c = smlp.smlp_config("tiny")
    d, f, n, e = (64, 256, 64, 4) if quick else (256, 1024, 256, 8)
    c.update(dict(d_model=d, d_ffn=f, max_len=n, vocab_size=32128,
                  num_dense_layers=2, num_sparse_layers=2))
    c.moe.update(dict(num_experts=e, expert_d_ffn=f, tmoe_router=router))
    return c
  return make, 8, None


def _shrink(config, quick):
  if quick:
    config.num_layers = min(config.num_layers, 2)
  return config


MODELS = {
    "glue_hypermixer/mlm": _glue("hypermixer", "mlm"),
    "glue_hypermixer/classify": _glue("hypermixer", "pair_classify"),
    "glue_mlp_mixer/mlm": _glue("mlp_mixer", "mlm"),
    "glue_mlp_mixer/classify": _glue("mlp_mixer", "pair_classify"),
    "glue_gmlp/classify": _glue("gmlp", "pair_classify"),
    "glue_attention/classify": _glue("attention", "pair_classify"),
    "glue_fnet/classify": _glue("fnet", "pair_classify"),
    "gmlp_ti/image": _image("gmlp_ti"),
    "mixer_s16/image": _image("mixer_s16"),
    "smlp_switch/causal_lm": _smlp("switch"),
    "smlp_base/causal_lm": _smlp("base"),
}
DEFAULT = ("glue_hypermixer/mlm", "glue_hypermixer/classify",
           "glue_mlp_mixer/classify", "glue_attention/classify",
           "gmlp_ti/image", "mixer_s16/image", "smlp_switch/causal_lm",
           "smlp_base/causal_lm")


def make_batch(cfg, batch: int, length: int, rng: np.random.RandomState
               ) -> dict[str, np.ndarray]:
  """A batch in the data contract's format (CONTRIBUTING.md) for the head."""
  head, n = models.model_facts(cfg).head, length
  if cfg.family == "continuous":
    return {"inputs": rng.randn(batch, n, cfg.input_dim).astype(np.float32),
            "label": rng.randint(0, cfg.num_classes, batch).astype(np.int32)}
  out = {"inputs": rng.randint(5, cfg.vocab_size, (batch, n)).astype(np.int32),
         "segment_ids": np.ones((batch, n), np.int32),
         "positions": np.broadcast_to(np.arange(n, dtype=np.int32),
                                      (batch, n)).copy()}
  if head == "mlm":
    # As the pipeline gives it: max_predictions(n) selected positions per row
    # and BERT's masked_lm_positions, so the head runs at those only.
    out["targets"] = rng.randint(5, cfg.vocab_size, (batch, n)).astype(
        np.int32)
    slots = preprocessors.max_predictions(n)
    pos = np.sort(np.argsort(rng.rand(batch, n), axis=1)[:, :slots], axis=1)
    out["masked_positions"] = pos.astype(np.int32)
    out["weights"] = np.zeros((batch, n), np.float32)
    np.put_along_axis(out["weights"], pos, 1.0, axis=1)
  elif head == "causal_lm":
    out["targets"] = rng.randint(5, cfg.vocab_size, (batch, n)).astype(
        np.int32)
    out["weights"] = np.ones((batch, n), np.float32)
  else:
    out["label"] = rng.randint(0, cfg.num_classes, batch).astype(np.int32)
    if cfg.get("type_vocab_size", 0):
      out["token_type_ids"] = (np.arange(n) >= n // 2).astype(
          np.int32)[None].repeat(batch, 0)
  return out


def build_step(model_cfg, batch_size: int, length: int | None):
  """(compiled step, state, batch, rng, flops) for one model config."""
  config = base_config()
  config.model = model_cfg
  config.mesh.data = 1
  mesh = sharding.build_mesh(config.mesh, devices=jax.devices()[:1])
  rules = sharding.get_rules(config.sharding)
  model = models.build_model(model_cfg)
  tx, _ = optim.make_optimizer(config)
  n = length or model_cfg.max_len
  batch = make_batch(model_cfg, batch_size, n, np.random.RandomState(0))
  batch_sh = sharding.batch_shardings(batch, mesh, rules)
  state, state_sh = steps.create_train_state(model, tx, jax.random.key(0),
                                             batch, mesh, rules)
  facts = models.model_facts(model_cfg)
  step = steps.jit_train_step(
      steps.make_train_step(model, facts.head,
                            loss_weights=facts.loss_weights),
      state_sh, batch_sh, mesh, rules)
  batch = sharding.make_global_batch(batch, mesh, rules)
  rng = jax.device_put(jax.random.key(1), jax.NamedSharding(mesh, jax.P()))
  compiled = step.lower(state, batch, rng).compile()
  return compiled, state, batch, rng, bc.xla_flops(compiled)


def time_steps(compiled, state, batch, rng, repeats: int, min_seconds: float
               ) -> tuple[float, object]:
  """Best-of-``repeats`` seconds per step (the state is donated and carried)."""
  state, m = compiled(state, batch, rng)
  jax.block_until_ready(m)
  t0 = time.perf_counter()
  state, m = compiled(state, batch, rng)
  jax.block_until_ready(m)
  inner = max(1, int(min_seconds / max(time.perf_counter() - t0, 1e-6)))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(inner):
      state, m = compiled(state, batch, rng)
    jax.block_until_ready(m)
    best = min(best, (time.perf_counter() - t0) / inner)
  return best, state


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default=",".join(DEFAULT),
                  help=f"comma-separated, from: {', '.join(MODELS)}")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--batch_scale", type=float, default=1.0,
                  help="multiplies every model's batch size")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--min_seconds", type=float, default=1.0)
  ap.add_argument("--quick", action="store_true",
                  help="2 layers, small sMLP, quarter batches, short timing")
  ap.add_argument("--profile", action="store_true",
                  help="print the XLA ops that take each step's time")
  ap.add_argument("--out", default="", help="folder for the table and json")
  args = ap.parse_args()
  names = [m for m in args.models.split(",") if m]
  unknown = [m for m in names if m not in MODELS]
  if unknown:
    raise SystemExit(f"unknown --models {unknown}; choose from "
                     f"{', '.join(MODELS)}")
  if args.quick:
    args.batch_scale, args.repeats, args.min_seconds = 0.25, 1, 0.2

  rows, results, ceilings = [], [], {}
  for dtype in args.dtypes.split(","):
    ceilings[dtype] = bc.matmul_ceiling(jnp.dtype(dtype))
    print(f"# {dtype} matmul ceiling: {ceilings[dtype] / 1e9:.1f} GFLOP/s",
          flush=True)
    for name in names:
      make, batch, length = MODELS[name]
      cfg = make(args.quick)
      cfg.dtype = dtype
      batch = max(1, int(batch * args.batch_scale))
      compiled, state, xs, rng, flops = build_step(cfg, batch, length)
      t, state = time_steps(compiled, state, xs, rng, args.repeats,
                            args.min_seconds)
      if args.profile:
        holder = [state]

        def one(b, r):
          holder[0], m = compiled(holder[0], b, r)
          return m
        for op, ms, share in bc.profile_ops(one, xs, rng):
          print(f"#   {name} {dtype}: {op:<36} {ms:9.2f} ms {100 * share:5.1f}%")
      mfu = flops / t / ceilings[dtype]
      n = length or cfg.max_len
      rows.append((name, dtype, batch, n, t * 1e3, flops / 1e9,
                   flops / t / 1e9, 100 * mfu, batch * n / t))
      results.append(dict(model=name, dtype=dtype, batch=batch, length=n,
                          seconds=t, flops=flops, mfu=mfu,
                          ceiling=ceilings[dtype]))
      print(f"# {name} {dtype}: {t * 1e3:.1f} ms, MFU {100 * mfu:.1f}%",
            flush=True)
      del compiled, state, xs

  base = {r["dtype"]: r["seconds"] for r in results
          if r["model"] == "smlp_switch/causal_lm"}
  notes = [f"{k} matmul ceiling {v / 1e9:.1f} GFLOP/s" for k, v in
           ceilings.items()]
  for r in results:
    if r["model"] == "smlp_base/causal_lm" and r["dtype"] in base:
      notes.append(f"Base Layers / Switch step time ({r['dtype']}): "
                   f"{r['seconds'] / base[r['dtype']]:.2f}")
  text = (f"Train step (fwd + bwd + AdamW), {bc.device_name()}"
          f"{', --quick' if args.quick else ''}; " + "; ".join(notes) + "\n\n"
          + bc.markdown_table(
              ("model/head", "dtype", "batch", "length", "ms/step",
               "GFLOP/step (XLA)", "GFLOP/s", "MFU % of ceiling",
               "tokens/s"), rows))
  print(text)
  bc.write_outputs(args.out, "train_step", text,
                   dict(ceilings=ceilings, rows=results))


if __name__ == "__main__":
  main()
