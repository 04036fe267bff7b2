r"""Input pipeline throughput on this machine, against the model's consumption.

For each pipeline (local sample data from ../shared/data, no download) prints,
over ``--batches`` batches after ``--warmup_batches`` untimed ones (tracing,
shuffle buffer fill, tf.data autotuning):

* examples/s and tokens/s (patches/s for images, positions/s for the
  synthetic task) of the whole process;
* the cores it kept busy (CPU-seconds of all its threads per second) and
  examples/s per core (examples per CPU-second): what one host core of this
  kind supplies;
* with ``--model MIXER``, the loop's train step (forward, backward, AdamW;
  ``experiment.train_steps.build_step``, one device) of the task's model
  (``glue_<MIXER>`` with the task's head, ``--model_layers`` deep; a
  ``--image_model`` for the image pipeline) at the same batch and length:
  its steps/s, the examples/s a host must supply to keep it busy, and the
  host cores that takes at the pipeline's rate per core (``cores to feed``).
  The pipeline keeps up when ``pipeline / model`` is above 1.

  python benchmarks/bench_input.py --shared=../shared/data --batch_size=32 \
      --batches=20 --model hypermixer

On a shared host, pin the process (``taskset -c 1 python ...``): the rate is
then one core's, and examples/s per core is the figure to compare across
runs. ``--shards K`` reads each text sample as K shards (links to the file),
the layout of a real corpus, which tf.data reads several files at a time;
measure in steady state, well past autotuning:

  python benchmarks/bench_input.py --shards=8 --batch_size=64 \
      --batches=300 --warmup_batches=30

``--state`` times what a checkpoint costs the pipeline instead: saving its
position (against TF's own eager save of the same iterator, in the same
format), its size, and the first batch after a restore and after a
fresh build (what an epoch boundary costs), e.g. with the data config's
default shuffle buffer:

  python benchmarks/bench_input.py --state --shuffle_buffer_size=10000 \
      --batch_size=64 --warmup_batches=30
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # keep tf off accelerators

import numpy as np  # noqa: E402

from hypermixer_jax import data  # noqa: E402
from hypermixer_jax import runtime  # noqa: E402


def sharded(path: pathlib.Path, shards: int, shard_dir: str) -> str:
  """``path`` itself, or ``shards`` links to it in ``shard_dir`` (a pattern).

  Real corpora come in shards (TFDS C4 train: 1,024 files; a t5x or
  big_vision input pipeline interleaves several at once), while each sample
  here is one file, which one reader chain (line reader, line numbering)
  walks in order. Links to the same file stand in for the shards: the rows
  and their cost are the sample's, only the file layout is that of a
  sharded corpus.
  """
  if shards <= 1:
    return str(path)
  os.makedirs(shard_dir, exist_ok=True)
  stem, ext = path.name.split(".", 1)
  for i in range(shards):
    link = os.path.join(shard_dir, f"{stem}-{i:05d}-of-{shards:05d}.{ext}")
    if not os.path.lexists(link):
      os.symlink(path.resolve(), link)
  return os.path.join(shard_dir, f"{stem}-*-of-{shards:05d}.{ext}")


def pipelines(shared: pathlib.Path, seq_len: int, shards: int = 1,
              shard_dir: str = ""):
  """(label, data config, split) of each pipeline to time; with ``shards``
  > 1 the text samples are read as that many shards (``sharded``)."""
  vocab = str(shared / "t5_spm/sentencepiece.model")
  c4 = sharded(shared / "c4/c4_en_train_00000_first1000.jsonl", shards,
               shard_dir)
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
    cfg.local_files.train = sharded(shared / path, shards, shard_dir)
    out.append((task, cfg, "train"))
  cfg = data.default_data_config()
  cfg.update(task="imagenet_patches", shuffle_buffer_size=100)
  cfg.local_files.train = str(shared / "imagenet_sample/labels.tsv")
  out.append(("imagenet_patches 224/16", cfg, "train"))
  cfg = data.default_data_config()
  out.append(("synthetic_pairs", cfg, "train"))
  return out


def state_timing(cfg, split, batch_size: int, warmup: int) -> dict:
  """Seconds to save a pipeline's position (ours, and TF's eager
  ``OwnedIterator._save`` of the same iterator, whose format ours writes),
  the saved size, and the
  seconds to the first batch of a restored and of a newly built pipeline
  (an epoch boundary costs the latter)."""
  kw = dict(batch_size=batch_size, seed=0, repeat=True, shuffle=True)
  pipeline = data.build_pipeline(cfg, split, **kw)
  it = iter(pipeline)
  for _ in range(warmup):
    next(it)
  t0 = time.perf_counter()
  state = pipeline.get_state()
  t1 = time.perf_counter()
  tf_blob = pipeline._iterator._save().numpy().decode()  # pylint: disable=protected-access
  t2 = time.perf_counter()
  del tf_blob  # the same format (tests/data_resume_test.py)
  restored = data.build_pipeline(cfg, split, **kw)
  restored.set_state(json.loads(json.dumps(state)))
  t3 = time.perf_counter()
  next(iter(restored))
  t4 = time.perf_counter()
  next(iter(data.build_pipeline(cfg, split, **kw)))
  t5 = time.perf_counter()
  return {"save_s": t1 - t0, "tf_save_s": t2 - t1,
          "state_mb": len(state.get("iterator", "")) / 1e6,
          "restore_first_batch_s": t4 - t3, "new_first_batch_s": t5 - t4,
          "replayed": restored.batches_replayed}


def measure_pipeline(cfg, split, batch_size: int, batches: int,
                     warmup: int = 1) -> dict:
  """Rates of one pipeline over ``batches`` batches after ``warmup``.

  ``cores_busy`` is CPU-seconds (all threads of the process) per second of
  wall time; ``examples_s_per_core`` is examples per CPU-second.
  """
  p = data.build_pipeline(cfg, split, batch_size=batch_size, seed=0,
                          repeat=True, shuffle=True)
  it = iter(p)
  batch = None
  for _ in range(warmup):
    batch = next(it)
  start, cpu = time.perf_counter(), time.process_time()
  tokens = 0
  for _ in range(batches):
    b = next(it)
    tokens += int((b["segment_ids"] > 0).sum() if "segment_ids" in b
                  else np.prod(b["inputs"].shape[:2]))
  wall = time.perf_counter() - start
  cpu = time.process_time() - cpu
  n = batches * batch_size
  return {"examples_s": n / wall, "tokens_s": tokens / wall,
          "cores_busy": cpu / wall, "examples_s_per_core": n / max(cpu, 1e-9),
          "batch": batch if batch is not None else b}


# Head of the model a text task's pipeline feeds (configs/c4_*.py, glue.py).
TEXT_HEADS = {"c4_mlm": "mlm", "c4_lm": "causal_lm", "glue_sst2": "classify",
              "glue_mnli": "pair_classify"}


def task_model(cfg, batch, mixer: str, layers: int, image_model: str):
  """The model config that the task of data config ``cfg`` trains (as its
  config file builds it), shaped for ``batch``; None for the synthetic task
  (its regression model has no train-step benchmark)."""
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train.config import text_model  # pylint: disable=g-import-not-at-top
  if cfg.task in TEXT_HEADS:
    m = text_model(mixer, TEXT_HEADS[cfg.task])
    m.max_len = batch["inputs"].shape[1]
    if cfg.task == "glue_mnli":
      m.num_classes = 3
    if cfg.task.startswith("c4"):
      m.type_vocab_size = 0
    if cfg.task == "c4_lm":
      m.mixer_kwargs.causal = True
  elif cfg.task == "imagenet_patches":
    m = models.get_model_config(image_model)
    m.update(input_dim=batch["inputs"].shape[-1],
             max_len=batch["inputs"].shape[1], patch_size=0)
  else:
    return None
  if layers:
    m.num_layers = layers
  return m


def model_consumption(model_cfg, batch_size: int, length: int,
                      rounds: int = 3, min_seconds: float = 0.5) -> dict:
  """Steps/s of the loop's train step for ``model_cfg`` (best of ``rounds``
  timed rounds) and the examples/s a host must supply to keep it busy."""
  from hypermixer_jax.experiment import train_steps  # pylint: disable=g-import-not-at-top
  compiled, state, batch, rng, flops = train_steps.build_step(
      model_cfg, batch_size, length)
  timer = train_steps.step_timer(compiled, state, batch, rng, flops,
                                 min_seconds)
  timer.warm()
  seconds = min(timer.round() for _ in range(rounds))
  return {"steps_s": 1.0 / seconds, "examples_s": batch_size / seconds}


def main():
  runtime.choose_platforms()  # before JAX's first device query
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shared", default=str(
      pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"))
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--batches", type=int, default=20)
  parser.add_argument("--warmup_batches", type=int, default=5,
                      help="batches taken before timing")
  parser.add_argument("--seq_len", type=int, default=128)
  parser.add_argument("--model", default="", metavar="MIXER",
                      help="also time the train step of the task's "
                      "glue_<MIXER> model (e.g. hypermixer)")
  parser.add_argument("--model_layers", type=int, default=2,
                      help="layers of that model (0: the zoo's depth)")
  parser.add_argument("--image_model", default="mixer_s16",
                      help="zoo model fed by the image pipeline")
  parser.add_argument("--shards", type=int, default=1,
                      help="read each text sample as this many shards "
                      "(links to it), as a sharded corpus is read")
  parser.add_argument("--shard_dir", default="",
                      help="where the shard links go (default: a temporary "
                      "folder)")
  parser.add_argument("--only", default="", help="pipelines to run "
                      "(comma-separated labels)")
  parser.add_argument("--state", action="store_true",
                      help="time saving and restoring each pipeline's "
                      "position instead of its throughput")
  parser.add_argument("--shuffle_buffer_size", type=int, default=0,
                      help="override the pipelines' shuffle buffer "
                      "(default: 1,000 examples; the data config's own "
                      "default is 10,000)")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line per pipeline")
  args = parser.parse_args()
  if args.shards > 1 and not args.shard_dir:
    args.shard_dir = tempfile.mkdtemp(prefix="bench_input_shards_")
    try:
      run(args)
    finally:
      shutil.rmtree(args.shard_dir, ignore_errors=True)
    return
  run(args)


def run(args):
  """Runs what ``args`` asks for (see ``main``)."""
  table = pipelines(pathlib.Path(args.shared), args.seq_len, args.shards,
                    args.shard_dir)
  if args.only:
    wanted = args.only.split(",")
    unknown = sorted(set(wanted) - {t[0] for t in table})
    if unknown:
      raise SystemExit(f"--only: unknown pipelines {unknown}; choose from "
                       f"{', '.join(t[0] for t in table)}")
    table = [t for t in table if t[0] in wanted]
  if args.shuffle_buffer_size:
    for _, cfg, _ in table:
      cfg.shuffle_buffer_size = args.shuffle_buffer_size
  if args.state:
    print(f"{'pipeline':26s} {'state MB':>9s} {'save s':>7s} "
          f"{'TF save s':>9s} {'restore->batch s':>16s} "
          f"{'new->batch s':>12s}")
    for label, cfg, split in table:
      r = state_timing(cfg, split, args.batch_size, args.warmup_batches)
      print(f"{label:26s} {r['state_mb']:9.2f} {r['save_s']:7.2f} "
            f"{r['tf_save_s']:9.2f} {r['restore_first_batch_s']:16.2f} "
            f"{r['new_first_batch_s']:12.2f}"
            + (f"  (replayed {r['replayed']})" if r["replayed"] else ""),
            flush=True)
    return
  if not args.json:
    print(f"# batch {args.batch_size} x {args.batches} timed batches after "
          f"{args.warmup_batches} warm-up; {len(os.sched_getaffinity(0))} "
          f"CPU(s) allowed; text samples read as {args.shards} shard(s)")
    print(f"{'pipeline':26s} {'examples/s':>11s} {'tokens/s':>11s} "
          f"{'cores busy':>10s} {'ex/s/core':>10s}"
          + (f" {'model steps/s':>13s} {'model ex/s':>11s} "
             f"{'pipeline/model':>14s} {'cores to feed':>13s}"
             if args.model else ""))
  for label, cfg, split in table:
    r = measure_pipeline(cfg, split, args.batch_size, args.batches,
                         args.warmup_batches)
    batch = r.pop("batch")
    model = ""
    if args.model:
      m = task_model(cfg, batch, args.model, args.model_layers,
                     args.image_model)
      if m is not None:
        c = model_consumption(m, args.batch_size, batch["inputs"].shape[1])
        r.update(model_steps_s=c["steps_s"], model_examples_s=c["examples_s"],
                 cores_to_feed=c["examples_s"] / r["examples_s_per_core"])
        model = (f" {c['steps_s']:13.1f} {c['examples_s']:11.1f} "
                 f"{r['examples_s'] / c['examples_s']:14.2f} "
                 f"{r['cores_to_feed']:13.2f}")
    if args.json:
      print(json.dumps({"pipeline": label, **r}), flush=True)
    else:
      print(f"{label:26s} {r['examples_s']:11.1f} {r['tokens_s']:11.0f} "
            f"{r['cores_busy']:10.2f} {r['examples_s_per_core']:10.1f}"
            f"{model}", flush=True)


if __name__ == "__main__":
  main()
