"""Digests that tie a record to the files and settings it came from."""
from __future__ import annotations

import hashlib
import json
import os


def file_digest(path: os.PathLike | str) -> str:
  """SHA-256 of a file's bytes (hex), recorded beside what it produced."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def config_fingerprint(config) -> str:
  """SHA-256 of a run's config (a ``ConfigDict``) with every path of an
  existing file replaced by that file's digest: two configs with the same
  fingerprint train the same run, wherever their files live."""
  def settle(value):
    if isinstance(value, dict):
      return {k: settle(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [settle(v) for v in value]
    if isinstance(value, str) and value and os.path.isfile(value):
      return "file sha256 " + file_digest(value)
    return value
  text = json.dumps(settle(config.to_dict()), sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()
