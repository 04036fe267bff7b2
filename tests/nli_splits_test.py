"""experiments/nli_splits.py: the fixed 80/20 cut of a dev file."""
import pathlib
import sys

from hypermixer_jax import experiment

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent
                       / "experiments"))
import nli_splits  # noqa: E402  pylint: disable=g-import-not-at-top


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  return str(path)


def test_tsv_cut_is_a_fixed_partition_with_header(tmp_path):
  rows = [f"{i}\tq{i}?\ts{i}.\tentailment" for i in range(50)]
  src = _write(tmp_path / "dev.tsv", ["index\tquestion\tsentence\tlabel"]
               + rows)
  a = nli_splits.split_file(src, tmp_path / "a", "qnli")
  b = nli_splits.split_file(src, tmp_path / "b", "qnli")
  train = pathlib.Path(a["train"]).read_text().splitlines()
  test = pathlib.Path(a["test"]).read_text().splitlines()
  assert train[0] == test[0] == "index\tquestion\tsentence\tlabel"
  assert len(test) - 1 == 10 and len(train) - 1 == 40
  assert a["rows"] == {"test": 10, "train": 40}
  # A partition of the rows, in file order, the same cut every time.
  assert sorted(train[1:] + test[1:]) == sorted(rows)
  assert train[1:] == [r for r in rows if r in set(train[1:])]
  assert a["sha256"] == b["sha256"]
  assert a["sha256"]["test"] == experiment.file_digest(a["test"])
  assert a["source_sha256"] == experiment.file_digest(src)


def test_jsonl_cut_has_no_header_and_keeps_written_files(tmp_path):
  rows = [f'{{"premise": "p{i}", "hypothesis": "h{i}", "label": "neutral"}}'
          for i in range(21)]
  src = _write(tmp_path / "dev.jsonl", rows)
  a = nli_splits.split_file(src, tmp_path, "snli")
  test = pathlib.Path(a["test"]).read_text().splitlines()
  assert len(test) == 4 and a["rows"]["train"] == 17
  assert set(test) <= set(rows)
  # A second call reads the files it wrote instead of rewriting them.
  before = pathlib.Path(a["train"]).stat().st_mtime_ns
  assert nli_splits.split_file(src, tmp_path, "snli")["sha256"] == a["sha256"]
  assert pathlib.Path(a["train"]).stat().st_mtime_ns == before
