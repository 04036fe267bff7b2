"""Softmax self-attention against PyTorch's ``nn.MultiheadAttention``.

The Transformer baseline's token mixer (``attention.SelfAttention``: query,
key, value and output projections around softmax attention) and PyTorch's
``nn.MultiheadAttention`` (the same four projections; ``need_weights=False``,
its fastest path, under ``torch.inference_mode``) at B x N x d with H heads,
forward, float32. PyTorch runs in a child process (``torch_worker.py``)
started with the interpreter given by ``--torch_python`` (an environment
with torch: torch is no dependency of this project), one torch thread; the
two processes take turns, round by round (``bench.interleave``:
ceiling, ours, library path, torch, ceiling, ...), so pin the parent
(``taskset -c 1``) and both sides share one core. Reported: min ms per call
(ours, library path, torch), ours / torch both as min / min and as the
median of per-round ratios, and ours as a share of the ceiling (paired);
every round's times go to results.json.

``ours`` is the module's automatic choice (the block-wise online-softmax
scan on CPU for N > block size); ``library`` forces
``jax.nn.dot_product_attention`` (XLA's path, which materialises
[B, H, N, N] float32: skipped above ``--library_max_n``).

    taskset -c 1 python benchmarks/bench_attention.py --torch_python=TORCHENV/bin/python
    python benchmarks/bench_attention.py --quick --torch_python=...
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hypermixer_jax.experiment import bench as bc  # noqa: E402
from hypermixer_jax.models.attention import SelfAttention  # noqa: E402


def main():
  ap = bc.parser(__doc__)
  ap.add_argument("--torch_python", required=True,
                  help="python interpreter of an environment with torch")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--d", type=int, default=256)
  ap.add_argument("--num_heads", type=int, default=4)
  ap.add_argument("--lengths", default="128,512,2048,8192")
  ap.add_argument("--library_max_n", type=int, default=2048,
                  help="longest N of the materialising library path")
  args = ap.parse_args()
  if args.quick:
    args.lengths, args.repeats, args.min_seconds = "128,512", 2, 0.1
  rows, results = [], []
  for n in (int(v) for v in args.lengths.split(",")):
    ceiling, ceiling_flops = bc.ceiling_timer(min_seconds=args.min_seconds)
    x = jax.random.normal(jax.random.key(0), (args.batch, n, args.d))
    timers, flops = {}, {}
    impls = {"ours": None}
    if n <= args.library_max_n:
      impls["library"] = "xla"
    for name, impl in impls.items():
      module = SelfAttention(args.num_heads, implementation=impl)
      params = jax.jit(module.init)(jax.random.key(1), x)
      fwd = jax.jit(module.apply).lower(params, x).compile()
      # Counted by hand: XLA's cost analysis counts a while loop's body
      # once. Four projections, q k^T and p v.
      flops[name] = 8 * args.batch * n * args.d ** 2 + \
          4 * args.batch * n * n * args.d
      timers[name] = bc.Timed(lambda fwd=fwd, p=params: fwd(p, x),
                              flops=flops[name], min_seconds=args.min_seconds)
    torch_timer = bc.TorchTimed(args.torch_python, "mha", dict(
        batch=args.batch, n=n, d=args.d, heads=args.num_heads,
        min_seconds=args.min_seconds))
    timers["torch"] = torch_timer
    try:
      ceil_times, times = bc.interleave(ceiling, timers, args.repeats)
    finally:
      torch_timer.close()
    s = bc.summarize(ceil_times, ceiling_flops, times["ours"], flops["ours"])
    lib = times.get("library")
    ratio = np.divide(times["ours"], times["torch"])
    rows.append((n, s.min_s * 1e3, min(times["torch"]) * 1e3,
                 min(lib) * 1e3 if lib else "-",
                 s.min_s / min(times["torch"]), float(np.median(ratio)),
                 100 * s.mfu_paired))
    results.append(dict(n=n, flops=flops, times=times,
                        ceiling_seconds=ceil_times))
    print(rows[-1], flush=True)
  text = (f"Self-attention forward, B={args.batch} d={args.d} heads="
          f"{args.num_heads} float32; {bc.device_name()}; {args.repeats} "
          "interleaved rounds, torch in a child process on the same core\n\n"
          + bc.markdown_table(
              ("N", "ours ms (min)", "torch ms (min)", "library ms (min)",
               "ours / torch (min/min)", "ours / torch (median of rounds)",
               "ours % of ceiling (paired)"), rows))
  print(text)
  bc.write_outputs(args.out, "attention", text, results)


if __name__ == "__main__":
  main()
