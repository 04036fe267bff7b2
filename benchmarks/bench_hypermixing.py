"""HyperMixing forward speed against the matmul ceiling, and causal memory.

Four tables, one a run (chosen by the flags), measured on this device:

1. Forward of the (non-causal) HyperMixing token mixer at B x N x d with
   hyper_dim d' for several N: time, XLA-counted FLOPs, FLOP/s as a share
   of a jitted 2048 x 2048 matmul's, and time(N) / time(N / 4) (linear cost
   gives 4). The ceiling and every N are timed in interleaved rounds
   (``bench.interleave``): minimum and median times, and the scaling ratio
   both from the minima and as the median of per-round ratios.
2. ``--official=CHECKOUT --torch_python=PY``: against the official PyTorch
   HyperMixing (a checkout of idiap/hypermixing, imported by a child process
   under the interpreter PY, never copied: ``torch_worker.py``), forward and
   forward + backward (gradients of sum(y^2) to the parameters and the
   input), one core each, rounds interleaved with the ceiling; ours set to
   the official function (no hypernetwork biases, input x sqrt(d), positions
   from 1). Training-path MFU: XLA-counted FLOPs of our gradient step over
   the ceiling.
3. ``--packing_segments=1,2,4,8 --lengths=128``: packed rows (that many
   segments each, ``max_segments`` = that number, one TM-MLP hidden layer
   per segment) against the same rows unpacked: XLA FLOPs and time,
   HyperMixing and the MLP-Mixer token MLP: what packing costs them.
4. ``--causal_memory``: XLA's ``memory_analysis()`` of the compiled causal
   mixer (forward, and forward + backward) for N = 512 ... 8192: temporary
   bytes and their ratio to one [B, N, d] activation. The chunked scan keeps
   the forward's temporaries flat in N beyond the O(B N d) inputs/outputs;
   the backward stores N / C chunk-boundary states.

    taskset -c 1 python benchmarks/bench_hypermixing.py
    taskset -c 1 python benchmarks/bench_hypermixing.py --causal_memory
    taskset -c 1 python benchmarks/bench_hypermixing.py \
        --official=HYPERMIXING_CHECKOUT --torch_python=TORCHENV/bin/python
    python benchmarks/bench_hypermixing.py --quick     # small sizes
"""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hypermixer_jax.experiment import bench as bc  # noqa: E402
from hypermixer_jax.models.hypermixer import HyperMixing  # noqa: E402


def _module(args, n, causal=False, dtype=jnp.float32, **kw):
  return HyperMixing(args.hyper_dim, num_heads=args.num_heads,
                     max_len=max(n, 512), causal=causal,
                     causal_chunk_size=args.chunk_size,
                     chunk_tokens=args.chunk_tokens, dtype=dtype, **kw)


def forward_table(args):
  """Every N and the ceiling timed in interleaved rounds (experiment.bench)."""
  dtype = jnp.dtype(args.dtype)
  ceiling, ceiling_flops = bc.ceiling_timer(dtype,
                                            min_seconds=args.min_seconds)
  timers, flops = {}, {}
  for n in args.lengths:
    module = _module(args, n, dtype=dtype)
    x = jax.random.normal(jax.random.key(0), (args.batch, n, args.d), dtype)
    params, fwd = bc.compiled_forward(module, x)
    flops[n] = bc.xla_flops(fwd)
    timers[n] = bc.Timed(lambda fwd=fwd, p=params, x=x: fwd(p, x),
                         flops=flops[n], min_seconds=args.min_seconds)
  ceil_times, times = bc.interleave(ceiling, timers, args.repeats)
  rows, results = [], []
  for n in args.lengths:
    s = bc.summarize(ceil_times, ceiling_flops, times[n], flops[n])
    scale, paired = "", ""
    if n // 4 in times:
      scale = f"{s.min_s / min(times[n // 4]):.2f}"
      paired = f"{np.median(np.divide(times[n], times[n // 4])):.2f}"
    rows.append((n, s.min_s * 1e3, s.median_s * 1e3, flops[n] / 1e9,
                 flops[n] / s.min_s / 1e9, 100 * s.mfu_best,
                 100 * s.mfu_paired, scale, paired))
    results.append(dict(n=n, flops=flops[n], **dataclasses.asdict(s)))
  best = max(ceiling_flops / t for t in ceil_times)
  text = (f"HyperMixing forward, B={args.batch} d={args.d} d'={args.hyper_dim}"
          f" heads={args.num_heads} {args.dtype}; {bc.device_name()}; "
          f"{args.repeats} interleaved rounds; matmul ceiling "
          f"{best / 1e9:.1f} GFLOP/s (best round)\n\n" + bc.markdown_table(
              ("N", "ms (min)", "ms (median)", "GFLOP (XLA)", "GFLOP/s (min)",
               "% of ceiling (best/best)", "% of ceiling (paired, median)",
               "t(N)/t(N/4) (min/min)", "t(N)/t(N/4) (median of rounds)"),
              rows))
  return text, dict(ceiling_seconds=ceil_times, ceiling_flops=ceiling_flops,
                    rows=results)


def official_table(args):
  """Ours and the official code, forward and training, per N (own rounds)."""
  rows, results = [], []
  for n in args.lengths:
    ceiling, ceiling_flops = bc.ceiling_timer(min_seconds=args.min_seconds)
    module = _module(args, n, hyper_bias=False, input_scale=True,
                     position_offset=1)
    x = jax.random.normal(jax.random.key(0), (args.batch, n, args.d))
    params, fwd = bc.compiled_forward(module, x)
    grad = bc.compiled_grad(module, params, x, deterministic=False)
    flops = dict(fwd=bc.xla_flops(fwd), train=bc.xla_flops(grad))
    cfg = dict(batch=args.batch, n=n, d=args.d, heads=args.num_heads,
               hyper_dim=args.hyper_dim, official=args.official,
               min_seconds=args.min_seconds)
    timers = dict(
        fwd=bc.Timed(lambda: fwd(params, x), flops=flops["fwd"],
                     min_seconds=args.min_seconds),
        official_fwd=bc.TorchTimed(args.torch_python, "hypermixing", cfg),
        train=bc.Timed(lambda: grad(params, x), flops=flops["train"],
                       min_seconds=args.min_seconds),
        official_train=bc.TorchTimed(args.torch_python, "hypermixing_train",
                                     cfg))
    try:
      ceil_times, times = bc.interleave(ceiling, timers, args.repeats)
    finally:
      timers["official_fwd"].close()
      timers["official_train"].close()
    row = [n]
    for kind in ("fwd", "train"):
      s = bc.summarize(ceil_times, ceiling_flops, times[kind], flops[kind])
      theirs = times["official_" + kind]
      row += [s.min_s * 1e3, min(theirs) * 1e3, min(theirs) / s.min_s,
              float(np.median(np.divide(theirs, times[kind]))),
              100 * s.mfu_paired]
      results.append(dict(n=n, kind=kind, flops=flops[kind],
                          official_times=theirs, **dataclasses.asdict(s)))
    rows.append(tuple(row))
    print(rows[-1], flush=True)
  text = (f"HyperMixing against the official PyTorch code, B={args.batch} "
          f"d={args.d} d'={args.hyper_dim} heads={args.num_heads} float32; "
          f"{bc.device_name()}; {args.repeats} interleaved rounds per N, "
          "torch (one thread) in a child process on the same core\n\n"
          + bc.markdown_table(
              ("N", "fwd ms", "official fwd ms", "speed-up (min/min)",
               "speed-up (median of rounds)", "fwd % of ceiling (paired)",
               "fwd+bwd ms", "official fwd+bwd ms", "speed-up (min/min)",
               "speed-up (median of rounds)",
               "fwd+bwd % of ceiling (paired)"), rows))
  return text, dict(rows=results)


def packing_table(args):
  """XLA FLOPs (and time) of packed rows against the same rows unpacked."""
  from hypermixer_jax.models.mlp_mixer import MlpMixerTokenMixing  # pylint: disable=g-import-not-at-top
  n = args.lengths[0]
  x = jax.random.normal(jax.random.key(0), (args.batch, n, args.d))
  rows, results = [], []
  for slots in args.packing_segments:
    # `slots` equal segments per row, as many slots.
    ids = jnp.broadcast_to(1 + jnp.arange(n) * slots // n, (args.batch, n))
    for name, make in (
        ("HyperMixing", lambda k: _module(args, n, max_segments=k)),
        ("Mixer token MLP", lambda k: MlpMixerTokenMixing(
            n, args.hyper_dim, max_segments=k))):
      module = make(slots)
      params, unpacked = bc.compiled_forward(module, x)
      calls = dict(unpacked=unpacked, packed=jax.jit(lambda p, x: module.apply(
          p, x, segment_ids=ids)).lower(params, x).compile())
      flops = {k: bc.xla_flops(c) for k, c in calls.items()}
      times = {k: bc.time_call(c, params, x, repeats=args.repeats)
               for k, c in calls.items()}
      rows.append((name, slots, flops["unpacked"] / 1e9,
                   flops["packed"] / 1e9, flops["packed"] / flops["unpacked"],
                   times["packed"] / times["unpacked"]))
      results.append(dict(mixer=name, segments=slots, flops=flops,
                          seconds=times))
      print(rows[-1], flush=True)
  text = (f"Packed rows against unpacked, B={args.batch} N={n} d={args.d} "
          f"d'={args.hyper_dim}, forward, float32; {bc.device_name()}; FLOPs "
          "per row (XLA), time best of rounds\n\n" + bc.markdown_table(
              ("mixer", "segments per row", "unpacked GFLOP", "packed GFLOP",
               "packed / unpacked FLOPs", "packed / unpacked time"), rows))
  return text, dict(rows=results)


def causal_memory_table(args):
  rows, results = [], []
  for n in args.lengths:
    module = _module(args, n, causal=True)
    x = jax.ShapeDtypeStruct((args.batch, n, args.d), jnp.float32)
    params = jax.eval_shape(module.init, jax.random.key(0), x)
    act = args.batch * n * args.d * 4
    fwd = jax.jit(module.apply).lower(params, x).compile().memory_analysis()
    grad = bc.compiled_grad(module, params, x).memory_analysis()
    old = args.batch * n * args.d * args.hyper_dim * 4  # [B, N, d, d'] states
    rows.append((n, fwd.temp_size_in_bytes / 2 ** 20,
                 fwd.temp_size_in_bytes / act,
                 grad.temp_size_in_bytes / 2 ** 20,
                 grad.temp_size_in_bytes / act, old / 2 ** 20))
    results.append(dict(n=n, forward_temp=fwd.temp_size_in_bytes,
                        grad_temp=grad.temp_size_in_bytes, activation=act,
                        prefix_states=old))
  text = (f"Causal HyperMixing memory (XLA memory_analysis, temporaries), "
          f"B={args.batch} d={args.d} d'={args.hyper_dim} chunk="
          f"{args.chunk_size}; one [B, N, d] f32 activation = act\n\n"
          + bc.markdown_table(
              ("N", "forward MiB", "forward / act", "fwd+bwd MiB",
               "fwd+bwd / act", "[B,N,d,d'] states of the prefix scan, MiB"),
              rows))
  return text, dict(rows=results)


def main():
  ap = bc.parser(__doc__)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--d", type=int, default=256)
  ap.add_argument("--hyper_dim", type=int, default=512)
  ap.add_argument("--num_heads", type=int, default=1)
  ap.add_argument("--chunk_size", type=int, default=64)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--chunk_tokens", type=int, default=None,
                  help="HyperMixing.chunk_tokens (default: the module's; "
                  "0: one pass)")
  ap.add_argument("--lengths", default="")
  ap.add_argument("--causal_memory", action="store_true")
  ap.add_argument("--packing_segments", default="",
                  help="e.g. 1,2,4,8: packed rows with that many segments "
                  "against unpacked rows (FLOPs and time), at the first "
                  "--lengths")
  ap.add_argument("--official", default="",
                  help="checkout of the official PyTorch HyperMixing "
                  "(idiap/hypermixing): compare with it")
  ap.add_argument("--torch_python", default="",
                  help="python interpreter with torch, for --official")
  args = ap.parse_args()
  if args.quick:
    args.batch, args.d, args.hyper_dim, args.repeats = 2, 64, 128, 2
    args.min_seconds = 0.1
  default = "512,1024,2048,4096,8192" if args.causal_memory else \
      "128,512,2048,8192"
  args.lengths = [int(v) for v in (args.lengths or default).split(",")]
  if args.official and not args.torch_python:
    ap.error("--official needs --torch_python (an interpreter with torch).")
  args.packing_segments = [int(v) for v in args.packing_segments.split(",")
                           if v]
  name, table = (("causal_memory", causal_memory_table) if args.causal_memory
                 else ("official", official_table) if args.official
                 else ("packing", packing_table) if args.packing_segments
                 else ("hypermixing_forward", forward_table))
  text, results = table(args)
  print(text)
  bc.write_outputs(args.out, name, text, results)


if __name__ == "__main__":
  main()
