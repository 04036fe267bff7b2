r"""Trains a SentencePiece vocabulary from local text (no bucket needed).

The model follows the T5 conventions that the pipelines expect (pad=0,
eos=1, unk=2, no BOS, unigram, nmt_nfkc normalisation); seqio then appends the
extra ids ([MASK], [CLS], [SEP], ...).

  python -m hypermixer_jax.data.train_vocab \
      --input='/data/c4/*.jsonl,/data/wiki.train.raw' \
      --output=/data/vocab/spm32k --vocab_size=32000

writes ``/data/vocab/spm32k.model``; pass it as ``--config.data.vocab_path``.
Inputs may be JSONL (the ``text`` field, or ``--field``), TSV with a header
(``--field`` columns) or plain text (one sentence or paragraph per line).
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import sys
from typing import Iterator, Sequence

import seqio
import tensorflow as tf
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

from hypermixer_jax.data import sources

# Some GLUE/NLI fields are long; the csv module's default limit is 128 kB.
csv.field_size_limit(sys.maxsize)


def _rows(path: str) -> Iterator[dict]:
  """Dict rows of a local file (JSONL object, TSV with header, text line)."""
  fmt = sources.file_format(path)
  with sources.open_text(path) as f:
    if fmt == "jsonl":
      yield from (json.loads(line) for line in f if line.strip())
    elif fmt == "tsv":
      yield from csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
    else:
      yield from ({"text": line.rstrip("\n")} for line in f if line.strip())


def iter_text(patterns: str | Sequence[str], fields: Sequence[str] = ("text",)
              ) -> Iterator[str]:
  """Lines of text of the local files matching ``patterns``."""
  files = seqio.utils.list_files(sources.split_patterns(patterns))
  if not files:
    raise FileNotFoundError(f"No file matches {patterns!r}.")
  for path in files:
    for row in _rows(path):
      for f in fields:
        if row.get(f):
          yield str(row[f])


def train(patterns: str | Sequence[str], output_prefix: str, vocab_size: int,
          *, fields: Sequence[str] = ("text",), max_sentences: int = 2_000_000,
          model_type: str = "unigram", character_coverage: float = 0.9999
          ) -> str:
  """Trains the model; returns the path of the ``.model`` file."""
  spm.SentencePieceTrainer.train(
      sentence_iterator=itertools.islice(iter_text(patterns, fields),
                                         max_sentences),
      model_prefix=output_prefix, vocab_size=vocab_size,
      model_type=model_type, character_coverage=character_coverage,
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      normalization_rule_name="nmt_nfkc", max_sentence_length=1 << 16,
      train_extremely_large_corpus=False, minloglevel=2)
  path = output_prefix + ".model"
  # The trainer writes its output path into the model; keep only the file's
  # name, so that the same text gives the same bytes (and SHA-256) wherever
  # the vocabulary is built.
  proto = sentencepiece_model_pb2.ModelProto()
  with open(path, "rb") as f:
    proto.ParseFromString(f.read())
  proto.trainer_spec.model_prefix = os.path.basename(output_prefix)
  with open(path, "wb") as f:
    f.write(proto.SerializeToString())
  return path


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--input", required=True,
                      help="comma-separated file patterns")
  parser.add_argument("--output", required=True,
                      help="output prefix (writes PREFIX.model, PREFIX.vocab)")
  parser.add_argument("--vocab_size", type=int, default=32000)
  parser.add_argument("--field", default="text",
                      help="comma-separated JSONL/TSV fields holding text")
  parser.add_argument("--max_sentences", type=int, default=2_000_000)
  parser.add_argument("--model_type", default="unigram",
                      choices=("unigram", "bpe"))
  args = parser.parse_args(argv)
  path = train(args.input, args.output, args.vocab_size,
               fields=args.field.split(","), max_sentences=args.max_sentences,
               model_type=args.model_type)
  print(path)


if __name__ == "__main__":
  main()
