"""Small local fixtures for tests: a generated corpus, GLUE-style files and a
tiny SentencePiece vocabulary trained on them (no download, ~1 s)."""
from __future__ import annotations

import json
import os

import numpy as np

from hypermixer_jax.data import train_vocab

WORDS = ("the a of to and in is was for on that with as by at from it his "
         "an were are which this be has or had first one their its new after "
         "who they two her she been other when there all during into school "
         "time may years more most only over city some world would where "
         "later up such used many can state about national out known "
         "university united then made").split()


def sentences(n: int, seed: int = 0, min_words: int = 3, max_words: int = 40
              ) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, rng.integers(min_words, max_words + 1)))
          + "." for _ in range(n)]


def write_corpus(folder: str, num_files: int = 2, docs_per_file: int = 30,
                 seed: int = 0, max_words: int = 150) -> str:
  """C4-style JSONL shards ``corpus-0000i.jsonl``; returns their glob."""
  os.makedirs(folder, exist_ok=True)
  for i in range(num_files):
    docs = sentences(docs_per_file, seed=seed * 1000 + i, max_words=max_words)
    with open(os.path.join(folder, f"corpus-{i:05d}.jsonl"), "w") as f:
      for j, d in enumerate(docs):
        f.write(json.dumps({"text": d, "url": f"doc{i}-{j}"}) + "\n")
  return os.path.join(folder, "corpus-*.jsonl")


def write_pairs_tsv(path: str, n: int, seed: int = 0) -> list[int]:
  """An MNLI-style TSV (sentence1, sentence2, gold_label); returns labels."""
  rng = np.random.default_rng(seed)
  names = ("entailment", "neutral", "contradiction")
  labels = rng.integers(0, 3, n).tolist()
  a, b = sentences(n, seed), sentences(n, seed + 1)
  with open(path, "w") as f:
    f.write("sentence1\tsentence2\tgold_label\n")
    for x, y, l in zip(a, b, labels):
      f.write(f"{x}\t{y}\t{names[l]}\n")
  return labels


def tiny_vocab(folder: str, vocab_size: int = 90) -> str:
  """Trains a small SentencePiece model on generated text; returns its path."""
  os.makedirs(folder, exist_ok=True)
  text = os.path.join(folder, "vocab_text.txt")
  with open(text, "w") as f:
    f.write("\n".join(sentences(400, seed=123)) + "\n")
  return train_vocab.train(text, os.path.join(folder, "tiny"), vocab_size)
