"""A model's loop train step on one device, for the benchmarks: a batch in
the data contract's format (CONTRIBUTING.md) for its head, the compiled
step with its XLA FLOP count, a timer that carries the donated state
from call to call, several steps timed in the same interleaved rounds, and
the Linear Transformer's implementations set beside the softmax one."""
from __future__ import annotations

import jax
import numpy as np

from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.data import config as data_config
from hypermixer_jax.experiment import bench as bc
from hypermixer_jax.train.config import base_config
from hypermixer_jax.train.config import text_model


# Linear attention's implementations against the softmax Transformer, at the
# SST-2 experiment's layout (glue_from_scratch: width 128, 2 layers, d_ffn
# 256, 8k vocabulary); batch 64 at N = 64, the same 4,096 tokens per batch
# at longer N.
OLD_LINEAR = "linear, outer (old)"
LINEAR_VARIANTS = {
    "softmax Transformer": ("attention", {}),
    OLD_LINEAR: ("linear_attention", dict(implementation="outer")),
    "linear, chunked": ("linear_attention", {}),
    "linear, chunked, packed=False": ("linear_attention",
                                      dict(packed=False)),
}


def linear_attention_steps(head: str, n: int):
  """{variant: (model config, batch, n)} of ``LINEAR_VARIANTS`` with
  ``head`` at length ``n``, as ``interleaved_steps`` takes them."""
  batch = 64 if n <= 64 else max(1, 4096 // n)
  steps = {}
  for name, (mixer, kwargs) in LINEAR_VARIANTS.items():
    if head == "causal_lm" and "packed" in kwargs:
      continue  # packed=False changes only the non-causal path
    cfg = text_model(mixer, head)
    cfg.update(dict(d_model=128, d_ffn=256, num_layers=2, max_len=n,
                    vocab_size=8000))
    cfg.mixer_kwargs.update(dict(num_heads=2, **kwargs))
    steps[name] = (cfg, batch, n)
  return steps


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
    slots = data_config.max_predictions(n)
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
  batch = make_batch(model_cfg, batch_size, length or model_cfg.max_len,
                     np.random.RandomState(0))
  compiled, state, batch, rng = bc.train_step(
      model_cfg, batch, mesh, sharding.get_rules(config.sharding),
      config=config)
  return compiled, state, batch, rng, bc.xla_flops(compiled)


def step_timer(compiled, state, batch, rng, flops: float,
               min_seconds: float) -> bc.Timed:
  """A ``bc.Timed`` of the step; the donated state is carried call to call."""
  holder = [state]

  def call():
    holder[0], metrics = compiled(holder[0], batch, rng)
    return metrics
  return bc.Timed(call, flops=flops, min_seconds=min_seconds)


def interleaved_steps(ceiling: bc.Timed, steps, rounds: int,
                      min_seconds: float):
  """The train steps of ``steps`` ({name: (model config, batch, length)})
  timed in the same interleaved rounds as ``ceiling`` (``bc.interleave``):
  (ceiling times, {name: step times}, {name: (timer, XLA FLOPs)})."""
  built = {}
  for name, (cfg, batch, length) in steps.items():
    compiled, state, xs, rng, flops = build_step(cfg, batch, length)
    built[name] = (step_timer(compiled, state, xs, rng, flops, min_seconds),
                   flops)
    del compiled, state, xs
  ceil_times, times = bc.interleave(
      ceiling, {k: timer for k, (timer, _) in built.items()}, rounds)
  return ceil_times, times, built
