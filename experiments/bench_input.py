r"""Input pipeline throughput on this machine, against the model's consumption.

For each pipeline (local sample data from ../shared/data, no download) prints
examples/s and tokens/s (patches/s for images, positions/s for the synthetic
task) over ``--batches`` batches after one warm-up batch, and, with
``--model``, the examples/s that a small model's training step (forward and
backward, jitted, on this machine's default JAX device) consumes on the same
batches: the pipeline keeps up when its rate is above the model's.

  python experiments/bench_input.py --shared=../shared/data --batch_size=32 \
      --batches=20 --model

With ``--scaling``, each pipeline is timed in child processes pinned with
``taskset -c 0`` and ``taskset -c 0,1`` (alternating, ``--repeats`` times,
best of each kept, since other jobs on a shared machine only ever slow a run
down), and the table gives examples/s per core and the 1 -> 2 core speed-up:

  python experiments/bench_input.py --scaling --batch_size=64 --batches=30
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
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
    cfg.local_files.train = c4
    out.append((f"{task}{' packed' if packing else ''}", cfg, "train"))
  for task, path in (("glue_sst2", "glue/SST-2/train.tsv"),
                     ("glue_mnli", "nli/mnli_dev_matched.jsonl")):
    cfg = data.default_data_config()
    cfg.update(task=task, vocab_path=vocab, seq_len=seq_len,
               shuffle_buffer_size=1000)
    cfg.local_files.train = str(shared / path)
    out.append((task, cfg, "train"))
  cfg = data.default_data_config()
  cfg.update(task="imagenet_patches", shuffle_buffer_size=100)
  cfg.local_files.train = str(shared / "imagenet_sample/labels.tsv")
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


def time_pipeline(cfg, split, batch_size: int, batches: int):
  """(examples/s, tokens/s, first batch, CPU-s per s) after a warm-up batch.

  CPU-s per s (all threads of the process over wall time) shows how many
  cores the pipeline kept busy, a figure that neighbours on a shared machine
  lower less than they lower the rate.
  """
  p = data.build_pipeline(cfg, split, batch_size=batch_size, seed=0,
                          repeat=True, shuffle=True)
  it = iter(p)
  batch = next(it)  # warm-up: tracing, shuffle buffer fill
  start, cpu = time.perf_counter(), time.process_time()
  tokens = 0
  for _ in range(batches):
    b = next(it)
    tokens += int((b["segment_ids"] > 0).sum() if "segment_ids" in b
                  else np.prod(b["inputs"].shape[:2]))
  dt = time.perf_counter() - start
  busy = (time.process_time() - cpu) / dt
  return batches * batch_size / dt, tokens / dt, batch, busy


def scaling(args, labels):
  """Child runs under taskset for 1 and 2 cores; prints the table."""
  print(f"{'pipeline':26s} {'1 core ex/s':>12s} {'2 cores ex/s':>13s} "
        f"{'per core (2)':>13s} {'speed-up':>9s} {'CPU-s/s (2)':>12s}"
        "   runs (1 core | 2 cores)")
  for label in labels:
    best, runs, busy = {}, {1: [], 2: []}, 0.0
    for _ in range(args.repeats):
      for cores, cpus in ((1, "0"), (2, "0,1")):
        cmd = ["taskset", "-c", cpus, sys.executable, __file__, "--only",
               label, "--json", "--batch_size", str(args.batch_size),
               "--batches", str(args.batches), "--seq_len",
               str(args.seq_len), "--shared", args.shared]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rec = json.loads(out.stdout.strip().splitlines()[-1])
        rate = rec["examples_s"]
        runs[cores].append(rate)
        if rate > best.get(cores, 0.0):
          best[cores] = rate
          if cores == 2:
            busy = rec["cpu_s_per_s"]
    fmt = lambda xs: " ".join(f"{x:.0f}" for x in xs)  # noqa: E731
    print(f"{label:26s} {best[1]:12.1f} {best[2]:13.1f} {best[2] / 2:13.1f} "
          f"{best[2] / best[1]:8.2f}x {busy:12.2f}   {fmt(runs[1])} | "
          f"{fmt(runs[2])}",
          flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shared", default=str(
      pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"))
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--batches", type=int, default=20)
  parser.add_argument("--seq_len", type=int, default=128)
  parser.add_argument("--model", action="store_true",
                      help="also time a small model's training step")
  parser.add_argument("--scaling", action="store_true",
                      help="1 vs 2 cores (taskset) per pipeline")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--only", default="", help="pipelines to run "
                      "(comma-separated labels)")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line per pipeline")
  args = parser.parse_args()
  table = pipelines(pathlib.Path(args.shared), args.seq_len)
  if args.only:
    wanted = args.only.split(",")
    table = [t for t in table if t[0] in wanted]
  if args.scaling:
    scaling(args, [t[0] for t in table])
    return
  if args.json:
    for label, cfg, split in table:
      rate, tok, _, busy = time_pipeline(cfg, split, args.batch_size,
                                         args.batches)
      print(json.dumps({"pipeline": label, "examples_s": rate,
                        "tokens_s": tok, "cpu_s_per_s": busy,
                        "cpus": len(os.sched_getaffinity(0))}))
    return
  print(f"{'pipeline':26s} {'examples/s':>11s} {'tokens/s':>11s} "
        f"{'model ex/s':>11s}")
  for label, cfg, split in table:
    rate, tok, batch, _ = time_pipeline(cfg, split, args.batch_size,
                                        args.batches)
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
    print(f"{label:26s} {rate:11.1f} {tok:11.0f} {model_rate}", flush=True)


if __name__ == "__main__":
  main()
