"""An experiment's small in-domain SentencePiece vocabulary."""
from __future__ import annotations

import os
import pathlib
from typing import Any, Sequence

from hypermixer_jax.experiment.digests import file_digest


def small_vocab(out: os.PathLike | str, patterns: str | Sequence[str],
                fields: Sequence[str], size: int = 8000) -> dict[str, Any]:
  """An in-domain SentencePiece vocabulary of ``size`` pieces trained on the
  train text only (``hypermixer_jax.data.train_vocab``), cached as
  ``out/vocab/spm<size>.model``.

  Returns ``{'path', 'pieces', 'sha256', 'model_vocab_size'}``:
  ``model_vocab_size`` is the embedding size a model needs (pieces + seqio's
  100 extra ids, rounded up to a multiple of 128).
  """
  from hypermixer_jax.data import train_vocab  # pylint: disable=g-import-not-at-top
  prefix = pathlib.Path(out) / "vocab" / f"spm{size}"
  model = prefix.with_suffix(".model")
  if not model.exists():
    prefix.parent.mkdir(parents=True, exist_ok=True)
    train_vocab.train(patterns, str(prefix), size, fields=tuple(fields))
  return {"path": str(model), "pieces": size, "sha256": file_digest(model),
          "model_vocab_size": -(-(size + 100) // 128) * 128}
