r"""Input pipeline throughput on this machine, against the model's consumption.

For each pipeline (local sample data from ../shared/data, no download) prints
examples/s and tokens/s (patches/s for images, positions/s for the synthetic
task) over ``--batches`` batches after one warm-up batch, and, with
``--model``, the examples/s that a small model's training step (forward and
backward, jitted, on this machine's default JAX device) consumes on the same
batches: the pipeline keeps up when its rate is above the model's.

  python experiments/bench_input.py --shared=../shared/data --batch_size=32 \
      --batches=20 --model
"""
from __future__ import annotations

import argparse
import os
import pathlib
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # keep tf off accelerators

import numpy as np  # noqa: E402

from hypermixer_jax import data  # noqa: E402


def pipelines(shared: pathlib.Path, seq_len: int):
  """(label, data config, split) of each pipeline to time."""
  vocab = str(shared / "t5_spm/sentencepiece.model")
  c4 = str(shared / "c4/c4_en_train_00000_first1000.jsonl")
  out = []
  for task, packing in (("c4_mlm", False), ("c4_mlm", True), ("c4_lm", True)):
    cfg = data.default_data_config()
    cfg.update(task=task, vocab_path=vocab, seq_len=seq_len, packing=packing,
               shuffle_buffer_size=1000)
    cfg.local_files = {"train": c4}
    out.append((f"{task}{' packed' if packing else ''}", cfg, "train"))
  for task, path in (("glue_sst2", "glue/SST-2/train.tsv"),
                     ("glue_mnli", "nli/mnli_dev_matched.jsonl")):
    cfg = data.default_data_config()
    cfg.update(task=task, vocab_path=vocab, seq_len=seq_len,
               shuffle_buffer_size=1000)
    cfg.local_files = {"train": str(shared / path)}
    out.append((task, cfg, "train"))
  cfg = data.default_data_config()
  cfg.update(task="imagenet_patches", shuffle_buffer_size=100)
  cfg.local_files = {"train": str(shared / "imagenet_sample/labels.tsv")}
  out.append(("imagenet_patches 224/16", cfg, "train"))
  cfg = data.default_data_config()
  out.append(("synthetic_pairs", cfg, "train"))
  return out


def model_step(cfg, batch):
  """A jitted fwd+bwd step of a small model of the matching family."""
  import jax
  import jax.numpy as jnp
  from hypermixer_jax import models

  m = models.zoo.default_model_config()
  m.update(num_layers=2, d_model=128, d_ffn=512, dropout_rate=0.0)
  if cfg.task.startswith("c4") or cfg.task.startswith("glue"):
    m.update(max_len=cfg.seq_len, vocab_size=32100,
             head={"c4_mlm": "mlm", "c4_lm": "causal_lm"}.get(
                 cfg.task, "classify"), num_classes=3)
    if cfg.task == "c4_lm":
      m.mixer_kwargs.causal = True
      m.mixer = "gmlp"
      m.block = "gmlp"
  elif cfg.task == "imagenet_patches":
    m.update(family="continuous", head="image", num_classes=1000,
             input_dim=batch["inputs"].shape[-1],
             max_len=batch["inputs"].shape[1])
  else:
    m.update(family="continuous", head="regression", input_dim=1,
             max_len=batch["inputs"].shape[1])
  model = models.build_model(m)
  kwargs = {k: batch[k] for k in ("segment_ids", "positions", "token_type_ids")
            if k in batch}
  variables = model.init(jax.random.key(0), batch["inputs"], **kwargs)

  @jax.jit
  def step(variables, batch):
    def loss(v):
      out = model.apply(v, batch["inputs"], **{k: batch[k] for k in kwargs})
      return jnp.mean(jnp.square(out.astype(jnp.float32)))
    return jax.grad(loss)(variables)

  jax.block_until_ready(step(variables, batch))
  return lambda b: jax.block_until_ready(step(variables, b))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shared", default=str(
      pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"))
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--batches", type=int, default=20)
  parser.add_argument("--seq_len", type=int, default=128)
  parser.add_argument("--model", action="store_true",
                      help="also time a small model's training step")
  args = parser.parse_args()
  print(f"{'pipeline':26s} {'examples/s':>11s} {'tokens/s':>11s} "
        f"{'model ex/s':>11s}")
  for label, cfg, split in pipelines(pathlib.Path(args.shared), args.seq_len):
    p = data.build_pipeline(cfg, split, batch_size=args.batch_size, seed=0,
                            repeat=True, shuffle=True)
    it = iter(p)
    batch = next(it)  # warm-up: tracing, shuffle buffer fill
    start = time.perf_counter()
    tokens = 0
    for _ in range(args.batches):
      b = next(it)
      tokens += int((b["segment_ids"] > 0).sum() if "segment_ids" in b
                    else np.prod(b["inputs"].shape[:2]))
    dt = time.perf_counter() - start
    model_rate = ""
    if args.model:
      try:
        step = model_step(cfg, batch)
        t0 = time.perf_counter()
        for _ in range(5):
          step(batch)
        model_rate = f"{5 * args.batch_size / (time.perf_counter() - t0):11.1f}"
      except Exception as e:  # pylint: disable=broad-except
        model_rate = f"  n/a ({type(e).__name__}: {str(e)[:60]})"
    print(f"{label:26s} {args.batches * args.batch_size / dt:11.1f} "
          f"{tokens / dt:11.0f} {model_rate}", flush=True)


if __name__ == "__main__":
  main()
