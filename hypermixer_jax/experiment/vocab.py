"""An experiment's small in-domain SentencePiece vocabulary, and the store
that keeps one committed copy of each.

SentencePiece's training is not bit-reproducible, and a run's config
fingerprint holds its vocabulary's digest, so a study that resumes must find
the very file its records name. The store (``experiments/results/vocab/``,
beside the experiments' folders) holds each vocabulary once under its
digest, xz-compressed (a third of the size), whichever experiments use it;
each experiment keeps a working copy in its own ``vocab/`` (not committed).
"""
from __future__ import annotations

import lzma
import os
import pathlib
from typing import Any, Sequence

from hypermixer_jax.experiment.digests import file_digest

# Hex digits of the SHA-256 in a stored file's name.
PREFIX = 16


def stored_name(digest: str) -> str:
  """The store's file name of the vocabulary whose SHA-256 is ``digest``."""
  return f"{digest[:PREFIX]}.model.xz"


def store(model: os.PathLike | str, store_dir: os.PathLike | str) -> str:
  """Puts ``model`` into the store (once) and returns its SHA-256."""
  digest = file_digest(model)
  path = pathlib.Path(store_dir) / stored_name(digest)
  if not path.exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(lzma.compress(pathlib.Path(model).read_bytes(),
                                  preset=9 | lzma.PRESET_EXTREME))
    tmp.replace(path)
  return digest


def restore(digest: str, store_dir: os.PathLike | str,
            model: os.PathLike | str) -> bool:
  """Writes the stored vocabulary ``digest`` to ``model``; False when the
  store lacks it. A stored file of other content is an error."""
  path = pathlib.Path(store_dir) / stored_name(digest)
  if not path.exists():
    return False
  model = pathlib.Path(model)
  model.parent.mkdir(parents=True, exist_ok=True)
  tmp = model.with_suffix(f".{os.getpid()}.tmp")
  tmp.write_bytes(lzma.decompress(path.read_bytes()))
  if file_digest(tmp) != digest:
    tmp.unlink()
    raise ValueError(f"{path}: its content is not the vocabulary of SHA-256 "
                     f"{digest}; restore the file from git.")
  tmp.replace(model)
  return True


def small_vocab(out: os.PathLike | str, patterns: str | Sequence[str],
                fields: Sequence[str], size: int = 8000, *,
                store_dir: os.PathLike | str | None = None,
                digest: str | None = None) -> dict[str, Any]:
  """An in-domain SentencePiece vocabulary of ``size`` pieces trained on the
  train text only (``hypermixer_jax.data.train_vocab``), cached as
  ``out/vocab/spm<size>.model``.

  With ``store_dir``, the vocabulary of SHA-256 ``digest`` (recorded by an
  earlier run) is restored from the store instead of trained again, and a
  vocabulary is stored there once built. Returns ``{'path', 'pieces',
  'sha256', 'model_vocab_size'}``: ``model_vocab_size`` is the embedding
  size a model needs (pieces + seqio's 100 extra ids, rounded up to a
  multiple of 128).
  """
  from hypermixer_jax.data import train_vocab  # pylint: disable=g-import-not-at-top
  prefix = pathlib.Path(out) / "vocab" / f"spm{size}"
  model = prefix.with_suffix(".model")
  if (model.exists() and store_dir and digest
      and file_digest(model) != digest):
    # A working copy of another vocabulary (a copied or older folder): the
    # recorded one, from the store, replaces it.
    restore(digest, store_dir, model)
  if not model.exists() and not (
      store_dir and digest and restore(digest, store_dir, model)):
    prefix.parent.mkdir(parents=True, exist_ok=True)
    train_vocab.train(patterns, str(prefix), size, fields=tuple(fields))
  sha = store(model, store_dir) if store_dir else file_digest(model)
  return {"path": str(model), "pieces": size, "sha256": sha,
          "model_vocab_size": -(-(size + 100) // 128) * 128}
