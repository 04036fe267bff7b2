"""What ``benchmarks/bench_input.py`` measures: the input pipelines of the
tasks on the local data samples (text samples optionally read as shards),
their throughput and the host cores they keep busy, what saving and
restoring a pipeline's position costs, and the train step of the model each
pipeline feeds (the rate a host must supply to keep it busy)."""
from __future__ import annotations

import json
import os
import pathlib
import time

import numpy as np

from hypermixer_jax import data


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
