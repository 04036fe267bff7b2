"""SentencePiece vocabularies through seqio, with the special ids we need.

T5 vocabularies have pad=0, eos=1, unk=2 and no [MASK]/[CLS]/[SEP]. seqio
appends ``extra_ids`` sentinels at the top of the id range; the first three
(``<extra_id_0..2>``) serve as [MASK], [CLS] and [SEP], so any SentencePiece
model (the T5 one, or one trained with ``train_vocab``) works unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import seqio
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
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
  """Number of pieces of a complete SentencePiece model at ``path``.

  SentencePiece loads a truncated file as long as it ends between two
  pieces (the first 1,000 bytes of the T5 model load as 76 pieces, which
  moves every extra id). The trainer writes the pieces first and then its
  spec, which records the vocabulary size: a model without it, or whose
  piece count differs from it, is refused as damaged.
  """
  with tf.io.gfile.GFile(path, "rb") as f:
    proto = f.read()
  processor = spm.SentencePieceProcessor()
  try:
    processor.LoadFromSerializedProto(proto)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f"Vocabulary file {path!r} is not a valid SentencePiece model "
        f"({type(e).__name__}: {e}).") from e
  model = sp_pb2.ModelProto()
  model.ParseFromString(proto)
  pieces = processor.GetPieceSize()
  if not model.HasField("trainer_spec") or not model.HasField(
      "normalizer_spec"):
    raise ValueError(
        f"Vocabulary file {path!r} ({len(proto)} bytes, {pieces} pieces) "
        "has no trainer/normalizer spec: it is truncated or damaged. Copy it "
        "again, or train one with `python -m hypermixer_jax.data.train_vocab`.")
  if model.trainer_spec.vocab_size != pieces:
    raise ValueError(
        f"Vocabulary file {path!r} holds {pieces} pieces but was trained "
        f"with vocab_size={model.trainer_spec.vocab_size}: it is truncated "
        "or damaged. Copy it again.")
  return pieces


def check_fits_model(vocab: seqio.SentencePieceVocabulary,
                     model_vocab_size: int, field: str = "model.vocab_size"
                     ) -> SpecialIds:
  """Every id the text pipelines can emit must be a row of the embedding.

  The pipelines emit SentencePiece ids, EOS/pad, the random MLM
  replacements (below the SentencePiece size) and [MASK]/[CLS]/[SEP], the
  three highest ids (``vocab.vocab_size - 1`` at the top). Returns the
  special ids after checking that they are distinct and above the pieces.
  """
  ids = special_ids(vocab)
  highest = vocab.vocab_size - 1
  if highest >= model_vocab_size:
    raise ValueError(
        f"{field}={model_vocab_size} is too small for the vocabulary "
        f"{vocab.sentencepiece_model_file!r}: the pipeline emits "
        f"ids up to {highest} ({vocab.vocab_size - vocab.extra_ids} pieces + "
        f"{vocab.extra_ids} extra ids; [MASK]={ids.mask}, [CLS]={ids.cls}, "
        f"[SEP]={ids.sep}). Set --config.model.vocab_size="
        f"{-(-vocab.vocab_size // 128) * 128} (the size rounded up to 128).")
  specials = {ids.mask, ids.cls, ids.sep}
  base = vocab.vocab_size - vocab.extra_ids
  if len(specials) != 3 or min(specials) < base or specials & {
      ids.pad, ids.eos}:
    raise ValueError(
        f"Special ids [MASK]={ids.mask}, [CLS]={ids.cls}, [SEP]={ids.sep} "
        f"collide with the {base} SentencePiece pieces or pad/eos; "
        f"data.extra_ids={vocab.extra_ids} must be at least {NUM_SPECIAL}.")
  return ids


@functools.lru_cache(maxsize=8)
def get_vocabulary(path: str, extra_ids: int = 100
                   ) -> seqio.SentencePieceVocabulary:
  """seqio vocabulary of the SentencePiece model at ``path``."""
  if extra_ids < NUM_SPECIAL:
    raise ValueError(f"extra_ids={extra_ids}: need at least {NUM_SPECIAL} for "
                     "[MASK], [CLS] and [SEP].")
  return seqio.SentencePieceVocabulary(path, extra_ids=extra_ids)


def continuation_encoder(vocab: seqio.SentencePieceVocabulary
                         ) -> Callable[[str], list[int]]:
  """Encodes text that goes on from a token before it, as SentencePiece
  tokenizes it inside a whole text: without the word-start marker the model
  adds to the start of every text it encodes (``add_dummy_prefix``; ``.``
  alone encodes as ``▁`` ``.``, within a sentence as ``.``)."""
  proto = sp_pb2.ModelProto.FromString(vocab.sp_model)
  proto.normalizer_spec.add_dummy_prefix = False
  processor = spm.SentencePieceProcessor(
      model_proto=proto.SerializeToString())
  return lambda text: list(processor.encode(text))


def special_ids(vocab: seqio.SentencePieceVocabulary) -> SpecialIds:
  """Ids of the special tokens of ``vocab`` (see the module docstring)."""
  top = vocab.vocab_size - 1  # <extra_id_0>
  base = vocab.vocab_size - vocab.extra_ids
  return SpecialIds(pad=vocab.pad_id, eos=vocab.eos_id, mask=top, cls=top - 1,
                    sep=top - 2, first_regular=3, num_regular=base)
