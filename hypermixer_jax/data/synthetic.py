"""The HyperMixer paper's synthetic task (§4.7), after Fleuret (2019).

A 1-d sequence of length N holds, for each shape type (triangle, box, ...),
two objects of random width and height, never touching. The target is the
same sequence with the height of each object replaced by the mean height of
the two objects of its shape type, so every position of an object must find
the other object of the same shape: a task that needs token mixing.
Inputs get uniform noise; targets are clean. Heights are divided by
``max_height`` when ``normalize``.

Examples are generated in blocks of ``BLOCK`` with NumPy, each block from its
own generator ``default_rng([data_seed, stream, block])``: example i of a
split is the same whatever the batch size, the number of hosts or the order in
which blocks are asked for.

``validation_every = k > 0`` carves the validation split from the training
set (for choosing hyperparameters without a fresh draw the training budget
does not have): validation is every k-th of the ``num_examples`` training
sequences (0, k, 2k, ...), train the others; test stays its own draw.
"""
from __future__ import annotations

import functools
from typing import Mapping

import ml_collections
import numpy as np

BLOCK = 1024
SHAPES = ("triangle", "box", "bump")
STREAMS = {"train": 0, "validation": 1, "test": 2}


def _options_key(opts: ml_collections.ConfigDict | Mapping) -> tuple:
  d = dict(opts)
  d["shapes"] = tuple(d["shapes"])
  return tuple(sorted(d.items()))


def check_options(opts) -> None:
  """Raises ValueError for options that cannot produce a sequence."""
  every = opts.get("validation_every", 0)
  if every and (every < 2 or not opts.num_examples
                or opts.num_examples < every):
    raise ValueError(
        f"synthetic.validation_every={every} carves every {every}th training "
        f"sequence: it needs 2 <= validation_every <= num_examples (a finite "
        f"training set, num_examples={opts.num_examples}); set it to 0 for a "
        "validation split of its own.")
  for s in opts.shapes:
    if s not in SHAPES:
      raise ValueError(f"synthetic.shapes: unknown shape {s!r}; choose "
                       f"from {SHAPES}.")
  if not opts.shapes:
    raise ValueError("synthetic.shapes is empty; name at least one shape.")
  if not 1 <= opts.min_width <= opts.max_width:
    raise ValueError(f"synthetic.min_width, max_width: need 1 <= min_width "
                     f"<= max_width, got "
                     f"{opts.min_width}, {opts.max_width}.")
  num_objects = 2 * len(opts.shapes)
  minimum = num_objects * opts.max_width + num_objects - 1
  if opts.seq_len < minimum:
    raise ValueError(
        f"synthetic.seq_len={opts.seq_len} is below the minimum {minimum} for "
        f"{num_objects} objects of width up to {opts.max_width} (with gaps).")


def _profiles(kind: np.ndarray, start: np.ndarray, width: np.ndarray,
              height: np.ndarray, seq_len: int) -> np.ndarray:
  """Sum of the objects' profiles: [n, M] objects -> [n, N] sequences."""
  x = np.arange(seq_len, dtype=np.float32)[None, None, :]          # [1, 1, N]
  s, w, h = (a[..., None].astype(np.float32) for a in (start, width, height))
  inside = (x >= s) & (x < s + w)                                  # [n, M, N]
  centre = s + (w - 1) / 2
  half = (w + 1) / 2
  u = np.clip(np.abs(x - centre) / half, 0.0, 1.0)
  k = kind[..., None]
  shape = np.where(k == 0, 1.0 - u,                                # triangle
                   np.where(k == 1, 1.0, np.sqrt(1.0 - u * u)))    # box, bump
  return np.sum(np.where(inside, h * shape, 0.0), axis=1)


@functools.lru_cache(maxsize=16)
def _block(key: tuple, stream: int, block: int) -> tuple[np.ndarray, np.ndarray]:
  opts = dict(key)
  shapes = [SHAPES.index(s) for s in opts["shapes"]]
  n, seq_len = BLOCK, opts["seq_len"]
  m = 2 * len(shapes)
  rng = np.random.default_rng([opts["data_seed"], stream, block])
  kind = np.repeat(np.asarray(shapes), 2)[None].repeat(n, 0)       # [n, M]
  width = rng.integers(opts["min_width"], opts["max_width"] + 1, (n, m))
  height = rng.uniform(opts["min_height"], opts["max_height"], (n, m))
  # Uniform non-touching placement: a random order of the objects, and the
  # free cells spread by a uniform stars-and-bars composition.
  free = seq_len - width.sum(1) - (m - 1)                          # [n]
  slots = free.max() + m
  keys = rng.random((n, slots))
  keys[np.arange(slots)[None] >= (free + m)[:, None]] = np.inf
  bars = np.sort(np.argpartition(keys, m - 1, axis=1)[:, :m], axis=1)
  order = np.argsort(rng.random((n, m)), axis=1)                   # slot -> object
  w_ordered = np.take_along_axis(width, order, 1)
  start_ordered = bars + np.cumsum(w_ordered, 1) - w_ordered
  start = np.empty_like(start_ordered)
  np.put_along_axis(start, order, start_ordered, 1)
  mean = height.reshape(n, -1, 2).mean(-1).repeat(2, -1)           # pair means
  noise = opts["noise"] * (rng.random((n, seq_len)) - 0.5)
  inputs = _profiles(kind, start, width, height, seq_len) + noise
  targets = _profiles(kind, start, width, mean, seq_len)
  if opts["normalize"]:
    inputs, targets = inputs / opts["max_height"], targets / opts["max_height"]
  return inputs.astype(np.float32), targets.astype(np.float32)


def generate(opts, split: str, indices: np.ndarray) -> dict[str, np.ndarray]:
  """Examples ``indices`` of ``split`` as a batch in the synthetic format.

  Returns:
    {'inputs': f32 [n, N, 1], 'targets': f32 [n, N, 1], 'weights': f32 [n, N]}.
  """
  key = _options_key(opts)
  stream = STREAMS[split]
  indices = np.asarray(indices, np.int64)
  every = dict(key).get("validation_every", 0)
  if every and split in ("train", "validation"):
    # Both index the training draw: validation its multiples of ``every``,
    # train the rest in order.
    stream = STREAMS["train"]
    indices = (indices * every if split == "validation"
               else indices + indices // (every - 1) + 1)
  blocks, rows = np.divmod(indices, BLOCK)
  inputs = np.empty((len(indices), dict(key)["seq_len"]), np.float32)
  targets = np.empty_like(inputs)
  for b in np.unique(blocks):
    sel = blocks == b
    x, y = _block(key, stream, int(b))
    inputs[sel], targets[sel] = x[rows[sel]], y[rows[sel]]
  return {"inputs": inputs[..., None], "targets": targets[..., None],
          "weights": np.ones(inputs.shape, np.float32)}


@functools.lru_cache(maxsize=4)
def _materialised(key: tuple, split: str, n: int) -> dict[str, np.ndarray]:
  return generate(dict(key), split, np.arange(n))


def split_arrays(opts, split: str) -> dict[str, np.ndarray]:
  """All examples of a finite split (cached): ``generate(opts, split, arange(n))``.

  Takes ``n * seq_len * 12`` bytes; the default 50k x 64 train split is 38 MB.
  """
  n = num_examples(opts, split)
  if not n:
    raise ValueError(f"synthetic split {split!r} is endless (num_examples=0).")
  return _materialised(_options_key(opts), split, n)


def num_examples(opts, split: str) -> int:
  """Size of ``split``; 0 means an endless stream of fresh examples."""
  if split not in STREAMS:
    raise ValueError(f"Unknown split {split!r} for synthetic_pairs; "
                     f"choose from {list(STREAMS)}.")
  every = opts.get("validation_every", 0)
  if every and split != "test":
    held = -(-opts.num_examples // every)   # 0, every, 2 every, ...
    return opts.num_examples - held if split == "train" else held
  return opts.num_examples if split == "train" else opts.num_eval_examples
