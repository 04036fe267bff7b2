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

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # keep tf off accelerators

from hypermixer_jax import runtime  # noqa: E402
from hypermixer_jax.experiment import input_rates  # noqa: E402


def _parser() -> argparse.ArgumentParser:
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
                      "(default: 1,000 examples for text, 100 for "
                      "images; the data config's own default is 10,000)")
  parser.add_argument("--json", action="store_true",
                      help="print one JSON line per pipeline")
  return parser


def main():
  runtime.prepare_host()  # before JAX's first device query
  args = _parser().parse_args()
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
  table = input_rates.pipelines(pathlib.Path(args.shared), args.seq_len,
                                args.shards, args.shard_dir)
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
    print_state(args, table)
  else:
    print_rates(args, table)


def print_state(args, table):
  """``--state``: one line per pipeline of what its checkpoint costs."""
  print(f"{'pipeline':26s} {'state MB':>9s} {'save s':>7s} "
        f"{'TF save s':>9s} {'restore->batch s':>16s} "
        f"{'new->batch s':>12s}")
  for label, cfg, split in table:
    r = input_rates.state_timing(cfg, split, args.batch_size,
                                 args.warmup_batches)
    print(f"{label:26s} {r['state_mb']:9.2f} {r['save_s']:7.2f} "
          f"{r['tf_save_s']:9.2f} {r['restore_first_batch_s']:16.2f} "
          f"{r['new_first_batch_s']:12.2f}"
          + (f"  (replayed {r['replayed']})" if r["replayed"] else ""),
          flush=True)


def print_rates(args, table):
  """One line per pipeline of its rates (and its model's, with
  ``--model``), as a table or as JSON lines."""
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
    r = input_rates.measure_pipeline(cfg, split, args.batch_size,
                                     args.batches, args.warmup_batches)
    batch = r.pop("batch")
    model = ""
    m = input_rates.task_model(cfg, batch, args.model, args.model_layers,
                               args.image_model) if args.model else None
    if m is not None:
      c = input_rates.model_consumption(m, args.batch_size,
                                        batch["inputs"].shape[1])
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
