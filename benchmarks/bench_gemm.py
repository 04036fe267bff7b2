"""XLA:CPU's matrix products against PyTorch's, on a HyperMixing step's shapes.

What is left between our HyperMixing training step and the official
PyTorch code's on one core (experiments/results/hypermixing_official/) once
host memory is retained: the products themselves. Each product of the step
(B x N tokens, width d, hypernetwork output d') is timed alone, in
interleaved rounds with the matmul ceiling and with PyTorch's
``torch.matmul`` in a child process on the same core
(``benchmarks/torch_worker.py``, one thread), as the step writes it and
with its operands laid out for a plain [M, K] x [K, N] product:

* hypernetwork layer, ``[B N, d] x [d, d']``;
* weight gradient, ``[B N, d]^T [B N, d']`` (contracts the tokens);
* the token-mixing MLP's hidden layer, ``values^T W1`` per row,
  ``[B, d, N] x [B, N, d']`` (the step reads the values token-major);
* its output, ``W2 GELU(hidden)^T``, ``[B, N, d'] x [B, d', d]``.

    taskset -c 0 python benchmarks/bench_gemm.py \\
        --torch_python=TORCHENV/bin/python --repeats 3
"""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hypermixer_jax.experiment import bench as bc  # noqa: E402


def _tokens_t(x, g):
  """``x^T g`` over the flattened tokens, as ``hyper_mlp``'s backward."""
  return jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())))


def products(b: int, n: int, d: int, k: int) -> list[dict]:
  """Name, FLOPs, operand shapes of each form, and the torch config."""
  rows = b * n
  return [
      dict(name=f"hypernetwork layer [{rows}, {d}] x [{d}, {k}]",
           flops=2 * rows * d * k,
           written=(lambda x, w: x @ w, [(rows, d), (d, k)]),
           plain=(lambda x, w: x @ w, [(rows, d), (d, k)]),
           torch=dict(lhs=[rows, d], rhs=[d, k])),
      dict(name=f"weight gradient [{rows}, {d}]^T [{rows}, {k}]",
           flops=2 * rows * d * k,
           written=(_tokens_t, [(rows, d), (rows, k)]),
           plain=(lambda xt, g: xt @ g, [(d, rows), (rows, k)]),
           torch=dict(lhs=[d, rows], rhs=[rows, k], lhs_t=True)),
      dict(name=f"TM-MLP hidden [{b}, {d}, {n}] x [{b}, {n}, {k}]",
           flops=2 * b * n * d * k,
           written=(lambda v, w: jnp.einsum("bnf,bnk->bfk", v, w),
                    [(b, n, d), (b, n, k)]),
           plain=(lambda vt, w: vt @ w, [(b, d, n), (b, n, k)]),
           torch=dict(lhs=[b, d, n], rhs=[b, n, k], lhs_t=True)),
      dict(name=f"TM-MLP output [{b}, {n}, {k}] x [{b}, {k}, {d}]",
           flops=2 * b * n * d * k,
           written=(lambda w, h: jnp.einsum("bmk,bfk->bmf", w, h),
                    [(b, n, k), (b, d, k)]),
           plain=(lambda w, ht: w @ ht, [(b, n, k), (b, k, d)]),
           torch=dict(lhs=[b, n, k], rhs=[b, k, d], rhs_t=True)),
  ]


def _timer(fn, shapes, flops, min_seconds):
  keys = jax.random.split(jax.random.key(0), len(shapes))
  args = [jax.random.normal(key, s) for key, s in zip(keys, shapes)]
  compiled = jax.jit(fn).lower(*args).compile()
  return bc.Timed(lambda: compiled(*args), flops=flops,
                  min_seconds=min_seconds)


def gemm_table(args):
  ceiling, ceiling_flops = bc.ceiling_timer(min_seconds=args.min_seconds)
  rows, results = [], []
  for p in products(args.batch, args.n, args.d, args.hyper_dim):
    timers = {form: _timer(*p[form], p["flops"], args.min_seconds)
              for form in ("written", "plain")}
    timers["torch"] = bc.TorchTimed(
        args.torch_python, "matmul",
        dict(p["torch"], min_seconds=args.min_seconds))
    try:
      ceil_times, times = bc.interleave(ceiling, timers, args.repeats)
    finally:
      timers["torch"].close()
    s = {form: bc.summarize(ceil_times, ceiling_flops, times[form],
                            p["flops"]) for form in timers}
    fastest = min(s["written"].min_s, s["plain"].min_s)
    rows.append((p["name"], p["flops"] / 1e9, s["written"].min_s * 1e3,
                 s["plain"].min_s * 1e3, s["torch"].min_s * 1e3,
                 s["torch"].min_s / fastest,
                 float(np.median(np.divide(times["torch"], times["written"]))),
                 100 * s["written"].mfu_paired, 100 * s["torch"].mfu_paired))
    results.append(dict(name=p["name"], flops=p["flops"],
                        **{f: dataclasses.asdict(v) for f, v in s.items()}))
    print(rows[-1], flush=True)
  text = (f"Matrix products of a HyperMixing train step, B={args.batch} "
          f"N={args.n} d={args.d} d'={args.hyper_dim} float32; "
          f"{bc.device_name()}; {args.repeats} interleaved rounds, torch.matmul "
          "(one thread) in a child process on the same core\n\n"
          + bc.markdown_table(
              ("product", "GFLOP", "XLA as written ms", "XLA plain layout ms",
               "PyTorch ms", "XLA speed vs PyTorch (fastest form, min/min)",
               "as written (median of rounds)", "XLA as written % of ceiling "
               "(paired)", "PyTorch % of ceiling (paired)"), rows))
  return text, dict(ceiling_flops=ceiling_flops, rows=results)


def main():
  ap = bc.parser(__doc__)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--n", type=int, default=512)
  ap.add_argument("--d", type=int, default=256)
  ap.add_argument("--hyper_dim", type=int, default=512)
  ap.add_argument("--torch_python", required=True,
                  help="python interpreter with torch")
  args = ap.parse_args()
  if args.quick:
    args.batch, args.n, args.d, args.hyper_dim, args.repeats = 2, 64, 32, 64, 2
    args.min_seconds = 0.05
  text, results = gemm_table(args)
  print(text)
  bc.write_outputs(args.out, "gemm", text, results)


if __name__ == "__main__":
  main()
