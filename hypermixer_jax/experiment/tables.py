"""Markdown tables of an experiment's report."""
from __future__ import annotations

from typing import Any, Iterable, Sequence


def markdown_table(headers: Sequence[str],
                   rows: Iterable[Sequence[Any]]) -> str:
  """A GitHub Markdown table; floats with 4 significant digits."""
  def cell(v):
    if isinstance(v, float):
      return "nan" if v != v else f"{v:.4g}"
    return str(v)
  lines = ["| " + " | ".join(headers) + " |",
           "| " + " | ".join("---" for _ in headers) + " |"]
  lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)


def table_row(headers: Sequence[str], cells: dict[str, Any]) -> list[Any]:
  """A row of a table with ``headers``: ``cells`` by header, '' elsewhere
  (the baselines' rows, which fill a few columns)."""
  unknown = set(cells) - set(headers)
  if unknown:
    raise ValueError(f"table_row: no column {sorted(unknown)}; columns: "
                     f"{list(headers)}.")
  return [cells.get(h, "") for h in headers]


def perplexity_baseline_rows(headers: Sequence[str], base: dict[str, Any],
                             value: str, ratio: str) -> list[list[Any]]:
  """The unigram and add-k bigram rows of a language model table: ``base``'s
  ``unigram`` / ``bigram`` perplexity (``bigram_k`` its k) in column
  ``value``, their ratio to the unigram in column ``ratio``."""
  uni, bi = base["unigram"], base["bigram"]
  return [table_row(headers, {headers[0]: "unigram (train counts, add-1)",
                              value: f"{uni:.1f}", ratio: "1.00"}),
          table_row(headers, {headers[0]: f"bigram (add-{base['bigram_k']:g})",
                              value: f"{bi:.1f}", ratio: f"{bi / uni:.2f}"})]
