"""Figures in the docs come from the experiments' records, never typed.

The rule, per page:
* README.md and experiments/README.md: every number in prose and tables
  (code blocks, inline code and included tables aside) appears in a
  generated table (`table*.md`) of the experiment its section cites (the
  `results/<name>/` folders it links), or in the rows of the claims table
  (`experiments/results/claims.md`) drawn from those experiments, or is a
  setting named in ALLOWED.
* A page beside a record (`experiments/results/<name>/README.md`): every
  number in its prose and its own tables appears in the tables of that
  folder (sub-folders included), in the claims rows drawn from it, or is a
  value of their `results.json` at
  the precision shown (a fraction may be
  shown as a percentage). The figures written before this rule that no
  record holds are listed, per page, in `docs_unrecorded.json`; a page may
  lose them (the list then loses them too), never gain one.
* A page of docs/ that reports measurements (DOC_PAGES): every number in
  a section's prose appears in the records (tables or `results.json`, at
  the precision shown) of the experiments whose `results/<name>/` folders
  the section links, or is a setting named in ALLOWED. A figure no record
  holds is left out, or the section gives the command that measures it.
* Every included table equals its file (`scripts/docs_tables.py --check`).
"""
import collections
import functools
import importlib.util
import json
import math
import pathlib
import re

import pytest

from hypermixer_jax.experiment import claims as claims_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
UNRECORDED = pathlib.Path(__file__).with_name("docs_unrecorded.json")

# Settings rather than results: counts up to ten (seeds, layers), and per page
# the sizes, steps and versions a reader needs to run the commands.
SMALL = 10
ALLOWED = {
    "README.md": {"3.11", "32,128", "80/10/10", "32x32", "4x4", "1,500", "64",
                  "1024", "128", "25", "200/1500", "15%", "60", "2048", "16",
                  "2021", "2022", "2023", "1,000"},
    "experiments/README.md": {"2", "20", "4k", "8k", "128", "1000", "1500",
                              "3,000", "2000", "6000", "400", "500", "5,000",
                              "50,000", "8192", "256", "512", "4096", "2048",
                              "10", "100", "80/20", "+12-14", "+2", "1.49M",
                              "0.26M", "32", "32,768", "2021", "2022",
                              "2023", "0.05", "1e-2", "3e-3"},
    "docs/performance.md": {"2x", "2048", "8192", "32,128", "128", "256", "512",
                            "1,024", "2,048", "8,192", "16,384", "16", "32",
                            "64", "100", "10,000"},
}
DOC_PAGES = ["docs/performance.md"]

# A figure: digits with their sign, thousands, decimals, exponent, range
# and unit ("+1.8%", "35-53%", "4.6pp", "1.2e-04", "8k"); a decimal is
# never cut to its integer part ("4.6ms" is one figure, not "4").
NUMBER = re.compile(
    r"(?<![\w.§/'-])[+-]?(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:e[-+]?\d+)?"
    r"(?:[-/]\d+(?:\.\d+)?)*(?:%|[a-zA-Zµ]+)?(?![\w/]|\.\d)")
# An included table, as scripts/docs_tables.py finds it (its marker alone
# on a line): a marker with text after it on the line includes nothing,
# and that text is prose.
INCLUDE = re.compile(r"<!-- table: [^ ]+ -->\n.*?<!-- /table -->", re.DOTALL)
BARE_INTEGER = re.compile(r"\d+")
FENCE = re.compile(r"^ *```.*?^ *```", re.DOTALL | re.MULTILINE)


def _prose(text):
  """Text a reader takes as statements: no code, links' targets or
  included tables (those are checked against their files)."""
  text = FENCE.sub("", INCLUDE.sub("", text))
  text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
  # Inline code is a command, a flag or a setting (`64` rows), unless it
  # holds a measured-looking figure alone: one with decimals (`98.4`).
  text = re.sub(r"`([^`\n]*)`", lambda m: m[1] if (
      NUMBER.fullmatch(m[1].strip()) and "." in m[1]) else " ", text)
  text = re.sub(r"\]\([^)]*\)", "]", text)
  text = re.sub(r"https?://\S+", " ", text)
  # References into the papers: sections, figures, tables.
  return re.sub(r"§\s?[\d.]+|\b(Fig|Figure|Table|Eq)\.?\s\d+[a-z]?", " ",
                text)


def _figures(text):
  return [m.group(0) for m in NUMBER.finditer(text)]


def _parts(figure):
  """The plain numbers of a figure: "+1.8%" -> ["1.8"], "35-53%" -> both."""
  return [p.replace(",", "") for p in
          re.findall(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", figure)]


def _small(figure):
  """A count up to ten (seeds, layers), bare: "9x" or "8%" is a result."""
  return (BARE_INTEGER.fullmatch(figure.lstrip("+-")) is not None
          and int(figure.lstrip("+-")) <= SMALL)


def _tokens(text):
  return {p for f in _figures(text) for p in _parts(f)}


@functools.cache
def _claims_tokens(experiment):
  """Figures of the claims rows drawn from ``experiment``'s record (the rows
  of claims.md it backs; another study's rows back nothing here)."""
  rows = [c for c in claims_lib.CLAIMS if c.experiment == experiment]
  return frozenset(_tokens(claims_lib.table(RESULTS, rows)) if rows else ())


def _table_tokens(folders):
  tokens = set()
  for folder in folders:
    for table in folder.glob("table*.md"):
      tokens |= _tokens(table.read_text())
    tokens |= _claims_tokens(folder.name)
  return tokens


def _leaves(obj):
  if isinstance(obj, dict):
    for v in obj.values():
      yield from _leaves(v)
  elif isinstance(obj, list):
    for v in obj:
      yield from _leaves(v)
  elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
    if math.isfinite(obj):
      yield float(obj)
  elif isinstance(obj, str):
    for p in _parts(" ".join(_figures(obj))):
      yield float(p)


class _Record:
  """Numbers of one experiment folder: its tables' and its results.json's."""

  def __init__(self, folder):
    # The folder's records, its sub-folders' included (a page may compare
    # runs recorded side by side, e.g. one per setting), and every table
    # it writes, whatever its name.
    self.tokens = _table_tokens([folder])
    for table in folder.rglob("*.md"):
      if table.name != "README.md":
        self.tokens |= _tokens(table.read_text())
    self.values = [v for path in sorted(folder.rglob("results.json"))
                   for v in _leaves(json.loads(path.read_text()))]
    self._rounded = {}

  def holds(self, part):
    if part in self.tokens:
      return True
    value = float(part)
    mantissa = part.split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    if "e" in part:  # scientific: compare at the mantissa's digits
      return any(float(f"{v:.{decimals}e}") == value for v in self.values)
    if decimals not in self._rounded:
      self._rounded[decimals] = {round(abs(s * v), decimals)
                                 for v in self.values for s in (1, 100)}
    return round(value, decimals) in self._rounded[decimals]


def _unbacked_in_page(page):
  record = _Record(page.parent)
  return [f for f in _figures(_prose(page.read_text()))
          if not all(record.holds(p) for p in _parts(f))]


def _sections(text, results=RESULTS):
  """(section text, the experiment folders it cites); code blocks go first,
  so that a shell comment is not taken for a heading."""
  text = FENCE.sub("", INCLUDE.sub("", text))
  for section in re.split(r"^#+ ", text, flags=re.MULTILINE):
    cited = set(re.findall(r"results/([\w]+)/", section))
    yield section, [results / name for name in sorted(cited)]


def _unbacked_in_top(path):
  allowed = ALLOWED.get(path, set())
  bad = []
  for section, folders in _sections((ROOT / path).read_text()):
    tokens = _table_tokens(folders)
    for f in _figures(_prose(section)):
      parts = _parts(f)
      if f in allowed or all(p in tokens for p in parts):
        continue
      if _small(f):
        continue
      bad.append(f)
  return bad


@pytest.mark.parametrize("path", ["README.md", "experiments/README.md"])
def test_top_pages_state_only_figures_of_the_generated_tables(path):
  bad = _unbacked_in_top(path)
  assert not bad, (f"{path} states figures that no generated table of the "
                   f"experiment its section cites holds: {bad} (take them from "
                   f"the experiment's table.md or claims.md, or name a setting "
                   f"in ALLOWED)")


@functools.cache
def _record(folder):
  return _Record(folder)


def _unbacked_in_doc(text, allowed=frozenset(), results=RESULTS):
  """Figures of a docs page that neither a setting in ``allowed`` nor one
  record its section links holds (all parts of a figure from one record)."""
  bad = []
  for section, folders in _sections(text, results):
    records = [_record(folder) for folder in folders]
    for f in _figures(_prose(section)):
      parts = _parts(f)
      if f in allowed or any(all(r.holds(p) for p in parts) for r in records):
        continue
      if _small(f):
        continue
      bad.append(f)
  return bad


@pytest.mark.parametrize("path", DOC_PAGES)
def test_doc_pages_state_only_figures_of_the_records_they_link(path):
  bad = _unbacked_in_doc((ROOT / path).read_text(), ALLOWED.get(path, set()))
  assert not bad, (f"{path} states figures that no record its section links "
                   f"holds: {bad} (link the experiment folder whose table or "
                   f"results.json holds them, give the command that measures "
                   f"them instead, or name a setting in ALLOWED)")


def test_doc_rule_takes_figures_only_from_records_the_section_links(
    tmp_path):
  folder = tmp_path / "study"
  folder.mkdir()
  (folder / "results.json").write_text(json.dumps({"speedup": 1.23456}))
  text = ("# A\n\nIt ran 1.235x as fast "
          "([record](../experiments/results/study/README.md)).\n\n"
          "# B\n\nIt ran 1.235x as fast, and 4.00x once, at N = 2048.\n")
  assert _unbacked_in_doc(text, {"2048"}, tmp_path) == ["1.235x", "4.00x"]


def _pages():
  return sorted(RESULTS.glob("*/README.md"))


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.parent.name)
def test_experiment_pages_state_only_recorded_figures(page):
  known = collections.Counter(
      json.loads(UNRECORDED.read_text()).get(page.parent.name, []))
  new = collections.Counter(_unbacked_in_page(page)) - known
  assert not new, (f"{page.relative_to(ROOT)} states figures that neither its "
                   f"tables nor its results.json hold: {sorted(new)} (take them "
                   f"from the record, or record the run that gives them)")


def test_included_tables_are_current():
  spec = importlib.util.spec_from_file_location(
      "docs_tables", ROOT / "scripts" / "docs_tables.py")
  docs_tables = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(docs_tables)
  stale = [f"{page.relative_to(ROOT)}: {path.name}"
           for page in docs_tables.pages()
           for path, copy, text in docs_tables.included(page) if copy != text]
  assert not stale, (f"stale copies of generated tables: {stale} "
                     f"(run: python scripts/docs_tables.py)")


def test_the_rule_catches_a_typed_figure_and_passes_a_recorded_one(tmp_path):
  folder = tmp_path / "study"
  folder.mkdir()
  (folder / "table.md").write_text("| model | acc |\n| --- | --- |\n"
                                    "| A | 80.7 ± 0.9 (n=3) |\n")
  (folder / "results.json").write_text(json.dumps(
      {"runs": {"a/seed=0": {"accuracy": 0.81234, "mse": 1.567e-4}}}))
  page = folder / "README.md"
  page.write_text("A reaches 80.7 ± 0.9; seed 0 81.2% (MSE 1.57e-04), "
                  "`--steps=1234` aside.\n\n<!-- table: table.md -->\n"
                  "| 99.9 |\n<!-- /table -->\n")
  assert _unbacked_in_page(page) == []
  page.write_text("A reaches 80.7, 35-53% of the time, at 1,874.9.\n")
  assert _unbacked_in_page(page) == ["35-53%", "1,874.9"]


def test_the_rule_sees_figures_in_every_form_a_page_writes_them(tmp_path):
  # A unit after a decimal, a small count that is a result ("9x", "8%"),
  # a figure alone in inline code, one after a colon, and text on the line
  # of an include marker (which includes nothing) are all figures to check.
  folder = tmp_path / "study"
  folder.mkdir()
  (folder / "table.md").write_text("| A | 80.7 |\n")
  (folder / "results.json").write_text(json.dumps({"acc": 0.807}))
  page = folder / "README.md"
  page.write_text(
      "A gains 4.6pp, runs 9x faster, is 8% better, reaches `98.4` (dev:94.8)"
      " with `--steps=1234`.\n\n<!-- table: table.md --> It "
      "reaches 97.3. <!-- /table -->\n")
  assert _unbacked_in_page(page) == ["4.6pp", "9x", "8%", "98.4", "94.8",
                                     "97.3"]
  assert _small("2") and not _small("9x") and not _small("1e-2")


def test_claims_rows_back_only_the_experiment_they_come_from(tmp_path):
  """A figure of the claims table backs a page only where the row is drawn
  from that page's own record, never by coincidence with another study."""
  row = next(c for c in claims_lib.CLAIMS if c.experiment == "smlp_vs_moe")
  own = sorted(_claims_tokens("smlp_vs_moe"), key=len)[-1]
  assert own in _tokens((RESULTS / "claims.md").read_text()), row.text
  for name, backed in (("smlp_vs_moe", True), ("not_a_study", False)):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "README.md").write_text(f"It ends at {own}.\n")
    assert (_unbacked_in_page(folder / "README.md") == []) == backed, name


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.parent.name)
def test_unrecorded_list_names_only_figures_its_page_still_states(page):
  """A figure a page lost leaves ``docs_unrecorded.json`` too, so that it
  cannot come back unrecorded. (Whether a listed figure is backed is not
  asked: a claims table that changes may back it today, not tomorrow.)"""
  known = collections.Counter(
      json.loads(UNRECORDED.read_text()).get(page.parent.name, []))
  stale = known - collections.Counter(_figures(_prose(page.read_text())))
  assert not stale, (f"tests/docs_unrecorded.json lists for "
                     f"{page.parent.name} figures its page no longer states: "
                     f"{sorted(stale)} (remove them from the list)")


def test_unrecorded_list_names_only_pages_that_exist():
  names = {p.parent.name for p in _pages()}
  unknown = set(json.loads(UNRECORDED.read_text())) - names
  assert not unknown, (f"tests/docs_unrecorded.json names no page of "
                       f"experiments/results/: {sorted(unknown)}")
