r"""Forward + backward pass of every named model on random data.

Prints one row per model: parameters, loss (the head's, ``heads``), gradient
norm and ms per (jitted, warmed-up) training step. A first check that the whole model zoo
builds, runs and trains on the machine at hand:

  python benchmarks/smoke_all_models.py                     # paper sizes
  python benchmarks/smoke_all_models.py --tiny --models=glue_hypermixer,gmlp_ti
"""
from __future__ import annotations

import time

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax import runtime

_MODELS = flags.DEFINE_list("models", None, "Named models (default: all).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Examples per step.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps after the warm-up.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Compute dtype (parameters stay float32).")
_TINY = flags.DEFINE_bool(
    "tiny", False, "Shrink every model (2 layers, d=64) for a quick CPU run; "
    "the token-mixing options of each configuration are kept.")


def shrink(cfg):
  """Same model family and mixer, CPU-sized."""
  cfg.update(num_layers=2, d_model=64, d_ffn=128,
             vocab_size=min(cfg.vocab_size, 1000))
  for key, value in dict(hyper_dim=32, token_mlp_dim=32, d_ffn=128,
                         num_heads=2).items():
    if key in cfg.mixer_kwargs:
      cfg.mixer_kwargs[key] = value
  return cfg


def random_batch(cfg, batch_size, rng):
  """A random batch in the format of ``cfg``'s task (CONTRIBUTING.md)."""
  k1, k2 = jax.random.split(rng)
  n = cfg.max_len
  if cfg.family == "text":
    batch = dict(inputs=jax.random.randint(k1, (batch_size, n), 0,
                                           cfg.vocab_size),
                 segment_ids=jnp.ones((batch_size, n), jnp.int32))
  else:
    batch = dict(inputs=jax.random.normal(k1, (batch_size, n, cfg.input_dim)))
  kind = heads.get(cfg.head).kind
  if kind == "tokens":
    batch["targets"] = jax.random.randint(k2, (batch_size, n), 0,
                                          cfg.vocab_size)
    batch["weights"] = jnp.ones((batch_size, n), jnp.float32)
  elif kind == "values":
    batch["targets"] = jax.random.normal(k2, (batch_size, n, cfg.out_dim))
    batch["weights"] = jnp.ones((batch_size, n), jnp.float32)
  else:
    batch["label"] = jax.random.randint(k2, (batch_size,), 0,
                                        cfg.num_classes)
  return batch


def smoke(name: str) -> tuple[int, float, float, float]:
  cfg = models.get_model_config(name)
  cfg.dtype = _DTYPE.value
  if _TINY.value:
    cfg = shrink(cfg)
  model = models.build_model(cfg)
  batch = random_batch(cfg, _BATCH.value, jax.random.key(1))
  inputs, kw = heads.model_inputs(batch, cfg.head)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), inputs, **kw)
                    )["params"]
  n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))

  @jax.jit
  def step(params, rng):
    def loss_fn(p):
      out = model.apply({"params": p}, inputs, **kw, deterministic=False,
                        rngs={"dropout": rng})
      return heads.compute_loss(cfg.head, out, batch)[0]
    value, grads = jax.value_and_grad(loss_fn)(params)
    return value, optax.global_norm(grads)

  value, gnorm = jax.block_until_ready(step(params, jax.random.key(2)))
  start = time.perf_counter()
  for i in range(_STEPS.value):
    jax.block_until_ready(step(params, jax.random.key(3 + i)))
  ms = 1e3 * (time.perf_counter() - start) / max(_STEPS.value, 1)
  return n_params, float(value), float(gnorm), ms


def main(argv):
  del argv
  runtime.prepare_host()  # before JAX's first device query
  names = _MODELS.value or models.model_names()
  print(f"devices: {jax.devices()}  dtype: {_DTYPE.value}  "
        f"batch: {_BATCH.value}  tiny: {_TINY.value}")
  print(f"{'model':26s} {'params':>13s} {'loss':>9s} {'grad norm':>10s} "
        f"{'ms/step':>9s}")
  failed = []
  for name in names:
    try:
      n_params, value, gnorm, ms = smoke(name)
    except Exception as e:  # noqa: BLE001 -- report every model, then fail
      failed.append(name)
      print(f"{name:26s} FAILED: {type(e).__name__}: {e}")
      continue
    ok = np.isfinite(value) and np.isfinite(gnorm) and gnorm > 0
    if not ok:
      failed.append(name)
    print(f"{name:26s} {n_params:>13,d} {value:9.4f} {gnorm:10.4f} "
          f"{ms:9.1f}{'' if ok else '  NOT FINITE / ZERO GRAD'}")
  if failed:
    raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
  app.run(main)
