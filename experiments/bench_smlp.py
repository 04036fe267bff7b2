"""sMLP vs a dense gMLP with matched FLOPs per token: step time and tokens/s.

Runs a full training step (forward, backward, Adam) of both language models
on a mesh with an 'expert' axis (8 fake CPU devices by default), the sMLP
expert-parallel (all-to-all dispatch). FLOPs per token come from XLA's cost
analysis of the compiled step (per-device FLOPs x devices / tokens); the
dense gMLP's depth is chosen so that its FLOPs per token are the closest to
the sMLP's (fitted from depths 1 and 2, which cost the same per layer).

  python experiments/bench_smlp.py            # the table in the README/issue
  python experiments/bench_smlp.py --d_model 128 --d_ffn 512 --max_len 256

Note: XLA counts a while loop's body once, so Base Layers' auction (a
while loop, training only) is under-counted; its one-hot dispatch/combine
einsums are counted in full, which is what they cost on a CPU/GPU.
"""
from __future__ import annotations

import argparse
import os
import time

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        flags + " --xla_force_host_platform_device_count=8").strip()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from hypermixer_jax.models import smlp  # noqa: E402

RULES = [("batch", ("data", "fsdp", "expert")), ("expert", "expert"),
         ("vocab", None), ("embed", None), ("mlp", None), ("seq_in", None),
         ("seq_out", None), ("norm", None), ("length", None)]
COLLECTIONS = ["aux_loss", "moe_metrics"]


def _model(args, num_dense, num_sparse):
  return smlp.SmlpLM(
      vocab_size=args.vocab_size, d_model=args.d_model, d_ffn=args.d_ffn,
      max_len=args.max_len, num_dense_layers=num_dense,
      num_sparse_layers=num_sparse, num_experts=args.num_experts,
      tmoe_router=args.router, smoe_routing=args.smoe_routing)


def _step_fn(model, opt):
  def loss_fn(p, x, y):
    logits, aux = model.apply({"params": p}, x, deterministic=False,
                              mutable=COLLECTIONS)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    w = smlp.loss_weights(model, jnp.ones(ce.shape))
    ce = jnp.sum(ce * w) / jnp.sum(w)
    return ce + sum(jax.tree.leaves(aux.get("aux_loss", {})))

  def step(state, x, y):
    p, o = state
    loss, g = jax.value_and_grad(loss_fn)(p, x, y)
    upd, o = opt.update(g, o, p)
    return (optax.apply_updates(p, upd), o), loss

  return step


def build(args, mesh, num_dense, num_sparse):
  """(jitted step, sharded state, batch, n_params) of one model."""
  model = _model(args, num_dense, num_sparse)
  opt = optax.adam(1e-3)
  x = jnp.zeros((args.batch, args.max_len), jnp.int32)

  def init(key):
    p = nn.unbox(model.init(key, x)["params"])
    return p, opt.init(p)

  abstract = jax.eval_shape(
      lambda k: model.init(k, x)["params"], jax.random.key(0))
  p_shard = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract),
                                        mesh, RULES)
  p_shard = nn.unbox(p_shard)
  state_shape = jax.eval_shape(init, jax.random.key(0))
  repl = jax.NamedSharding(mesh, jax.P())
  # Adam moments share their parameter's sharding; the step count is replicated.
  o_shard = jax.tree.map(lambda _: repl, state_shape[1])
  o_shard = (o_shard[0]._replace(mu=p_shard, nu=p_shard),) + tuple(o_shard[1:])
  state_shard = (p_shard, o_shard)
  state = jax.jit(init, out_shardings=state_shard)(jax.random.key(0))
  data_shard = jax.NamedSharding(mesh, jax.P(("data", "fsdp", "expert")))
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, args.vocab_size, (args.batch, args.max_len + 1))
  xb = jax.device_put(tokens[:, :-1].astype(np.int32), data_shard)
  yb = jax.device_put(tokens[:, 1:].astype(np.int32), data_shard)
  step = jax.jit(_step_fn(model, opt),
                 in_shardings=(state_shard, data_shard, data_shard),
                 out_shardings=(state_shard, repl), donate_argnums=0)
  n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(abstract))
  return step, state, (xb, yb), n_params


def flops_per_token(args, mesh, step, state, batch):
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    compiled = step.lower(state, *batch).compile()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return (cost["flops"] * mesh.size / (args.batch * args.max_len),
          sum(" all-to-all(" in line for line in compiled.as_text().splitlines()))


def time_steps(mesh, step, state, batch, n_steps):
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    for _ in range(2):
      state, loss = step(state, *batch)
    loss.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(n_steps):
      state, loss = step(state, *batch)
    loss.block_until_ready()
  return (time.perf_counter() - t0) / n_steps


def main():
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
  mesh = jax.make_mesh(
      (n_dev // args.expert_parallel, 1, 1, args.expert_parallel),
      ("data", "fsdp", "tensor", "expert"),
      axis_types=(jax.sharding.AxisType.Auto,) * 4)

  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    sp = build(args, mesh, args.num_dense, args.num_sparse)
  f_sparse, a2a = flops_per_token(args, mesh, *sp[:3])
  # Dense gMLP: FLOPs/token = a + b * depth, fitted on depths 1 and 2.
  fits = []
  for depth in (1, 2):
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
      dn = build(args, mesh, depth, 0)
    fits.append(flops_per_token(args, mesh, *dn[:3])[0])
  per_layer = fits[1] - fits[0]
  depth = max(1, int(round((f_sparse - (fits[0] - per_layer)) / per_layer)))
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    dn = build(args, mesh, depth, 0)
  f_dense, _ = flops_per_token(args, mesh, *dn[:3])

  t_sparse = time_steps(mesh, *sp[:3], args.steps)
  t_dense = time_steps(mesh, *dn[:3], args.steps)
  tokens = args.batch * args.max_len
  rows = [
      (f"sMLP N1={args.num_dense} N2={args.num_sparse} E={args.num_experts} "
       f"({args.router}/{args.smoe_routing})", sp[3], f_sparse, t_sparse),
      (f"gMLP dense, {depth} layers", dn[3], f_dense, t_dense),
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
