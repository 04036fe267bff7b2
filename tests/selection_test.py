"""Equal tuning's shared parts: the search, the carved split, the choice."""
import hashlib
import json
import math
import pathlib

import pytest

from hypermixer_jax.experiment import selection


def test_settings_cross_every_lr_with_every_warmup_share():
  got = selection.settings(1000, (1e-3, 3e-3), (0.02, 0.1))
  assert got == [
      {"lr": 1e-3, "warmup": 20, "warmup_share": 0.02},
      {"lr": 1e-3, "warmup": 100, "warmup_share": 0.1},
      {"lr": 3e-3, "warmup": 20, "warmup_share": 0.02},
      {"lr": 3e-3, "warmup": 100, "warmup_share": 0.1}]
  # At least one warm-up step; the default grid is six settings.
  assert selection.settings(10, (1e-3,), (0.02,))[0]["warmup"] == 1
  assert len(selection.settings(100)) >= 6
  assert selection.headers((1e-3,), (0.1,)) == ["model",
                                                "lr 0.001, warm-up 10%"]


def test_carve_keeps_a_tsv_header_and_every_tenth_row(tmp_path):
  rows = [f"{i}.jpg\t{i % 3}\n" for i in range(25)]
  source = tmp_path / "train.tsv"
  source.write_text("filename\tlabel\n" + "".join(rows))
  split = selection.carve_lines(source, tmp_path, names=("a.tsv", "b.tsv"),
                                header=True)
  a = (tmp_path / "a.tsv").read_text().splitlines(True)
  b = (tmp_path / "b.tsv").read_text().splitlines(True)
  assert a[0] == b[0] == "filename\tlabel\n"
  assert b[1:] == [rows[0], rows[10], rows[20]]
  assert a[1:] == [r for i, r in enumerate(rows) if i % 10]
  assert (split["train"]["documents"], split["validation"]["documents"]) == (
      22, 3)
  assert split["validation"]["sha256"] == hashlib.sha256(
      (tmp_path / "b.tsv").read_bytes()).hexdigest()
  assert "path" not in json.dumps(selection.split_record(split))
  # Deterministic: the same digests again.
  again = selection.carve_lines(source, tmp_path / "x", names=("a.tsv",
                                                               "b.tsv"),
                                header=True)
  assert again["train"]["sha256"] == split["train"]["sha256"]


def test_carving_again_leaves_a_file_being_read_whole(tmp_path):
  """A second process starting the study carves the split again while the
  first trains from it: an unchanged file is not touched, and a changed one
  is replaced whole (a reader of the old file still reads all of it)."""
  source = tmp_path / "docs.jsonl"
  source.write_text("".join(f'{{"i": {i}}}\n' for i in range(30)))
  selection.carve_lines(source, tmp_path / "o")
  train = tmp_path / "o" / "train.jsonl"
  before = train.stat()
  with open(train, encoding="utf-8") as reader:
    selection.carve_lines(source, tmp_path / "o")
    assert (train.stat().st_ino, train.stat().st_mtime_ns) == (
        before.st_ino, before.st_mtime_ns)
    source.write_text("".join(f'{{"j": {i}}}\n' for i in range(40)))
    selection.carve_lines(source, tmp_path / "o")
    assert len(reader.read().splitlines()) == 27       # the old file, whole
  assert len(train.read_text().splitlines()) == 36


def test_carving_too_few_examples_says_so(tmp_path):
  source = tmp_path / "t.jsonl"
  source.write_text("{}\n" * 9)
  with pytest.raises(ValueError, match=r"t.jsonl: 9 examples; .* at least 10"):
    selection.carve_lines(source, tmp_path / "o")


def test_choose_takes_the_best_score_first_on_ties():
  runs = {"m": [{"setting": {"lr": 1}, "s": 0.5},
                {"setting": {"lr": 2}, "s": 0.7},
                {"setting": {"lr": 3}, "s": 0.7}],
          "empty": []}
  score = lambda r: r["s"]
  assert selection.choose(runs, score, higher=True) == {"m": {"lr": 2}}
  assert selection.choose(runs, score, higher=False) == {"m": {"lr": 1}}
  # A score that is not finite is never chosen, whichever way is best (min
  # and max over NaN would keep whatever comes first).
  nan = {"m": [{"setting": {"lr": 0}, "s": float("nan")}] + runs["m"]}
  assert selection.choose(nan, score, higher=True) == {"m": {"lr": 2}}
  assert selection.choose(nan, score, higher=False) == {"m": {"lr": 1}}
  assert selection.choose({"m": nan["m"][:1]}, score, higher=True) == {}
  rows = selection.selection_rows(
      {"m": [dict(r, setting=dict(lr=lr, warmup_share=0.1))
             for r, lr in zip(runs["m"], (1e-3, 3e-3, 1e-2))]},
      {"m": {"lr": 3e-3, "warmup_share": 0.1}}, {"m": "M"},
      lambda r: f"{r['s']:.1f}", (1e-3, 3e-3, 1e-2), (0.1, 0.02))
  assert rows == [["M", "0.5", "not run", "0.7 *", "not run", "0.7",
                   "not run"]]


def test_lean_drops_the_curve_and_keeps_the_step_flops():
  from hypermixer_jax.experiment import runs  # pylint: disable=g-import-not-at-top
  run = {"eval": {"accuracy": 0.5}, "train_curve": {
      "10": {"tflops_per_device": 1.0, "steps_per_sec": 8.0},
      "20": {"tflops_per_device": 2.0, "steps_per_sec": 4.0}}}
  lean = selection.lean(run)
  assert "train_curve" not in lean and lean["eval"] == run["eval"]
  # The last logged interval: 2 TFLOP/s at 4 steps/s.
  assert runs.flops_per_step(lean) == runs.flops_per_step(run) == 0.5e12
  assert "flops_per_step" not in selection.lean({"eval": {}})


def test_carve_by_group_keeps_each_group_on_one_side(tmp_path):
  # Three hypotheses per premise, as in SNLI: every 10th premise is carved
  # whole, so no premise is seen in training and in validation.
  rows = [json.dumps({"premise": f"p{i // 3}", "hypothesis": f"h{i}"}) + "\n"
          for i in range(75)]
  source = tmp_path / "pairs.jsonl"
  source.write_text("".join(rows))
  split = selection.carve_lines(
      source, tmp_path, group=lambda lines: [json.loads(x)["premise"]
                                             for x in lines])
  held = (tmp_path / "validation.jsonl").read_text().splitlines(True)
  kept = (tmp_path / "train.jsonl").read_text().splitlines(True)
  assert held == rows[0:3] + rows[30:33] + rows[60:63]
  assert kept == [r for i, r in enumerate(rows) if (i // 3) % 10]
  assert (split["train"]["documents"], split["validation"]["documents"]) == (
      66, 9)
  # The groups each part holds: 3 of the 25 premises held out.
  assert (split["train"]["groups"], split["validation"]["groups"]) == (22, 3)
  assert "groups" not in selection.carve_lines(source, tmp_path / "plain")[
      "validation"]


def _fake_tune(tmp_path, scores, seeds=(0, 1), reverse=False, report=False,
               tag=None, params=None):
  """``selection.tune`` over two models and two settings with a fake
  trainer: a selection run scores ``scores[(model, lr)]``; every call is
  logged as (model, seed, lr, select)."""
  import argparse  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import experiment  # pylint: disable=g-import-not-at-top
  exp = experiment.Experiment(tmp_path, argparse.Namespace(
      report_only=report))
  calls = []

  def run(model, seed, setting, key, select):
    calls.append((model, seed, setting["lr"], select))
    assert key.startswith("p/tune/" if select else "p/tuned/")
    if select and scores[(model, setting["lr"])] is None:
      # The training loop's message when a run's loss becomes NaN.
      raise FloatingPointError(
          "loss or gradient became NaN/Inf at step 10; "
          f"stopping. Not saved; the latest checkpoint is step 5 in "
          f"{tmp_path}/runs/{key}.")
    return {"eval": {"accuracy": scores[(model, setting["lr"])] if select
                     else seed / 10},
            **({"params": params[model]} if params else {})}
  out = selection.tune(exp, ["a", "b"], seeds,
                       selection.settings(10, (1e-3, 3e-3), (0.1,)), "p/",
                       run, lambda r: r["eval"]["accuracy"], higher=True,
                       reverse=reverse, tag=tag, fields=params and (
                           lambda m: {"params": params[m]}))
  return out, calls


def test_tune_searches_every_model_alike_then_trains_seeds_at_its_choice(
    tmp_path):
  scores = {("a", 1e-3): 0.7, ("a", 3e-3): 0.6,
            ("b", 1e-3): 0.5, ("b", 3e-3): 0.8}
  (searched, chosen, runs), calls = _fake_tune(tmp_path, scores)
  # The search: every model at every setting, with the selection seed only.
  assert [c for c in calls if c[3]] == [
      ("a", selection.SEED, 1e-3, True), ("a", selection.SEED, 3e-3, True),
      ("b", selection.SEED, 1e-3, True), ("b", selection.SEED, 3e-3, True)]
  assert {m: c["lr"] for m, c in chosen.items()} == {"a": 1e-3, "b": 3e-3}
  # The reported seeds only at each model's choice, recorded with it.
  assert [c for c in calls if not c[3]] == [
      ("a", 0, 1e-3, False), ("a", 1, 1e-3, False),
      ("b", 0, 3e-3, False), ("b", 1, 3e-3, False)]
  assert [r["setting"]["lr"] for r in runs["b"]] == [3e-3, 3e-3]
  assert [r["setting"]["lr"] for r in searched["a"]] == [1e-3, 3e-3]
  # Each record holds its own seed (the command's seeds are the reported
  # runs' only).
  assert {r["seed"] for r in searched["a"]} == {selection.SEED}
  assert [r["seed"] for r in runs["b"]] == [0, 1]
  # A second call finds everything recorded and trains nothing.
  _, again = _fake_tune(tmp_path, scores)
  assert again == []


def test_tune_reruns_the_seeds_of_a_choice_that_moved(tmp_path):
  scores = {("a", 1e-3): 0.7, ("a", 3e-3): 0.6,
            ("b", 1e-3): 0.5, ("b", 3e-3): 0.8}
  _fake_tune(tmp_path, scores)
  # Model a's recorded search now says 3e-3 (as if the first score had been
  # wrong): its seeds were trained at 1e-3, so they are retired and rerun.
  data = json.loads((tmp_path / "results.json").read_text())
  data["runs"]["p/tune/model=a/setting=1"]["eval"]["accuracy"] = 0.9
  (tmp_path / "results.json").write_text(json.dumps(data))
  (_, chosen, runs), calls = _fake_tune(tmp_path, scores)
  assert chosen["a"]["lr"] == 3e-3
  assert calls == [("a", 0, 3e-3, False), ("a", 1, 3e-3, False)]
  assert [r["setting"]["lr"] for r in runs["a"]] == [3e-3, 3e-3]
  data = json.loads((tmp_path / "results.json").read_text())
  assert data["superseded"]["p/tuned/model=a/seed=0"]["setting"]["lr"] == 1e-3


def test_tune_retires_the_runs_of_a_model_whose_size_changed(tmp_path):
  """``fields``: what a model's records must hold (its parameter count): a
  model of another width has its search and seeds run again; a diverged
  search run holds it too (stamped), so it is not retired each time."""
  scores = {("a", 1e-3): 0.7, ("a", 3e-3): None,
            ("b", 1e-3): 0.5, ("b", 3e-3): 0.8}
  _fake_tune(tmp_path, scores, params={"a": 10, "b": 20})
  _, again = _fake_tune(tmp_path, scores, params={"a": 10, "b": 20})
  assert again == []
  _, calls = _fake_tune(tmp_path, scores, params={"a": 10, "b": 24})
  assert calls == [("b", selection.SEED, 1e-3, True),
                   ("b", selection.SEED, 3e-3, True),
                   ("b", 0, 3e-3, False), ("b", 1, 3e-3, False)]


def test_tune_chooses_nothing_before_a_search_is_complete(tmp_path):
  scores = {("a", 1e-3): 0.7, ("a", 3e-3): 0.6,
            ("b", 1e-3): 0.5, ("b", 3e-3): 0.8}
  _fake_tune(tmp_path, scores)
  data = json.loads((tmp_path / "results.json").read_text())
  del data["runs"]["p/tune/model=b/setting=0"]
  (tmp_path / "results.json").write_text(json.dumps(data))
  # A report trains nothing: b's search is one run short, so b has no
  # choice and none of its seeds is reported.
  (searched, chosen, runs), calls = _fake_tune(tmp_path, scores, report=True)
  assert calls == [] and set(chosen) == {"a"} and set(runs) == {"a"}
  assert len(searched["b"]) == 1
  # Run backwards (a second process), the missing cell is trained first.
  (searched, _, runs), calls = _fake_tune(tmp_path, scores, reverse=True)
  assert calls[0] == ("b", selection.SEED, 1e-3, True)
  # Whichever process reports, the models come in their given order.
  assert list(searched) == list(runs) == ["a", "b"]


def test_a_choice_at_the_edge_of_the_rates_is_named():
  """A best rate that is the highest or lowest searched may not be the best
  there is: the search section names it; an inner choice, or a grid of one
  rate, gets no note."""
  lrs = (1e-4, 1e-3, 1e-2)
  labels = {"a": "A", "b": "B", "c": "C"}
  chosen = {"a": {"lr": 1e-2, "warmup_share": 0.1},
            "b": {"lr": 1e-3, "warmup_share": 0.1},
            "c": {"lr": 1e-4, "warmup_share": 0.02}}
  assert selection.at_edge(chosen, labels, lrs) == ["A (lr 0.01)",
                                                    "C (lr 0.0001)"]
  assert selection.at_edge({"b": chosen["b"]}, labels, lrs) == []
  assert selection.at_edge(chosen, labels, (1e-3,)) == []
  text = selection.search_section({}, {"a": chosen["a"], "b": None}, labels,
                                  lrs)
  assert text.endswith("a better one): A (lr 0.01).")
  assert "edge" not in selection.search_section({}, {"b": chosen["b"]},
                                                labels, lrs)


def test_a_diverged_setting_is_recorded_and_never_chosen(tmp_path):
  """A setting whose loss became NaN does not stop the search: it is
  recorded as diverged (the steps, no machine path), shown so in the
  search table and passed over, and a rerun does not train it again; a
  model whose every setting diverged gets no choice and no seeds."""
  scores = {("a", 1e-3): 0.6, ("a", 3e-3): None,
            ("b", 1e-3): None, ("b", 3e-3): None}
  (searched, chosen, runs), calls = _fake_tune(tmp_path, scores)
  assert chosen == {"a": {"lr": 1e-3, "warmup": 1, "warmup_share": 0.1}}
  assert set(runs) == {"a"} and len(calls) == 4 + 2
  assert searched["a"][1][selection.DIVERGED] == (
      "loss or gradient became NaN/Inf at step 10")
  assert str(tmp_path) not in (tmp_path / "results.json").read_text()
  table = selection.search_section(searched, chosen, {"a": "A", "b": "B"},
                                   (1e-3, 3e-3), shares=(0.1,))
  assert "| A | 60.00 * | diverged |" in table
  assert "| B | diverged | diverged |" in table
  _, again = _fake_tune(tmp_path, scores)
  assert again == []


def test_runs_of_another_carve_are_retired_and_run_again(tmp_path):
  """``tag`` (the carved split's digest): every run records it, and a
  recorded run holding another (or none) is retired, not reused."""
  scores = {("a", 1e-3): 0.7, ("a", 3e-3): 0.6,
            ("b", 1e-3): 0.5, ("b", 3e-3): 0.8}
  _fake_tune(tmp_path, scores)
  (_, _, runs), calls = _fake_tune(tmp_path, scores, tag={"split": "new"})
  assert len(calls) == 4 + 4   # the whole search and every seed again
  assert all(r["split"] == "new" for rs in runs.values() for r in rs)
  data = json.loads((tmp_path / "results.json").read_text())
  assert "split" not in data["superseded"]["p/tune/model=a/setting=0"]
  assert _fake_tune(tmp_path, scores, tag={"split": "new"})[1] == []


def test_a_reordered_grid_is_refused_before_it_retires_the_search(
    tmp_path):
  """Search cells are keyed by their index in the grid: a grid given in
  another order would put other settings at recorded indices. It stops
  with the recorded order instead of retiring and retraining them; new
  values at the end run, and a search of another tag is retired."""
  import argparse  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import experiment  # pylint: disable=g-import-not-at-top
  scores = {(m, lr): 0.5 for m in "ab" for lr in (1e-3, 3e-3, 1e-2)}
  _fake_tune(tmp_path, scores)
  exp = experiment.Experiment(tmp_path, argparse.Namespace(report_only=False))
  calls = []

  def tune(lrs, tag=None):
    return selection.tune(
        exp, ["a", "b"], (0,), selection.settings(10, lrs, (0.1,)), "p/",
        lambda *a: calls.append(a) or {"eval": {"accuracy": 0.5}},
        lambda r: r["eval"]["accuracy"], higher=True, tag=tag)
  with pytest.raises(SystemExit, match=(
      r"--tune: p/tune/model=a/setting=0 is recorded at lr 0.001, warm-up "
      r"share 0.1, but this grid has lr 0.003, share 0.1 there; the "
      r"recorded search has lrs 0.001,0.003 \(in this order\) x warm-up "
      r"shares 0.1: pass those learning rates, new ones at the end")):
    tune((3e-3, 1e-3))
  assert not calls and "superseded" not in json.loads(
      (tmp_path / "results.json").read_text())
  tune((1e-3, 3e-3, 1e-2))   # appended: only the new setting runs
  assert [(c[0], c[2]["lr"]) for c in calls if c[4]] == [("a", 1e-2),
                                                         ("b", 1e-2)]
  # A grid short of the recorded one (a choice from part of the search):
  # the message names the whole recorded grid, past the grid asked for.
  with pytest.raises(SystemExit, match=(
      r"setting=2 is recorded at lr 0.01, warm-up share 0.1, but this grid "
      r"stops at 2 settings; the recorded search has lrs 0.001,0.003,0.01 ")):
    tune((1e-3, 3e-3))
  with pytest.raises(SystemExit, match=r"has lrs 0.001,0.003,0.01 \("):
    tune((3e-3,))
  calls.clear()
  tune((3e-3, 1e-3), tag={"split": "new"})   # another carve: all again
  assert len([c for c in calls if c[4]]) == 4


def test_the_length_rule_waits_on_a_shorter_length_not_yet_run():
  """The shortest length meeting the rule; a shorter length that a model
  not yet run could still decide comes first, so nothing longer is
  picked (no "confirmed" from a half-run check)."""
  full = {50: {"a": 30.0, "b": 5.0}, 100: {"a": 5.0, "b": 5.0}}
  assert selection.shortest_length(full, 20.0, ["a", "b"]) == 100
  # 50 steps: b not run, a below the bar: b could make 50 the pick.
  half = {50: {"a": 5.0}, 100: {"a": 5.0, "b": 5.0}}
  assert selection.shortest_length(half, 20.0, ["a", "b"]) is None
  # ... but a model above the bar already fails 50 steps.
  assert selection.shortest_length({**half, 50: {"a": 30.0}}, 20.0,
                                   ["a", "b"]) == 100
  # The best above the bar: one recorded model above it is enough.
  acc = {50: {"a": 0.9}, 100: {"a": 0.9, "b": 0.7}}
  assert selection.shortest_length(acc, 0.8, ["a", "b"],
                                   best_above=True) == 50
  acc[50] = {"a": 0.5}
  assert selection.shortest_length(acc, 0.8, ["a", "b"],
                                   best_above=True) is None
  acc[50]["b"] = -math.inf   # diverged: never the best
  assert selection.shortest_length(acc, 0.8, ["a", "b"],
                                   best_above=True) == 100
  section = selection.length_section(acc, 0.8, "bar", ["a", "b"], 100,
                                     {"a": "A", "b": "B"}, best_above=True)
  assert "| B | diverged | 0.7 |" in section
  assert "the rule picks 100 steps, the length used: confirmed" in section
  # Only the length used: the rule holds there, but nothing is confirmed.
  only = selection.length_section({100: acc[100]}, 0.8, "bar", ["a", "b"],
                                  100, {"a": "A", "b": "B"}, best_above=True)
  assert "no shorter length was tried, so it is not confirmed" in only


def test_a_length_check_scores_a_score_that_is_not_finite_as_the_worst(
    tmp_path):
  """A run whose score is NaN (not marked diverged) is the worst, as a
  diverged one: below any bar, never the best above it."""
  import argparse  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import experiment  # pylint: disable=g-import-not-at-top
  exp = experiment.Experiment(tmp_path, argparse.Namespace(
      report_only=False))
  setting = {"lr": 1e-3, "warmup_share": 0.1}
  searched = {m: [{"setting": setting, "score": v}]
              for m, v in (("a", math.nan), ("b", math.inf), ("c", 2.0),
                           ("d", None))}
  searched["d"] = [{"setting": setting, selection.DIVERGED: "step 3"}]
  chosen = {m: setting for m in searched}
  for higher, worst in ((False, math.inf), (True, -math.inf)):
    out = selection.length_check(
        exp, "p/", searched, chosen, [10], 10, None, lambda r: r["score"],
        higher=higher)
    assert out == {10: {"a": worst, "b": worst if higher else math.inf,
                        "c": 2.0, "d": worst}}
  # A NaN at the shorter length does not pass the rule there either.
  for bad in (math.nan, math.inf):
    assert selection.shortest_length(
        {5: {"a": bad, "b": 3.0}, 10: {"a": 2.0, "b": 2.0}}, 5.0,
        ["a", "b"]) == 10
  assert selection.shortest_length(
      {5: {"a": math.nan}, 10: {"a": 0.9}}, 0.8, ["a"], best_above=True) == 10


def test_a_length_record_is_confirmed_for_its_choices_only(tmp_path):
  """``record_length``: confirmed only where the rule picked the length
  used, a shorter one was tried and the models asked for were judged; a
  later search whose choice moved, or of another carve, retires it."""
  scores = {("a", 1e-3): 0.7, ("a", 3e-3): 0.6,
            ("b", 1e-3): 0.5, ("b", 3e-3): 0.8}
  (_, chosen, _), _ = _fake_tune(tmp_path, scores)
  import argparse  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import experiment  # pylint: disable=g-import-not-at-top
  exp = experiment.Experiment(tmp_path, argparse.Namespace(
      report_only=False))
  selection.record_length(exp, "p/", 10, 10, {5: {}, 10: {}}, chosen)
  assert selection.length_confirmed(exp.data, "p/", 10, ["a", "b"])
  assert not selection.length_confirmed(exp.data, "p/", 10, ["a", "c"])
  assert not selection.length_confirmed(exp.data, "p/", 5)
  selection.record_length(exp, "p/", 10, 10, {10: {}}, chosen)
  assert not selection.length_confirmed(exp.data, "p/", 10)
  selection.record_length(exp, "p/", 10, 10, {5: {}, 10: {}}, chosen)
  # The same search again: kept.
  _fake_tune(tmp_path, scores)
  data = json.loads((tmp_path / "results.json").read_text())
  assert selection.length_confirmed(data, "p/", 10, ["a", "b"])
  # a's choice moves: the record is retired.
  data["runs"]["p/tune/model=a/setting=1"]["eval"]["accuracy"] = 0.9
  (tmp_path / "results.json").write_text(json.dumps(data))
  _fake_tune(tmp_path, scores)
  data = json.loads((tmp_path / "results.json").read_text())
  assert "p/" not in data.get("length_checks", {})
  # Another carve (tag) retires it too.
  exp = experiment.Experiment(tmp_path, argparse.Namespace(
      report_only=False))
  selection.record_length(exp, "p/", 10, 10, {5: {}, 10: {}}, chosen)
  _fake_tune(tmp_path, scores, tag={"split": "new"})
  data = json.loads((tmp_path / "results.json").read_text())
  assert "p/" not in data.get("length_checks", {})


def _sst2(path, phrases):
  path.write_text("sentence\tlabel\n" + "".join(
      f"{p} \t{i % 2}\n" for i, p in enumerate(phrases)))
  return str(path)


def test_sst2_phrases_are_grouped_by_their_sentence(tmp_path):
  """A phrase's sentence is the longest train phrase that holds it as whole
  tokens, the first of equal length; a subset is grouped by the whole
  file's sentences; carved by it, no sentence has phrases on both sides."""
  from hypermixer_jax.experiment import glue  # pylint: disable=g-import-not-at-top
  phrases = ["the cat", "sat on", "the cat sat on the mat", "a dog",
             "a dog barked", "cat sat", "the dog", "barked", "at", "c"]
  source = _sst2(tmp_path / "train.tsv", phrases)
  rows = pathlib.Path(source).read_text().splitlines(True)[1:]
  keys = glue.sentence_groups(source)(rows)
  cat, dog = "the cat sat on the mat", "a dog barked"
  # "at" is inside "sat" only as characters, not as a token: its own group.
  assert keys == [cat, cat, cat, dog, dog, cat, "the dog", dog, "at", "c"]
  # A row the reference lacks is its own group.
  assert glue.sentence_groups(source)(["a cat \t1\n"]) == ["a cat \t1"]
  sub = rows[0:1] + rows[4:5]   # a subset: grouped as in the whole file
  assert glue.sentence_groups(source)(sub) == [cat, dog]
  split = selection.carve_lines(source, tmp_path / "out", header=True,
                                group=glue.sentence_groups(source))
  held = pathlib.Path(split["validation"]["path"]).read_text()
  assert held == "sentence\tlabel\n" + "".join(
      rows[i] for i in (0, 1, 2, 5))   # the first sentence, whole


def test_the_sst2_train_file_groups_into_its_sentences(shared_data,
                                                       tmp_path):
  """On the real file: about 6.9k sentences (SST-2's binary train set has
  6,920). Carved by sentence, no held-out phrase's sentence has a phrase
  trained on; carved by phrase, nearly every one has."""
  from hypermixer_jax.experiment import glue  # pylint: disable=g-import-not-at-top
  source = glue.sst2_train(shared_data)
  group = glue.sentence_groups(source)

  def shared_sentences(by):
    split = selection.carve_lines(source, tmp_path / str(by), header=True,
                                  group=by)
    held, kept = (set(group(pathlib.Path(split[k]["path"]).read_text(
        encoding="utf-8").splitlines(True)[1:]))
                  for k in ("validation", "train"))
    return len(held & kept) / len(held), len(held)
  assert shared_sentences(group) == (0.0, pytest.approx(689, abs=2))
  by_row = shared_sentences(None)[0]
  assert by_row > 0.9
  # What the record says of it: the same share, over the same sentences.
  overlap = glue.sentence_overlap(source, group)
  assert overlap["sentences"] == len(set(group(pathlib.Path(
      source).read_text(encoding="utf-8").splitlines(True)[1:])))
  assert overlap["row_carve_shares_sentence"] == pytest.approx(by_row, abs=0.01)
