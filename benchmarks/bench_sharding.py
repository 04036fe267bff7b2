r"""Per-device memory and step time of each sharding preset.

For a mid-sized model on 8 devices (8 fake CPU devices unless real
accelerators are present), prints for every preset of
``hypermixer_jax.sharding.RULES_PRESETS`` the bytes of parameters and of
optimizer state held by one device, their ratio to the unsharded total, and
the train-step time relative to the same step on a single device.

  python benchmarks/bench_sharding.py --mixer gmlp --steps 5

On fake CPU devices the 8 "devices" share the host's cores, so the time
ratio measures partitioning overhead, not speed-up; the memory columns are
exact everywhere.
"""
import argparse
import os

if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from hypermixer_jax.experiment import bench as bc  # noqa: E402
from hypermixer_jax import models  # noqa: E402
from hypermixer_jax import runtime  # noqa: E402
from hypermixer_jax import sharding  # noqa: E402

# (data, fsdp, tensor, expert) per preset on 8 devices.
MESHES = {"data_parallel": (8, 1, 1, 1), "fsdp": (1, 8, 1, 1),
          "fsdp_tensor": (1, 4, 2, 1), "expert": (1, 2, 2, 2)}


def _model_config(args):
  cfg = models.default_model_config()
  cfg.update(dict(
      mixer=args.mixer, block="gmlp" if args.mixer in ("gmlp", "amlp")
      else "pre_ln", head="mlm", num_layers=args.layers, d_model=args.d_model,
      d_ffn=4 * args.d_model, max_len=args.length, vocab_size=args.vocab,
      dropout_rate=0.1))
  return cfg


def _batch(args):
  rng = np.random.default_rng(0)
  shape = (args.batch, args.length)
  return {
      "inputs": rng.integers(1, args.vocab, shape).astype(np.int32),
      "targets": rng.integers(1, args.vocab, shape).astype(np.int32),
      "weights": (rng.random(shape) < 0.15).astype(np.float32),
      "segment_ids": np.ones(shape, np.int32),
      "positions": np.broadcast_to(np.arange(args.length, dtype=np.int32),
                                   shape),
  }


def _device_bytes(tree):
  """Bytes of ``tree`` held by the most loaded device."""
  per_device = {}
  for x in jax.tree.leaves(tree):
    for s in x.addressable_shards:
      per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
  return max(per_device.values())


def run(preset, mesh_shape, devices, model_cfg, batch, args):
  """Returns (param bytes, optimizer bytes, seconds per step) per device."""
  mesh = sharding.build_mesh(dict(zip(sharding.MESH_AXES, mesh_shape)),
                             devices)
  step, state, global_batch, rng = bc.train_step(
      model_cfg, batch, mesh, sharding.get_rules(preset),
      optax.adamw(1e-3, weight_decay=0.01))
  return (_device_bytes(state.params), _device_bytes(state.opt_state),
          bc.time_steps(step, state, global_batch, rng, args.steps))


def main():
  runtime.prepare_host()  # before JAX's first device query
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mixer", default="gmlp", choices=tuple(models.MIXERS))
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--length", type=int, default=128)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--steps", type=int, default=5)
  args = parser.parse_args()

  devices = jax.devices()
  if len(devices) < 8:
    raise SystemExit(f"needs 8 devices, found {len(devices)}")
  model_cfg = _model_config(args)
  batch = _batch(args)
  n_params = models.count_params(model_cfg)
  print(f"{args.mixer}: {n_params / 1e6:.2f}M parameters, d={args.d_model}, "
        f"L={args.layers}, N={args.length}, batch {args.batch}, "
        f"{devices[0].platform} x {len(devices[:8])}\n")

  base_p, base_o, base_t = run("data_parallel", (1, 1, 1, 1), devices[:1],
                               model_cfg, batch, args)
  header = ("| preset | mesh (data,fsdp,tensor,expert) | params MiB/dev | "
            "opt MiB/dev | (params+opt) / unsharded | step s | step / "
            "unsharded |")
  print(header)
  print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
  mib = 2.0 ** 20
  print(f"| unsharded (1 device) | (1, 1, 1, 1) | {base_p / mib:.2f} | "
        f"{base_o / mib:.2f} | 1.000 | {base_t:.3f} | 1.00 |")
  for preset, shape in MESHES.items():
    p, o, t = run(preset, shape, devices[:8], model_cfg, batch, args)
    print(f"| {preset} | {shape} | {p / mib:.2f} | {o / mib:.2f} | "
          f"{(p + o) / (base_p + base_o):.3f} | {t:.3f} | "
          f"{t / base_t:.2f} |")


if __name__ == "__main__":
  main()
