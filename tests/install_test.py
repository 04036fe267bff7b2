"""constraints.txt resolves every extra of the tested install in one go: each
requirement met by the pins, each package of the tree pinned."""
import importlib.metadata
import os
import re

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The extras CI installs (.ci/run) and the tested environment holds.
EXTRAS = ("test", "tpu", "gcs")
# Build tools that ``pip freeze`` leaves out by design (the venv has them).
UNPINNED = ("pip", "setuptools", "wheel")


def _name(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, Version]:
  pins = {}
  with open(os.path.join(ROOT, "constraints.txt"), encoding="utf-8") as f:
    for line in f:
      line = line.split("#")[0].strip()
      if line:
        name, version = line.split("==")
        pins[_name(name)] = Version(version)
  return pins


def _requires(dist: str, extras: set[str]) -> list[Requirement]:
  out = []
  for text in importlib.metadata.requires(dist) or []:
    req = Requirement(text)
    if req.marker is None or any(req.marker.evaluate({"extra": e})
                                 for e in extras | {""}):
      out.append(req)
  return out


def test_constraints_satisfy_the_whole_tree_of_the_extras():
  """What pip's resolver needs from ``-c constraints.txt``: no package of
  ``.[test,tpu,gcs]``'s tree is left to float (a later ``pip install`` of
  an extra would take its newest release: grpcio-status then wanted a newer
  grpcio than the pin), and every pin meets every requirement on it."""
  pins = _pins()
  todo = [("hypermixer_jax", set(EXTRAS))]
  seen, problems = set(), []
  while todo:
    dist, extras = todo.pop()
    for req in _requires(dist, extras):
      name = _name(req.name)
      if name in UNPINNED:
        continue
      if name not in pins:
        problems.append(f"{name} (required by {dist}) is not pinned")
        continue
      if not req.specifier.contains(pins[name], prereleases=True):
        problems.append(f"{name}=={pins[name]} does not meet {dist}'s {req}")
      key = (name, frozenset(req.extras))
      if key not in seen:
        seen.add(key)
        todo.append((name, set(req.extras)))
  assert not problems, "\n".join(sorted(set(problems)))
  # The pins are this environment's versions (what the suite passed with).
  installed = {_name(n): Version(importlib.metadata.version(n))
               for n, _ in seen}
  assert {n: v for n, v in installed.items() if pins[n] != v} == {}
  assert "libtpu" in {n for n, _ in seen}
