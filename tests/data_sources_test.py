"""Local sources: files interleave as blocks of raw lines, parsed after."""
import json

import pytest
import seqio
import tensorflow as tf

from hypermixer_jax.data import sources


def _files(tmp_path, num_files, rows):
  paths = []
  for f in range(num_files):
    path = tmp_path / f"part-{f}.jsonl"
    path.write_text("".join(json.dumps({"text": f"f{f} r{r} \u00e9\\"}) + "\n"
                            for r in range(rows[f])), encoding="utf-8")
    paths.append(str(path))
  return paths


def _rows(source, **kw):
  return [(ex["text"].decode(), ex["source"].decode()) for ex in
          source.get_dataset("train", **kw).as_numpy_iterator()]


def test_files_interleave_in_blocks_in_order(tmp_path):
  """Unshuffled: 4 files at a time, runs of LINES_PER_BLOCK consecutive rows
  of one file (shorter only where the file ends), each file's rows in order,
  every row once, parsed and named by its own file and line."""
  block = sources.LINES_PER_BLOCK
  rows = [2 * block + 3, block, 3 * block, 5, 2 * block]
  paths = _files(tmp_path, 5, rows)
  source = sources.local_source(
      {"train": ",".join(paths)},
      sources.local_reader("jsonl", {"text": ("text",)}))
  got = _rows(source, shuffle=False)
  where = [(paths.index(w.rsplit(":", 1)[0]), int(w.rsplit(":", 1)[1]))
           for _, w in got]
  assert sorted(where) == [(f, r + 1) for f in range(5)
                           for r in range(rows[f])]
  for (text, _), (f, line) in zip(got, where):
    assert text == f"f{f} r{line - 1} \u00e9\\"
  runs = []  # (file, first line, length)
  for f, line in where:
    if runs and runs[-1][0] == f and runs[-1][1] + runs[-1][2] == line:
      runs[-1][2] += 1
    else:
      runs.append([f, line, 1])
  for f, first, length in runs:
    assert (first - 1) % block == 0
    assert length == min(block, rows[f] - first + 1)
  assert [r[0] for r in runs[:4]] == [0, 1, 2, 3]   # 4 files in the cycle
  assert 4 in [r[0] for r in runs[4:8]]             # the fifth takes a slot


def test_shuffled_files_and_hosts(tmp_path):
  paths = _files(tmp_path, 4, [20, 20, 20, 20])
  source = sources.local_source(
      {"train": ",".join(paths)},
      sources.local_reader("jsonl", {"text": ("text",)}))
  everything = sorted(_rows(source, shuffle=False))
  shuffled = _rows(source, shuffle=True, seed=3)
  assert sorted(shuffled) == everything
  assert _rows(source, shuffle=True, seed=3) == shuffled   # a new dataset
  hosts = [_rows(source, shuffle=True, seed=3,
                 shard_info=seqio.ShardInfo(i, 2)) for i in range(2)]
  files = [{w.rsplit(":", 1)[0] for _, w in h} for h in hosts]
  assert not files[0] & files[1] and len(files[0]) == len(files[1]) == 2
  assert sorted(hosts[0] + hosts[1]) == everything
  # Files that do not divide among the hosts (4 among 3, or 8): every host
  # reads them all and keeps its share of the examples, so that each is
  # read once and the shares differ by at most one example.
  for n in (3, 8):
    hosts = [_rows(source, shuffle=True, seed=3,
                   shard_info=seqio.ShardInfo(i, n)) for i in range(n)]
    assert sorted(sum(hosts, [])) == everything, n
    assert max(map(len, hosts)) - min(map(len, hosts)) <= 1, n


def _error_of(source):
  try:
    list(source.get_dataset("train", shuffle=False).as_numpy_iterator())
  except tf.errors.OpError as e:
    return sources.data_error_from(e)
  return None


def test_a_block_names_its_first_bad_row(tmp_path):
  """Rows are parsed LINES_PER_BLOCK at a time: a block with two bad rows
  names the first; blank lines (a whole block of them too) are dropped."""
  block = sources.LINES_PER_BLOCK
  lines = [json.dumps({"text": f"r{i}"}) for i in range(3 * block)]
  lines[block + 2] = json.dumps({"other": 1})      # line block + 3
  lines[block + 9] = json.dumps({"other": 2})      # same block, later
  path = tmp_path / "bad.jsonl"
  path.write_text("\n".join(lines) + "\n", encoding="utf-8")
  source = sources.local_source(
      {"train": str(path)}, sources.local_reader("jsonl", {"text": ("text",)}))
  error = _error_of(source)
  assert error is not None
  assert str(error).startswith(f"{path}:{block + 3}: no field 'text'")
  good = ["\n"] * (block + 3) + [json.dumps({"text": "a"}) + "\n", "  \n",
                                 json.dumps({"text": "b"}) + "\n"]
  path.write_text("".join(good), encoding="utf-8")
  assert _rows(source, shuffle=False) == [("a", f"{path}:{block + 4}"),
                                          ("b", f"{path}:{block + 6}")]


def test_tsv_block_names_the_row_with_wrong_fields(tmp_path):
  block = sources.LINES_PER_BLOCK
  rows = [f"s{i}\t{i % 2}" for i in range(2 * block)]
  rows[block + 5] = "only one field"
  path = tmp_path / "t.tsv"
  path.write_text("sentence\tlabel\n" + "\n".join(rows) + "\n",
                  encoding="utf-8")
  source = sources.local_source(
      {"train": str(path)},
      sources.local_reader("tsv", {"text_a": ("sentence",),
                                   "label": ("label",)}, ("neg", "pos")))
  error = _error_of(source)
  # header is line 1, rows[i] is line i + 2
  assert str(error) == (f"{path}:{block + 7}: the row has 1 tab-separated "
                        "fields, the header has 2.")
