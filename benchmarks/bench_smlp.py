"""sMLP vs a dense gMLP with matched FLOPs per token: step time and tokens/s.

Runs the library's training step (``steps.make_train_step``: forward,
backward, Adam) of both language models on a mesh with an 'expert' axis (8
fake CPU devices by default, the ``expert`` rules preset), the sMLP
expert-parallel (all-to-all dispatch). FLOPs per token come from XLA's cost
analysis of the compiled step (per-device FLOPs x devices / tokens); the
dense gMLP's depth is chosen so that its FLOPs per token are the closest to
the sMLP's (fitted from depths 1 and 2, which cost the same per layer).

  python benchmarks/bench_smlp.py            # MFLOPs/token, step ms, tokens/s
  python benchmarks/bench_smlp.py --d_model 128 --d_ffn 512 --max_len 256

Note: XLA counts a while loop's body once, so Base Layers' auction (a
while loop, training only) is under-counted; its one-hot dispatch/combine
einsums are counted in full, which is what they cost on a CPU/GPU.
"""
from __future__ import annotations

import argparse
import os

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from hypermixer_jax.experiment import bench as bc  # noqa: E402
from hypermixer_jax import sharding  # noqa: E402
from hypermixer_jax import runtime  # noqa: E402
from hypermixer_jax.models import smlp  # noqa: E402
from hypermixer_jax.train import metrics as metrics_lib  # noqa: E402


def _config(args, num_dense, num_sparse):
  cfg = smlp.smlp_config("tiny")
  cfg.update(dict(vocab_size=args.vocab_size, d_model=args.d_model,
                  d_ffn=args.d_ffn, max_len=args.max_len,
                  num_dense_layers=num_dense, num_sparse_layers=num_sparse))
  cfg.moe.update(dict(num_experts=args.num_experts, expert_d_ffn=args.d_ffn,
                      tmoe_router=args.router,
                      smoe_routing=args.smoe_routing))
  return cfg


def build(args, mesh, rules, num_dense, num_sparse):
  """(compiled train step, sharded state, batch, rng, n_params) of one model:
  the library's train step (``bench.train_step``, Adam) and sharded
  state, on the ``expert`` rules preset."""
  cfg = _config(args, num_dense, num_sparse)
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, args.vocab_size, (args.batch, args.max_len + 1))
  local = {"inputs": tokens[:, :-1].astype(np.int32),
           "targets": tokens[:, 1:].astype(np.int32),
           "weights": np.ones((args.batch, args.max_len), np.float32)}
  compiled, state, batch, key = bc.train_step(cfg, local, mesh, rules,
                                              optax.adam(1e-3))
  n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(state.params))
  return compiled, state, batch, key, n_params


def flops_per_token(args, mesh, compiled):
  return (metrics_lib.step_flops(compiled) * mesh.size
          / (args.batch * args.max_len),
          sum(" all-to-all(" in line for line in compiled.as_text().splitlines()))


def main():
  runtime.prepare_host()  # before JAX's first device query
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--vocab_size", type=int, default=512)
  ap.add_argument("--d_model", type=int, default=64)
  ap.add_argument("--d_ffn", type=int, default=256)
  ap.add_argument("--max_len", type=int, default=128)
  ap.add_argument("--num_dense", type=int, default=2, help="sMLP's N1")
  ap.add_argument("--num_sparse", type=int, default=2, help="sMLP's N2")
  ap.add_argument("--num_experts", type=int, default=8)
  ap.add_argument("--router", default="base")
  ap.add_argument("--smoe_routing", default="deterministic")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--expert_parallel", type=int, default=8,
                  help="size of the mesh's expert axis (rest: data)")
  ap.add_argument("--steps", type=int, default=10)
  args = ap.parse_args()

  n_dev = jax.device_count()
  mesh = sharding.build_mesh(dict(data=n_dev // args.expert_parallel, fsdp=1,
                                  tensor=1, expert=args.expert_parallel))
  rules = sharding.get_rules("expert")

  sp = build(args, mesh, rules, args.num_dense, args.num_sparse)
  f_sparse, a2a = flops_per_token(args, mesh, sp[0])
  # Dense gMLP: FLOPs/token = a + b * depth, fitted on depths 1 and 2.
  fits = []
  for depth in (1, 2):
    dn = build(args, mesh, rules, depth, 0)
    fits.append(flops_per_token(args, mesh, dn[0])[0])
  per_layer = fits[1] - fits[0]
  depth = max(1, int(round((f_sparse - (fits[0] - per_layer)) / per_layer)))
  dn = build(args, mesh, rules, depth, 0)
  f_dense, _ = flops_per_token(args, mesh, dn[0])

  t_sparse = bc.time_steps(*sp[:4], args.steps)
  t_dense = bc.time_steps(*dn[:4], args.steps)
  tokens = args.batch * args.max_len
  rows = [
      (f"sMLP N1={args.num_dense} N2={args.num_sparse} E={args.num_experts} "
       f"({args.router}/{args.smoe_routing})", sp[4], f_sparse, t_sparse),
      (f"gMLP dense, {depth} layers", dn[4], f_dense, t_dense),
  ]
  print(f"devices={n_dev} mesh={dict(mesh.shape)} batch={args.batch} "
        f"T={args.max_len} d={args.d_model} d_ffn={args.d_ffn} "
        f"all-to-alls in sMLP step HLO: {a2a}")
  print("| model | params | MFLOPs/token (XLA) | step ms | tokens/s |")
  print("| --- | ---: | ---: | ---: | ---: |")
  for name, n_params, f, t in rows:
    print(f"| {name} | {n_params:,} | {f / 1e6:.2f} | {t * 1e3:.1f} | "
          f"{tokens / t:,.0f} |")
  print(f"ratio sMLP/gMLP: FLOPs/token {f_sparse / f_dense:.3f}, "
        f"tokens/s {t_dense / t_sparse:.3f}")


if __name__ == "__main__":
  main()
