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

    taskset -c 1 python benchmarks/bench_train_step.py --out /tmp/bench
    taskset -c 1 python benchmarks/bench_train_step.py --quick
    python benchmarks/bench_train_step.py --models glue_hypermixer/mlm \
        --profile     # also the XLA ops that take the time
    taskset -c 1 python benchmarks/bench_train_step.py \
        --linear_attention=64,512,2048 --rounds 3

``--linear_attention=64,512,2048`` instead times, per length and head
(``--linear_heads``), the steps of the Linear Transformer's implementations
(``train_steps.LINEAR_VARIANTS``: the per-position outer products it had,
the chunked form, the chunked form told that rows are unpacked) and of the
softmax Transformer in the same interleaved rounds, and prints steps/s and
the speed ratios to the outer-product form.

Timing: ``--rounds`` rounds alternate the ceiling and the step (ceiling,
step, ceiling, ..., ceiling; ``bench.interleave``), each round at
least ``--min_seconds``, after untimed warm-up calls. The table gives the
step's minimum and median time, and the MFU two ways: best step against
best ceiling, and the median over rounds of each round's step against the
mean of the two ceiling rounds around it (``bench.summarize``).
On an accelerator (``JAX_PLATFORMS=cuda`` or ``tpu``) the table also gives
MFU against the device's dense peak from ``PEAK_FLOPS``.

Notes. XLA's cost analysis counts a while loop's body once, so the FLOPs of
Base Layers' auction (a while loop) are under-counted; it is a small part of
the step's arithmetic. On a shared host pin the process (``taskset -c 1``):
the ceiling and the steps then run on the same single core, and the ratios
are comparable even when the absolute speed of the core varies.
"""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hypermixer_jax.experiment import bench as bc  # noqa: E402
from hypermixer_jax.experiment import train_steps  # noqa: E402
from hypermixer_jax import models  # noqa: E402
from hypermixer_jax.models import smlp  # noqa: E402
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


def interleave_groups(names: list[str]) -> list[list[str]]:
  """Models timed in the same interleaved rounds: the Switch and Base
  Layers sMLP steps together (their ratio is a target), the rest alone."""
  smlp = [n for n in names if n.startswith("smlp_")]
  groups = [[n] for n in names if not n.startswith("smlp_")]
  return groups + ([smlp] if smlp else [])


def linear_attention_table(args) -> None:
  """Train steps/s of each ``train_steps.LINEAR_VARIANTS`` entry per length
  and head, timed in the same interleaved rounds; ratios to the old linear
  path."""
  rows, results = [], []
  ceiling, _ = bc.ceiling_timer(min_seconds=args.min_seconds)
  for head in args.linear_heads.split(","):
    for n in (int(v) for v in args.linear_attention.split(",")):
      steps = train_steps.linear_attention_steps(head, n)
      batch = steps[train_steps.OLD_LINEAR][1]
      _, times, _ = train_steps.interleaved_steps(
          ceiling, steps, args.rounds, args.min_seconds)
      old = times[train_steps.OLD_LINEAR]
      for name, t in times.items():
        rows.append((head, n, batch, name, 1 / min(t),
                     min(old) / min(t), float(np.median(np.divide(old, t)))))
        print(rows[-1], flush=True)
      results.append(dict(head=head, n=n, batch=batch, times=times))
  text = (f"Train step (fwd + bwd + AdamW) of 2-layer width-128 models, "
          f"{bc.device_name()}; {args.rounds} interleaved rounds\n\n"
          + bc.markdown_table(
              ("head", "N", "batch", "model", "steps/s (best)",
               "speed / old linear (min/min)",
               "speed / old linear (median of rounds)"), rows))
  print(text)
  bc.write_outputs(args.out, "linear_attention", text, results)


def _args():
  ap = bc.parser(__doc__, rounds="rounds", min_seconds=1.0,
                 quick="2 layers, small sMLP, quarter batches, short timing")
  ap.add_argument("--models", default=",".join(DEFAULT),
                  help=f"comma-separated, from: {', '.join(MODELS)}")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--batch_scale", type=float, default=1.0,
                  help="multiplies every model's batch size")
  ap.add_argument("--profile", action="store_true",
                  help="print the XLA ops that take each step's time")
  ap.add_argument("--linear_attention", default="",
                  help="lengths: time linear attention's implementations "
                  "and the softmax Transformer instead "
                  "(train_steps.LINEAR_VARIANTS)")
  ap.add_argument("--linear_heads", default="classify,causal_lm")
  return ap.parse_args()


def _step(args, name, dtype):
  """(model config, batch, length) of one model at ``dtype``."""
  make, batch, length = MODELS[name]
  cfg = make(args.quick)
  cfg.dtype = dtype
  return cfg, max(1, int(batch * args.batch_scale)), length or cfg.max_len


def time_group(args, group, dtype, ceiling, ceiling_flops, rows, results):
  """The models of ``group`` timed in the same interleaved rounds as the
  ceiling; a table row and a record each, appended to ``rows``/``results``."""
  peak = bc.device_peak(dtype)
  steps = {name: _step(args, name, dtype) for name in group}
  ceil_times, times, built = train_steps.interleaved_steps(
      ceiling, steps, args.rounds, args.min_seconds)
  for name, (timer, flops) in built.items():
    _, batch, n = steps[name]
    s = bc.summarize(ceil_times, ceiling_flops, times[name], flops)
    if args.profile:
      for op, ms, share in bc.profile_ops(timer.call):
        print(f"#   {name} {dtype}: {op:<36} {ms:9.2f} ms "
              f"{100 * share:5.1f}%")
    peak_mfu = flops / s.min_s / peak if peak else None
    rows.append((name, dtype, batch, n, s.min_s * 1e3, s.median_s * 1e3,
                 flops / 1e9, flops / s.min_s / 1e9,
                 s.ceiling_best / 1e9, 100 * s.mfu_best,
                 100 * s.mfu_paired,
                 f"{100 * peak_mfu:.1f}" if peak_mfu else "",
                 batch * n / s.min_s))
    results.append(dict(model=name, dtype=dtype, batch=batch, length=n,
                        flops=flops, rounds=args.rounds,
                        ceiling_seconds=ceil_times,
                        ceiling_flops=ceiling_flops, peak=peak,
                        peak_mfu=peak_mfu, **dataclasses.asdict(s)))
    print(f"# {name} {dtype}: {s.min_s * 1e3:.1f} ms (median "
          f"{s.median_s * 1e3:.1f}), MFU {100 * s.mfu_best:.1f}% best, "
          f"{100 * s.mfu_paired:.1f}% paired median; ceiling "
          f"{s.ceiling_best / 1e9:.1f} GFLOP/s best, "
          f"{s.ceiling_median / 1e9:.1f} median", flush=True)


def _notes(args, results) -> list[str]:
  """The rounds, and Base Layers' step time over Switch's per dtype."""
  base = {r["dtype"]: r for r in results
          if r["model"] == "smlp_switch/causal_lm"}
  notes = [f"{args.rounds} rounds of ceiling (2048^3 matmul) and step "
           "interleaved"]
  for r in results:
    if r["model"] == "smlp_base/causal_lm" and r["dtype"] in base:
      sw = base[r["dtype"]]
      # Timed in the same interleaved rounds: min/min and the median of
      # the per-round ratios.
      per_round = np.median(np.divide(r["times"], sw["times"]))
      notes.append(
          f"Base Layers / Switch step time ({r['dtype']}): "
          f"{r['min_s'] / sw['min_s']:.2f} (min/min), {per_round:.2f} "
          "(median of rounds)")
  return notes


def main():
  args = _args()
  if args.linear_attention:
    return linear_attention_table(args)
  names = [m for m in args.models.split(",") if m]
  unknown = [m for m in names if m not in MODELS]
  if unknown:
    raise SystemExit(f"unknown --models {unknown}; choose from "
                     f"{', '.join(MODELS)}")
  if args.quick:
    args.batch_scale, args.rounds, args.min_seconds = 0.25, 2, 0.2
  rows, results = [], []
  for dtype in args.dtypes.split(","):
    ceiling, ceiling_flops = bc.ceiling_timer(jnp.dtype(dtype),
                                              min_seconds=args.min_seconds)
    for group in interleave_groups(names):
      time_group(args, group, dtype, ceiling, ceiling_flops, rows, results)
  text = (f"Train step (fwd + bwd + AdamW), {bc.device_name()}"
          f"{', --quick' if args.quick else ''}; "
          + "; ".join(_notes(args, results)) + "\n\n"
          + bc.markdown_table(
              ("model/head", "dtype", "batch", "length", "ms/step (min)",
               "ms/step (median)", "GFLOP/step (XLA)", "GFLOP/s (min)",
               "ceiling GFLOP/s (best)", "MFU % (best/best)",
               "MFU % (paired, median)", "MFU % of device peak",
               "tokens/s"), rows))
  print(text)
  bc.write_outputs(args.out, "train_step", text, dict(rows=results))


if __name__ == "__main__":
  main()
