"""SentencePiece vocabularies through seqio, with the special ids we need.

T5 vocabularies have pad=0, eos=1, unk=2 and no [MASK]/[CLS]/[SEP]. seqio
appends ``extra_ids`` sentinels at the top of the id range; the first three
(``<extra_id_0..2>``) serve as [MASK], [CLS] and [SEP], so any SentencePiece
model (the T5 one, or one trained with ``train_vocab``) works unchanged.
"""
from __future__ import annotations

import dataclasses
import functools

import seqio
import sentencepiece as spm
import tensorflow as tf

NUM_SPECIAL = 3  # [MASK], [CLS], [SEP]


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  pad: int
  eos: int
  mask: int
  cls: int
  sep: int
  # Random replacement tokens for MLM are drawn from [first_regular, num_regular).
  first_regular: int
  num_regular: int


def check_vocab_path(path: str) -> None:
  """Raises a clear error when ``path`` is not a readable SentencePiece model."""
  hint = ("Pass a local SentencePiece model with --config.data.vocab_path=..., "
          "or train one from local text with `python -m "
          "hypermixer_jax.data.train_vocab --input=... --output=...`.")
  if not path:
    raise ValueError(f"data.vocab_path is empty. {hint}")
  try:
    exists = tf.io.gfile.exists(path)
  except Exception as e:  # pylint: disable=broad-except
    raise FileNotFoundError(
        f"Cannot reach the vocabulary {path!r} ({type(e).__name__}: {e}). "
        f"{hint}") from e
  if not exists:
    raise FileNotFoundError(f"Vocabulary file {path!r} does not exist. {hint}")
  _load_proto(path)


@functools.lru_cache(maxsize=8)
def _load_proto(path: str) -> int:
  with tf.io.gfile.GFile(path, "rb") as f:
    proto = f.read()
  processor = spm.SentencePieceProcessor()
  try:
    processor.LoadFromSerializedProto(proto)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f"Vocabulary file {path!r} is not a valid SentencePiece model "
        f"({type(e).__name__}: {e}).") from e
  return processor.GetPieceSize()


@functools.lru_cache(maxsize=8)
def get_vocabulary(path: str, extra_ids: int = 100
                   ) -> seqio.SentencePieceVocabulary:
  """seqio vocabulary of the SentencePiece model at ``path``."""
  if extra_ids < NUM_SPECIAL:
    raise ValueError(f"extra_ids={extra_ids}: need at least {NUM_SPECIAL} for "
                     "[MASK], [CLS] and [SEP].")
  return seqio.SentencePieceVocabulary(path, extra_ids=extra_ids)


def special_ids(vocab: seqio.SentencePieceVocabulary) -> SpecialIds:
  """Ids of the special tokens of ``vocab`` (see the module docstring)."""
  top = vocab.vocab_size - 1  # <extra_id_0>
  base = vocab.vocab_size - vocab.extra_ids
  return SpecialIds(pad=vocab.pad_id, eos=vocab.eos_id, mask=top, cls=top - 1,
                    sep=top - 2, first_regular=3, num_regular=base)
