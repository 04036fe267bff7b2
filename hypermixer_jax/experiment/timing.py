"""Timing and memory of compiled calls, for the speed experiments."""
from __future__ import annotations

import time
from typing import Any, Callable


def time_rounds(calls: dict[str, Callable[[], Any]], rounds: int,
                min_seconds: float = 0.0,
                clock: Callable[[], float] = time.perf_counter
                ) -> dict[str, list[float]]:
  """Seconds of every call of ``calls`` (each must block until its result is
  ready), timed in interleaved rounds, one call of each per round, so that a
  change of the machine's load hits all of them alike: at least ``rounds``
  rounds, and more while a call's times add up to less than
  ``min_seconds``."""
  times: dict[str, list[float]] = {name: [] for name in calls}
  done = 0
  while done < rounds or any(sum(t) < min_seconds for t in times.values()):
    for name, call in calls.items():
      t0 = clock()
      call()
      times[name].append(clock() - t0)
    done += 1
  return times


def compiled_bytes(compiled) -> int:
  """Memory a compiled JAX call needs: XLA's memory analysis, temporaries +
  arguments + outputs (0 where the backend gives none)."""
  mem = compiled.memory_analysis()
  if mem is None:
    return 0
  return int(sum(getattr(mem, f, 0) or 0 for f in (
      "temp_size_in_bytes", "argument_size_in_bytes",
      "output_size_in_bytes")))
