"""The experiment harness and the GLUE experiments' own arithmetic."""
import argparse
import contextlib
import functools
import io
import itertools
import json
import os
import time
import pathlib
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
import jax
import numpy as np
import pytest

from hypermixer_jax import experiment
from hypermixer_jax.experiment import glue
from hypermixer_jax.experiment import records
from hypermixer_jax.experiment import selection
from hypermixer_jax.experiment import tuning

import script_modules

low_resource = script_modules.load("experiments/low_resource.py")
tuning_cost = script_modules.load("experiments/tuning_cost.py")


SHARED = experiment.default_shared_dir()
HAS_SST2 = (SHARED / "glue/SST-2/train.tsv").exists()
SKIP_SST2 = (f"needs the SST-2 sample in {SHARED} (set HYPERMIXER_SHARED_DATA "
             "to the shared data folder)")


class HarnessTest(absltest.TestCase):

  def test_markdown_table(self):
    table = experiment.markdown_table(["a", "b"], [[1, 0.123456], ["x", "y"]])
    self.assertEqual(table.splitlines(),
                     ["| a | b |", "| --- | --- |", "| 1 | 0.1235 |",
                      "| x | y |"])

  def test_runs_are_recorded_and_skipped_on_restart(self):
    out = tempfile.mkdtemp()
    calls = []
    exp = experiment.Experiment(out)
    first = exp.run("a/b", lambda: calls.append(1) or {"eval": {"acc": 0.5}})
    self.assertEqual(first["eval"], {"acc": 0.5})
    self.assertIn("wall_s", first)
    self.assertEqual(first["ran_on"], f"{jax.devices()[0].platform}: "
                     f"{jax.devices()[0].device_kind}")
    with jax.default_matmul_precision("highest"):  # a GPU run would use TF32
      self.assertTrue(exp.run("p", dict)["ran_on"].endswith(
          " (matmul precision highest)"))
    # A new process on the same directory reads the result back.
    again = experiment.Experiment(out)
    again.run("a/b", lambda: calls.append(2) or {})
    self.assertEqual(calls, [1])
    exp.write_table("T", "| x |", "note")
    text = (pathlib.Path(out) / "table.md").read_text()
    self.assertEqual(text, "## T\n\n| x |\n\nnote\n")
    saved = json.loads((pathlib.Path(out) / "results.json").read_text())
    self.assertEqual(saved["runs"]["a/b"]["eval"], {"acc": 0.5})

  def test_where_ran_names_each_device_and_its_groups(self):
    cpu, gpu = {}, {"ran_on": "gpu: NVIDIA H200 (matmul precision highest)"}
    self.assertEqual(experiment.where_ran({"a": [cpu], "b": [cpu]}, " "), "")
    self.assertEqual(experiment.where_ran({"a": [gpu]}, end=" "),
                     f"Ran on: {gpu['ran_on']} (a). ")
    groups = {"n=5": [cpu], "n=50": [gpu, cpu], "n=500": [gpu]}
    self.assertEqual(
        experiment.where_ran(groups),
        "Ran on: cpu: cpu (n=5, n=50); gpu: NVIDIA H200 (matmul precision "
        "highest) (n=50, n=500).")

  def test_processes_sharing_a_directory_keep_each_others_runs(self):
    out = tempfile.mkdtemp()
    a, b = experiment.Experiment(out), experiment.Experiment(out)
    a.run("x", lambda: {"v": 1})
    b.run("y", lambda: {"v": 2})           # b's copy predates "x"
    self.assertEqual(b.run("x", lambda: {"v": 99}), a.runs["x"])
    self.assertEqual(a.runs["x"]["v"], 1)
    a.save()
    on_disk = json.loads((pathlib.Path(out) / "results.json").read_text())
    self.assertEqual(sorted(on_disk["runs"]), ["x", "y"])

  def test_a_stale_copy_never_writes_over_another_processes_records(self):
    """Two processes load the same record. One retires a run and records it
    again (a new split), computes a baseline and saves a field; the other,
    still holding the old copy, records its own run, baseline and field.
    Every save keeps the other's work: nothing of either is lost, and the
    old copy does not come back."""
    out = pathlib.Path(tempfile.mkdtemp())
    first = experiment.Experiment(out)
    first.run("k", lambda: {"v": "old"})
    a, b = experiment.Experiment(out), experiment.Experiment(out)
    a.supersede("k", "another split")
    a.run("k", lambda: {"v": "new"})
    a.baseline("nb/a", lambda: {"acc": 0.5})
    a.save(sizes={"width": 8})
    self.assertEqual(b.runs["k"]["v"], "old")   # b's copy is stale
    b.run("j", lambda: {"v": "b's"})
    b.baseline("nb/b", lambda: {"acc": 0.6})
    b.save(vocab={"pieces": 8})
    a.save()
    for exp in (a, b, experiment.Experiment(out)):
      exp.reload()
      self.assertEqual(exp.runs["k"]["v"], "new")
      self.assertEqual(exp.runs["j"]["v"], "b's")
      self.assertEqual(exp.data["superseded"]["k"]["v"], "old")
      self.assertEqual(sorted(exp.data["baselines"]), ["nb/a", "nb/b"])
      self.assertEqual((exp.data["sizes"], exp.data["vocab"]),
                       ({"width": 8}, {"pieces": 8}))
    # A field's dict held by the caller stays the record's across saves.
    splits = b.data.setdefault("splits", {})
    splits["mnli"] = 1
    b.save()
    splits["snli"] = 2
    b.save()
    self.assertEqual(experiment.Experiment(out).data["splits"],
                     {"mnli": 1, "snli": 2})
    # A run this process retired stays retired when it saves again.
    b.supersede("j", "checked")
    b.save()
    a.save()
    on_disk = json.loads((out / "results.json").read_text())
    self.assertNotIn("j", on_disk["runs"])
    self.assertEqual(sorted(on_disk["superseded"]), ["j", "k"])

  def test_per_model_fields_keep_each_processes_entries(self):
    """``plan``, ``sizes`` and ``length_checks`` are built from a process's
    own (possibly stale) copy: merged entry by entry, one process's save
    keeps the other's entries and its removals; a list stays a value."""
    out = pathlib.Path(tempfile.mkdtemp())
    a, b = experiment.Experiment(out), experiment.Experiment(out)
    for field in ("plan", "sizes", "length_checks"):
      a.save(**{field: {**a.data.get(field, {}), "gmlp": {"depth": 2}}})
      b.save(**{field: {**b.data.get(field, {}), "switch": {"depth": 3}}})
    on_disk = json.loads((out / "results.json").read_text())
    for field in ("plan", "sizes", "length_checks"):
      self.assertEqual(sorted(on_disk[field]), ["gmlp", "switch"], field)
    a.reload()
    a.save(length_checks={k: v for k, v in a.data["length_checks"].items()
                          if k != "gmlp"})   # retired by a
    b.save(sizes={**b.data["sizes"], "fnet": {"depth": 1}})
    on_disk = json.loads((out / "results.json").read_text())
    self.assertEqual(sorted(on_disk["length_checks"]), ["switch"])
    self.assertEqual(sorted(on_disk["sizes"]), ["fnet", "gmlp", "switch"])
    other = pathlib.Path(tempfile.mkdtemp())   # synthetic's list of sizes
    c, d = experiment.Experiment(other), experiment.Experiment(other)
    c.save(sizes=[500, 5000])
    d.save(sizes=[50])
    c.reload()
    self.assertEqual(c.data["sizes"], [50])

  def test_a_dead_processes_claim_is_taken_over(self):
    out = tempfile.mkdtemp()
    exp = experiment.Experiment(out)
    claims = pathlib.Path(out) / "claims"
    claims.mkdir()
    # A PID that cannot be alive (above the kernel's maximum).
    (claims / "a__b.pid").write_text("4194400")
    self.assertEqual(exp.run("a/b", lambda: {"v": 3})["v"], 3)

  def test_a_claim_taken_over_by_another_process_is_left_to_it(self):
    # Two processes saw the same dead PID; the first took the claim over
    # and wrote its own before the second acted on what it had read.
    out = pathlib.Path(tempfile.mkdtemp())
    exp = experiment.Experiment(out)
    (out / "claims").mkdir()
    claim = out / "claims" / "a__b.pid"
    claim.write_text(str(os.getppid()))           # the first's, alive
    exp._take_over(claim, 4194400)
    self.assertEqual(claim.read_text(), str(os.getppid()))
    claim.write_text("")                          # being written: kept too
    exp._take_over(claim, 4194400)
    self.assertTrue(claim.exists())
    exp._take_over(claim, 0)                      # even if seen empty before
    self.assertTrue(claim.exists())
    os.utime(claim, (time.time() - 120,) * 2)     # empty and old: stale
    exp._take_over(claim, 0)
    self.assertFalse(claim.exists())
    claim.write_text("")
    claim.write_text("4194400")                   # still the dead one's
    exp._take_over(claim, 4194400)
    self.assertFalse(claim.exists())

  def test_claims_go_once_recorded_and_a_claim_being_written_is_held(self):
    out = pathlib.Path(tempfile.mkdtemp())
    exp, other = experiment.Experiment(out), experiment.Experiment(out)
    exp.run("a/b", lambda: {"v": 1})
    self.assertEqual(list((out / "claims").iterdir()), [])
    # Another process has created its claim and not yet written its PID.
    (out / "claims" / "c.pid").write_text("")

    def meanwhile(_):   # that process records the cell
      other.runs["c"] = {"v": "other's"}
      other.save()
      (out / "claims" / "c.pid").unlink()
    with mock.patch.object(records.time, "sleep", meanwhile):
      got = exp.run("c", lambda: {"v": "taken over"})
    self.assertEqual(got["v"], "other's")

  def test_a_cell_another_process_runs_waits_behind_the_free_ones(self):
    out = pathlib.Path(tempfile.mkdtemp())
    exp = experiment.Experiment(out)
    (out / "claims").mkdir()
    claim = lambda seed: out / "claims" / f"p__model=a__seed={seed}.pid"  # noqa: E731
    # Seed 0 is claimed by another live process (this one's parent), and
    # seed 2 while this process runs seed 1.
    claim(0).write_text(str(os.getppid()))
    other = experiment.Experiment(out)
    ran = []

    def fn(c, key):
      ran.append(key)
      if c["seed"] == 1:
        claim(2).write_text(str(os.getppid()))
      if c["seed"] == 3:   # meanwhile the other process records its cells
        for seed in (0, 2):
          other.runs[f"p/model=a/seed={seed}"] = {"seed": seed, "by": "other"}
          claim(seed).unlink()
        other.save()
      return {"seed": c["seed"]}
    got = exp.cells("p", experiment.grid(model=("a",), seed=range(4)), fn)
    self.assertEqual(ran, ["p/model=a/seed=1", "p/model=a/seed=3"])
    self.assertEqual([r["seed"] for r in got["a"]], [0, 1, 2, 3])  # grid order
    self.assertEqual([r.get("by") for r in got["a"]],
                     ["other", None, "other", None])

  def test_a_cell_another_process_recorded_at_another_setting_stops(self):
    """A result this process waited for, recorded by another process whose
    command expects another setting, is never mixed into these seeds."""
    out = pathlib.Path(tempfile.mkdtemp())
    exp, other = experiment.Experiment(out), experiment.Experiment(out)
    (out / "claims").mkdir()
    claim = out / "claims" / "p__model=a__seed=0.pid"
    claim.write_text(str(os.getppid()))       # another live process runs it

    def meanwhile(_):   # while this process waits for the claim
      other.runs["p/model=a/seed=0"] = {"seed": 0, "setting": {"lr": 1.0}}
      other.save()
      claim.unlink()
    with mock.patch.object(records.time, "sleep", meanwhile), \
        self.assertRaisesRegex(
            RuntimeError, r"p/model=a/seed=0 was recorded by another process"
            r" with \{'setting': \{'lr': 1.0\}\}, where this command's cell "
            r"has \{'setting': \{'lr': 3.0\}\}"):
      exp.cells("p", experiment.grid(model=("a",), seed=range(1)),
                lambda c, key: {"setting": {"lr": 3.0}},
                expect=lambda cell: {"setting": {"lr": 3.0}})

  def test_jobs_of_any_keys_are_shared_out_the_same_way(self):
    out = pathlib.Path(tempfile.mkdtemp())
    exp, other = experiment.Experiment(out), experiment.Experiment(out)
    (out / "claims").mkdir()
    taken = out / "claims" / "m__n5__seed0.pid"
    taken.write_text(str(os.getppid()))     # another live process runs it
    ran = []

    def second():
      ran.append("second")
      other.runs["m/n5/seed0"] = {"by": "other"}
      taken.unlink()
      other.save()
      return {"by": "this"}
    got = exp.share([("m/n5/seed0", lambda: ran.append("first") or {}),
                     ("m/n50/seed0", second)], before=ran.append)
    self.assertEqual(ran, ["m/n50/seed0", "second", "m/n5/seed0"])
    self.assertEqual(got, {"m/n50/seed0": exp.runs["m/n50/seed0"],
                           "m/n5/seed0": {"by": "other"}})

  def test_a_cell_recorded_at_another_setting_is_retired_and_rerun(self):
    out = pathlib.Path(tempfile.mkdtemp())
    exp = experiment.Experiment(out)
    grid = experiment.grid(model=("a",), seed=(0, 1))
    exp.cells("p", grid, lambda c, k: {"params": 10, "seed": c["seed"]})
    # The work directory of the old run holds its checkpoints: a rerun
    # there would resume from them instead of training the new setting.
    old_dir = pathlib.Path(exp.workdir("p/model=a/seed=0"))
    old_dir.mkdir(parents=True)
    (old_dir / "ckpt").write_text("old")
    # The setting changed for seed 0 only (e.g. a new FFN width).
    want = lambda c: {"params": 12 if c["seed"] == 0 else 10}  # noqa: E731
    report = experiment.Experiment(out, argparse.Namespace(report_only=True))
    got = report.cells("p", grid, lambda c, k: 1 / 0, expect=want)
    self.assertEqual([r["seed"] for r in got["a"]], [1])   # left out
    self.assertTrue(old_dir.exists())                      # nothing moved
    ran = []
    again = experiment.Experiment(out)
    got = again.cells("p", grid, lambda c, k: ran.append(k) or {
        "params": 12, "seed": c["seed"]}, expect=want)
    self.assertEqual(ran, ["p/model=a/seed=0"])
    self.assertEqual([r["params"] for r in got["a"]], [12, 10])
    saved = json.loads((out / "results.json").read_text())
    self.assertEqual(saved["runs"]["p/model=a/seed=0"]["params"], 12)
    old = saved["superseded"]["p/model=a/seed=0"]
    self.assertEqual(old["params"], 10)
    self.assertIn("recorded {'params': 10}", old["superseded_because"])
    self.assertFalse(old_dir.exists())
    self.assertEqual((out / "runs/superseded/p/model=a/seed=0/ckpt"
                      ).read_text(), "old")
    # Retired again (the setting moved back): both retired records and
    # work directories are kept.
    old_dir.mkdir(parents=True)
    (old_dir / "ckpt").write_text("second")
    again.cells("p", grid, lambda c, k: {"params": 10, "seed": c["seed"]},
                expect=lambda c: {"params": 10})
    saved = json.loads((out / "results.json").read_text())
    self.assertEqual(
        [saved["superseded"][k]["params"] for k in
         ("p/model=a/seed=0", "p/model=a/seed=0#2")], [10, 12])
    self.assertEqual([(out / f"runs/superseded/p/model=a/{k}/ckpt").read_text()
                      for k in ("seed=0", "seed=0#2")], ["old", "second"])

  def test_parse_turns_on_the_compilation_cache(self):
    import jax  # pylint: disable=g-import-not-at-top
    out = os.path.join(tempfile.mkdtemp(), "exp")
    before = jax.config.jax_compilation_cache_dir
    try:
      p = experiment.parser("x", "d")
      old_argv = sys.argv
      sys.argv = ["x", f"--out={out}", "--scale=paper"]
      try:
        args = experiment.parse(p)
      finally:
        sys.argv = old_argv
      self.assertEqual(args.scale, "paper")
      self.assertEqual(jax.config.jax_compilation_cache_dir,
                       os.path.join(os.path.dirname(out), ".jax_cache"))
    finally:
      jax.config.update("jax_compilation_cache_dir", before)

  def test_require_names_the_flag(self):
    with self.assertRaisesRegex(FileNotFoundError,
                                "SST-2 dev.*--shared=DIR"):
      experiment.require("/nonexistent/dev.tsv", "SST-2 dev")

  def test_figure_needs_no_pyplot_backend(self):
    import matplotlib  # pylint: disable=g-import-not-at-top
    backend = matplotlib.get_backend()
    fig, axes = experiment.figure(2, 1)
    axes[0, 1].plot([1, 2], [3, 4])
    path = os.path.join(tempfile.mkdtemp(), "f.png")
    fig.savefig(path)
    self.assertGreater(os.path.getsize(path), 1000)
    self.assertEqual(matplotlib.get_backend(), backend)

  def test_shared_flags_and_their_errors(self):
    p = experiment.parser("x", "d", report_only=True, models=("a", "b"),
                          seeds="0,1", steps=0)
    args = p.parse_args(["--steps=7"])
    self.assertEqual((args.models, args.seeds, args.steps, args.report_only),
                     ("a,b", "0,1", 7, False))
    self.assertEqual(experiment.split("0,,2", int), [0, 2])
    self.assertEqual(experiment.split(""), [])
    with self.assertRaisesRegex(ValueError, "no shared flag --widht; add it"):
      experiment.parser("x", "d", widht=3)
    # A flag with fixed choices refuses any other value.
    p = experiment.parser("x", "d", vocab="small")
    self.assertEqual(p.parse_args(["--vocab=t5"]).vocab, "t5")
    with contextlib.redirect_stderr(io.StringIO()) as err, \
        self.assertRaises(SystemExit):
      p.parse_args(["--vocab=32k"])
    self.assertIn("invalid choice: '32k' (choose from 'small', 't5')",
                  err.getvalue())

  def test_a_report_trains_nothing_and_keeps_the_recorded_arguments(self):
    out = tempfile.mkdtemp()
    ran = argparse.Namespace(report_only=False, steps=5)
    exp = experiment.Experiment(out, ran)
    cells = experiment.grid(model=("a", "b"), seed=(0, 1))
    got = exp.cells("p", cells[:3], lambda c, k: {"k": k})
    self.assertEqual({m: [r["k"] for r in rs] for m, rs in got.items()},
                     {"a": ["p/model=a/seed=0", "p/model=a/seed=1"],
                      "b": ["p/model=b/seed=0"]})
    report = experiment.Experiment(
        out, argparse.Namespace(report_only=True, steps=9))
    self.assertEqual(
        {m: [r["k"] for r in rs]
         for m, rs in report.cells("p", cells, lambda c, k: 1 / 0).items()},
        {m: [r["k"] for r in rs] for m, rs in got.items()})
    self.assertIsNone(report.cell("p/model=b/seed=1", lambda: 1 / 0))
    saved = json.loads((pathlib.Path(out) / "results.json").read_text())
    self.assertEqual(saved["args"]["steps"], 5)
    # Each run keeps the arguments of the command that ran it.
    later = experiment.Experiment(
        out, argparse.Namespace(report_only=False, steps=7))
    later.cell("p/model=b/seed=1", lambda: {"k": 0})
    saved = json.loads((pathlib.Path(out) / "results.json").read_text())
    self.assertEqual(saved["args"]["steps"], 7)
    self.assertEqual([saved["runs"][k]["args"]["steps"] for k in (
        "p/model=a/seed=0", "p/model=b/seed=1")], [5, 7])

  def test_a_report_rewrites_nothing_in_the_record(self):
    out = pathlib.Path(tempfile.mkdtemp())
    exp = experiment.Experiment(out, argparse.Namespace(report_only=False))
    exp.cell("p/seed=0", lambda: {"k": 1})
    exp.save(sizes={"dtype": "float32"})
    before = (out / "results.json").read_bytes()
    report = experiment.Experiment(out, argparse.Namespace(report_only=True))
    # What a report computes from today's settings stays in memory.
    report.save(sizes={"dtype": "auto"})
    self.assertEqual(report.baseline("b", lambda: {"nb": 0.5}), {"nb": 0.5})
    self.assertEqual(report.data["sizes"], {"dtype": "auto"})
    self.assertEqual((out / "results.json").read_bytes(), before)

  def test_a_baseline_of_other_data_is_computed_again(self):
    out = pathlib.Path(tempfile.mkdtemp())
    exp = experiment.Experiment(out, argparse.Namespace(report_only=False))
    self.assertEqual(exp.baseline("b", lambda: {"nb": 0.5}, tag={"d": 1}),
                     {"nb": 0.5, "d": 1})
    self.assertEqual(exp.baseline("b", lambda: 1 / 0, tag={"d": 1})["nb"],
                     0.5)
    again = experiment.Experiment(out, argparse.Namespace(report_only=False))
    self.assertEqual(again.baseline("b", lambda: {"nb": 0.7}, tag={"d": 2}),
                     {"nb": 0.7, "d": 2})
    saved = json.loads((out / "results.json").read_text())
    self.assertEqual(saved["baselines"]["b"], {"nb": 0.7, "d": 2})

  def test_fingerprint_reads_files_by_content(self):
    import ml_collections  # pylint: disable=g-import-not-at-top
    tmp = pathlib.Path(tempfile.mkdtemp())
    for name, text in (("a.model", "pieces"), ("b.model", "pieces"),
                       ("c.model", "other pieces")):
      (tmp / name).write_text(text)

    def config(vocab, lr=1e-3):
      return ml_collections.ConfigDict(dict(
          learning_rate=lr, data=dict(vocab_path=str(tmp / vocab),
                                      files=[str(tmp / vocab), "absent.tsv"])))
    fp = experiment.config_fingerprint
    self.assertEqual(fp(config("a.model")), fp(config("b.model")))
    self.assertNotEqual(fp(config("a.model")), fp(config("c.model")))
    self.assertNotEqual(fp(config("a.model")), fp(config("a.model", 3e-4)))

  def test_adopts_another_experiments_run_only_with_the_same_config(self):
    import ml_collections  # pylint: disable=g-import-not-at-top
    root = pathlib.Path(tempfile.mkdtemp())
    (root / "v1").write_text("vocab")
    (root / "v2").write_text("vocab")
    (root / "v3").write_text("another vocab")
    source = experiment.Experiment(root / "source")
    source.run("s/seed=0", lambda: {"eval": {"accuracy": 0.8}})

    def config(vocab, seed=0):
      return ml_collections.ConfigDict(dict(seed=seed,
                                            vocab_path=str(root / vocab)))
    exp = experiment.Experiment(root / "ours",
                                argparse.Namespace(report_only=False))
    # A missing run, another seed, a vocabulary of other content: nothing.
    self.assertIsNone(exp.adopt("k", config("v1"), root / "source",
                                "s/seed=1", config("v2")))
    self.assertIsNone(exp.adopt("k", config("v1"), root / "source",
                                "s/seed=0", config("v2", seed=1)))
    self.assertIsNone(exp.adopt("k", config("v1"), root / "source",
                                "s/seed=0", config("v3")))
    self.assertIsNone(exp.adopt("k", config("v1"), root / "absent",
                                "s/seed=0", config("v2")))
    # A report records nothing.
    report = experiment.Experiment(root / "ours",
                                   argparse.Namespace(report_only=True))
    self.assertIsNone(report.adopt("k", config("v1"), root / "source",
                                   "s/seed=0", config("v2")))
    self.assertNotIn("k", exp.runs)
    # The same settings, files of the same content: recorded, and ``run``
    # then trains nothing.
    got = exp.adopt("k", config("v1"), root / "source", "s/seed=0",
                    config("v2"))
    self.assertEqual(got, dict(source.runs["s/seed=0"],
                               adopted_from="source: s/seed=0"))
    self.assertEqual(exp.run("k", lambda: 1 / 0), got)
    saved = json.loads((root / "ours" / "results.json").read_text())
    self.assertEqual(saved["runs"]["k"], got)
    self.assertNotIn("wall_s_total", saved)

  def test_table_rows_of_the_baselines(self):
    headers = ["model", "ppl", "/ unigram", "note"]
    rows = experiment.perplexity_baseline_rows(
        headers, {"unigram": 200.0, "bigram": 150.0, "bigram_k": 0.01},
        "ppl", "/ unigram")
    self.assertEqual(rows, [["unigram (train counts, add-1)", "200.0", "1.00",
                             ""],
                            ["bigram (add-0.01)", "150.0", "0.75", ""]])
    with self.assertRaisesRegex(ValueError, r"no column \['pp'\]"):
      experiment.table_row(headers, {"pp": 1})

  def test_match_field_is_the_brute_force_nearest(self):
    import ml_collections  # pylint: disable=g-import-not-at-top
    config = ml_collections.ConfigDict(dict(d_ffn=64, width=8))
    calls = []

    def measure(c):
      calls.append(c.d_ffn)
      return 3 * c.d_ffn + 7 * c.width
    for target in (400.0, 1000.0, 5.0):
      got = experiment.match_field(config, "d_ffn", measure, target, lo=32,
                                   hi=64)
      best = min(range(16, 1025, 16),
                 key=lambda f: abs(3 * f + 7 * 8 - target))
      self.assertEqual((got.d_ffn, got.width), (best, 8))
    self.assertEqual(config.d_ffn, 64)         # the input is left alone
    self.assertEqual(calls, [32, 64] * 3)      # two measurements a match

  def test_mean_curve_keeps_the_steps_every_run_has(self):
    runs = [{"eval_curve": {2: {"acc": 0.5}, 4: {"acc": 0.7}}},
            {"eval_curve": {"2": {"acc": 0.6}, "4": {"acc": 0.9},
                            "6": {"acc": 1.0}}}]
    steps, values = experiment.mean_curve(runs, "acc", 100)
    self.assertEqual(steps, [2, 4])
    np.testing.assert_allclose(values, [[50, 70], [60, 90]])
    self.assertEqual(experiment.curve(runs[1], "acc"),
                     ([2, 4, 6], [0.6, 0.9, 1.0]))

  def test_flops_per_step_from_the_logged_throughput(self):
    run = {"train_curve": {"10": {"tflops_per_device": 9.0,
                                  "steps_per_sec": 1.0},
                           "20": {"tflops_per_device": 0.06,
                                  "steps_per_sec": 2.0},
                           "30": {"loss": 1.0}}}
    # The last interval that logged FLOPs (20, not "10" by string order, not
    # 30 without throughput): 0.06e12 / 2.
    self.assertAlmostEqual(experiment.flops_per_step(run) / 3e10, 1.0)
    self.assertTrue(np.isnan(experiment.flops_per_step(
        {"train_curve": {"5": {"loss": 1.0}}})))


class TuningCostTest(absltest.TestCase):

  def test_expected_max_equals_enumeration(self):
    values = [0.5, 0.8, 0.6, 0.8, 0.1]
    for n in (1, 2, 3):
      # Every ordered n-tuple of draws with replacement is equally likely.
      tuples = list(itertools.product(values, repeat=n))
      brute = np.mean([max(t) for t in tuples])
      self.assertAlmostEqual(tuning.expected_max(values, n), brute)

  def test_search_space(self):
    space = tuning.trials(200, seed=3)
    lrs, dropouts = np.array(space).T
    self.assertTrue(np.all((lrs >= 1e-8) & (lrs <= 1e-1)))
    self.assertTrue(np.all((dropouts >= 0) & (dropouts <= 0.5)))
    # log-uniform: about half the draws below 10^-4.5.
    self.assertBetween(np.mean(lrs < 10 ** -4.5), 0.35, 0.65)
    self.assertEqual(space, tuning.trials(200, seed=3))

  def test_gap_interval_is_paired_over_the_draws(self):
    ours = [0.5, 0.8, 0.6, 0.7, 0.1, 0.9]
    # Paired resamples: the same draws give exactly 0; a constant shift of
    # every trial gives exactly the shift at every n.
    self.assertEqual(tuning.gap_interval(ours, ours, 3), (0.0, 0.0))
    low, high = tuning.gap_interval([v + 0.02 for v in ours], ours, 2)
    self.assertAlmostEqual(low, 0.02)
    self.assertAlmostEqual(high, 0.02)
    # One lucky trial: the interval holds 0, so no verdict.
    lucky = [0.5, 0.5, 0.5, 0.5, 0.5, 0.9]
    low, high = tuning.gap_interval(lucky, [0.5] * 6, 1, seed=1)
    self.assertEqual(low, 0.0)
    self.assertGreater(high, 0.0)
    with self.assertRaisesRegex(ValueError, "must share the draws"):
      tuning.gap_interval([0.1, 0.2], [0.1], 1)

  def test_permutation_p_enumerates_the_swaps(self):
    ours, other = [0.9, 0.7, 0.6, 0.8], [0.5, 0.7, 0.4, 0.6]
    for n in (1, 2, 4):
      # Every one of the 2^4 ways of swapping each draw's two scores.
      gaps = []
      for swap in itertools.product((False, True), repeat=4):
        a = [o if s else x for x, o, s in zip(ours, other, swap)]
        b = [x if s else o for x, o, s in zip(ours, other, swap)]
        gaps.append(tuning.expected_max(a, n) - tuning.expected_max(b, n))
      observed = tuning.expected_max(ours, n) - tuning.expected_max(other, n)
      want = np.mean(np.abs(gaps) >= abs(observed) - 1e-12)
      self.assertAlmostEqual(tuning.permutation_p(ours, other, n), want)
    # Identical scores: every swap gives the observed gap 0.
    self.assertEqual(tuning.permutation_p(ours, ours, 2), 1.0)
    with self.assertRaisesRegex(ValueError, "must share the draws"):
      tuning.permutation_p([0.1, 0.2], [0.1], 1)

  def test_permutation_test_holds_its_level_where_the_bootstrap_does_not(
      self):
    # Equal models (each draw's two scores exchangeable), n = T: the
    # expected best is nearly the top draw. The permutation test rejects
    # about 5% of the time; the percentile bootstrap of a maximum more.
    rng = np.random.default_rng(0)
    perm = boot = 0
    reps = 200
    for r in range(reps):
      base = rng.uniform(0.5, 0.8, 20)
      a, b = (base + rng.normal(0, 0.01, 20) for _ in range(2))
      perm += tuning.permutation_p(a, b, 20, samples=500, seed=r) < 0.05
      low, high = tuning.gap_interval(a, b, 20, samples=200, seed=r)
      boot += low > 0 or high < 0
    self.assertLess(perm / reps, 0.09)
    self.assertGreater(boot / reps, perm / reps)

  def test_gap_verdict(self):
    self.assertEqual(tuning.gap_verdict(0.02, 0.01, 20), "agrees, p = 0.010")
    self.assertEqual(tuning.gap_verdict(-0.02, 0.0004, 20),
                     "disagrees, p < 0.001")
    self.assertEqual(tuning.gap_verdict(0.02, 0.2, 20),
                     "not decided, p = 0.200")
    # Three trials, each above: too few swaps to say so.
    self.assertEqual(tuning.gap_verdict(0.02, 0.01, 3),
                     "not decided (3 < 10 trials)")

  def test_gap_cells(self):
    # Every one of 12 draws 2 points ahead: the interval is the shift, and
    # the exact permutation test gives 2 of 4,096 swaps as extreme.
    other = list(np.linspace(0.5, 0.8, 12))
    ours = [v + 0.02 for v in other]
    self.assertEqual(tuning.gap_cells(ours, other, 3),
                     ["+2.0 / +2.0", "agrees, p < 0.001"])
    self.assertEqual(tuning.gap_cells(other, other, 3)[1],
                     "not decided, p = 1.000")
    # The first draw recorded for both: no interval, no verdict yet.
    self.assertEqual(tuning.gap_cells([0.7], [0.6], 1),
                     ["-", "not decided (1 < 10 trials)"])
    # The same shift scored on 872 examples: each side's binomial noise
    # (about 1.5 points) swamps a 2-point gap.
    low, high = tuning.gap_interval(ours, other, 3, n_eval=872)
    self.assertLess(low, 0.0)
    self.assertGreater(high, 0.02)
    self.assertTrue(tuning.gap_cells(ours, other, 3, n_eval=872)[1]
                    .startswith("not decided, p = 0."))

  def test_evaluation_noise_is_integrated_over_the_swaps(self):
    ours, other = [0.9, 0.7, 0.6, 0.8], [0.5, 0.7, 0.4, 0.6]
    n, n_eval = 2, 500
    a, b = tuning.expected_max(ours, n), tuning.expected_max(other, n)
    sd = np.sqrt((a * (1 - a) + b * (1 - b)) / n_eval)
    self.assertAlmostEqual(tuning.eval_sd(ours, other, n, n_eval), sd)
    observed = abs(a - b)
    # Monte Carlo of the same null: a random swap of each draw, plus a
    # normal draw of the evaluation noise.
    rng = np.random.default_rng(0)
    ours_a, other_a = np.array(ours), np.array(other)
    hits = []
    for _ in range(20000):
      swap = rng.random(4) < 0.5
      x, y = np.where(swap, other_a, ours_a), np.where(swap, ours_a, other_a)
      g = tuning.expected_max(x, n) - tuning.expected_max(y, n)
      hits.append(abs(g + rng.normal(0, sd)) >= observed)
    got = tuning.permutation_p(ours, other, n, n_eval=n_eval)
    self.assertAlmostEqual(got, np.mean(hits), delta=0.01)
    # The random-swap path (10,000 of the 2^14 ways) agrees with the exact
    # one (all of them).
    rng = np.random.default_rng(1)
    ours, other = rng.uniform(0.6, 0.8, 14), rng.uniform(0.58, 0.78, 14)
    self.assertAlmostEqual(
        tuning.permutation_p(ours, other, 3, n_eval=n_eval),
        tuning.permutation_p(ours, other, 3, samples=2 ** 14, n_eval=n_eval),
        delta=0.01)
    with self.assertRaisesRegex(ValueError, "fractions, not percent"):
      tuning.eval_sd([90.0, 80.0], [85.0, 70.0], 1, 872)

  def test_paired_trials_keeps_the_draws_both_models_ran(self):
    # Draw 1 ran for HyperMixer only (a run cut short); draw 3 for neither:
    # the curves use draws 0 and 2, in draw order, for both models.
    by_trial = {("hypermixer", 0): 0.6, ("attention", 0): 0.5,
                ("hypermixer", 1): 0.9,
                ("hypermixer", 2): 0.7, ("attention", 2): 0.8}
    self.assertEqual(tuning.paired_trials(by_trial, 4, tuning_cost.MODELS),
                     {"hypermixer": [0.6, 0.7], "attention": [0.5, 0.8]})
    self.assertEqual(tuning.paired_trials({}, 4, tuning_cost.MODELS),
                     {"hypermixer": [], "attention": []})


@pytest.fixture
def few_resamples(monkeypatch):
  """The reports' bootstrap intervals from 100 resamples, not 2,000: the
  tests using this check what runs and what is recorded, not the intervals
  (``TuningCostTest`` checks ``gap_interval`` itself)."""
  monkeypatch.setattr(tuning, "gap_interval", functools.partial(
      tuning.gap_interval, samples=100))


@pytest.mark.usefixtures("few_resamples")
def test_tuning_cost_models_split_between_processes(shared_data, tmp_path,
                                                    monkeypatch):
  # One process per model trains each trial once; the report pairs the
  # draws, and a last run trains nothing. The best draws are not trained
  # again: chosen on dev, their seeds would be scored on the same sentences
  # (--carve trains them, below).
  calls = []

  def train(config, workdir):
    calls.append((pathlib.Path(workdir).relative_to(tmp_path).as_posix(),
                  config.learning_rate, config.model.dropout_rate,
                  config.seed))
    return {"eval": {"accuracy": 0.5 + config.model.dropout_rate
                                 + 0.01 * config.seed}}
  monkeypatch.setattr(tuning_cost.experiment, "train", train)
  monkeypatch.setattr(tuning_cost.glue, "sst2_vocab", lambda exp, shared: {
      "path": str(shared_data / "t5_spm/sentencepiece.model"),
      "model_vocab_size": 32128})
  monkeypatch.setattr(tuning_cost.glue, "bag_of_words_baselines",
                      lambda c: {"naive_bayes": 0.75, "dev_rows": 872})

  def main(*flags):
    monkeypatch.setattr(sys, "argv", [
        "tuning_cost.py", f"--out={tmp_path}", f"--shared={shared_data}",
        "--scale=small", "--trials=3", "--steps=2", "--best_seeds=1,2",
        *flags])
    tuning_cost.main()
  space = tuning.trials(3)
  run = "runs/w128_s2_n64/sst2/{}/trial{}"
  main("--models=attention", "--order=reverse")
  assert calls == [(run.format("attention", t), lr, d, 0)
                   for t, (lr, d) in reversed(list(enumerate(space)))]
  assert not (tmp_path / "table.md").exists()   # no pair recorded yet
  calls.clear()
  main("--models=hypermixer")
  assert calls == [(run.format("hypermixer", t), lr, d, 0)
                   for t, (lr, d) in enumerate(space)]
  saved = json.loads((tmp_path / "results.json").read_text())
  expected = [tuning.expected_max([0.5 + d for _, d in space], n)
              for n in (1, 2, 3)]
  for mixer in tuning_cost.MODELS:
    np.testing.assert_allclose(saved["expected_max"][mixer], expected)
  assert "best_draws" not in saved
  table = (tmp_path / "table.md").read_text()
  assert "best draw, over seeds |" not in table
  assert "on the same 872 sentences" in table
  calls.clear()
  main()
  assert not calls
  with pytest.raises(SystemExit, match="--models='gmlp'"):
    main("--models=gmlp")


@pytest.mark.usefixtures("few_resamples")
def test_tuning_cost_carved_chooses_nothing_on_dev(shared_data, tmp_path,
                                                   monkeypatch):
  # --carve: every trial trains on the carved train phrases and is scored
  # on the carved ones; the best draws' seeds (0 included: the trial is no
  # dev score) train on the same phrases and are scored on dev.
  calls = []

  def train(config, workdir):
    calls.append((pathlib.Path(workdir).relative_to(tmp_path).as_posix(),
                  config.seed, config.data.local_files.train,
                  config.data.local_files.validation))
    dev = config.data.local_files.validation.endswith("dev.tsv")
    return {"eval": {"accuracy": 0.3 + config.model.dropout_rate
                                 + (0.1 if dev else 0) + 0.01 * config.seed}}
  monkeypatch.setattr(tuning_cost.experiment, "train", train)
  monkeypatch.setattr(tuning_cost.glue, "sst2_vocab", lambda exp, shared: {
      "path": str(shared_data / "t5_spm/sentencepiece.model"),
      "model_vocab_size": 32128})
  monkeypatch.setattr(tuning_cost.glue, "bag_of_words_baselines",
                      lambda c: {"naive_bayes": 0.75, "dev_rows": 872})
  monkeypatch.setattr(sys, "argv", [
      "tuning_cost.py", f"--out={tmp_path}", f"--shared={shared_data}",
      "--scale=small", "--trials=3", "--steps=2", "--best_seeds=1,2",
      "--carve"])
  tuning_cost.main()
  saved = json.loads((tmp_path / "results.json").read_text())
  train_part = saved["sst2_split"]["train"]["sha256"]
  space = tuning.trials(3)
  top = int(np.argmax([d for _, d in space]))
  trials = [c for c in calls if "/best/" not in c[0]]
  best = [c for c in calls if "/best/" in c[0]]
  assert len(trials) == 6 and all(
      c[0].startswith("runs/w128_s2_n64_carved/") and c[1] == 0
      and c[2].endswith("carved_train.tsv")
      and c[3].endswith("carved_validation.tsv") for c in trials)
  assert experiment.file_digest(trials[0][2]) == train_part
  assert [(c[0].split("/best/")[1], c[1]) for c in best] == [
      (f"trial{top}/seed={s}", s) for s in (0, 1, 2)] * 2
  assert all(c[2].endswith("carved_train.tsv") and c[3].endswith("dev.tsv")
             for c in best)
  dev_acc = [0.4 + space[top][1] + 0.01 * s for s in range(3)]
  np.testing.assert_allclose(
      saved["best_draws_carved"]["hypermixer"]["accuracy"], dev_acc)
  assert "best_draws" not in saved and "expected_max_carved" in saved
  table = (tmp_path / "table_carved.md").read_text()
  assert "expected best sst2 validation (carved) accuracy" in table
  assert not (tmp_path / "table.md").exists()
  # Every run records the carve; one recorded on another carve is retired
  # and run again, the others are kept.
  carve = saved["sst2_split"]["validation"]["sha256"]
  assert {r["carved_validation_sha256"] for r in saved["runs"].values()} == {
      carve}
  stale = "w128_s2_n64_carved/sst2/attention/trial1"
  saved["runs"][stale]["carved_validation_sha256"] = "another"
  (tmp_path / "results.json").write_text(json.dumps(saved))
  calls.clear()
  tuning_cost.main()
  assert [c[0] for c in calls] == [f"runs/{stale}"]
  again = json.loads((tmp_path / "results.json").read_text())
  assert again["runs"][stale]["carved_validation_sha256"] == carve
  assert "another" in json.dumps(again["superseded"])


class LowResourceTest(absltest.TestCase):

  def test_subset_is_a_fixed_fraction_of_the_rows(self):
    tmp = pathlib.Path(tempfile.mkdtemp())
    src = tmp / "train.tsv"
    rows = [f"sentence {i}\t{i % 2}" for i in range(1000)]
    src.write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    path = glue.subset_tsv(str(src), 0.1, tmp)
    lines = pathlib.Path(path).read_text().splitlines()
    self.assertEqual(lines[0], "sentence\tlabel")
    self.assertLen(lines, 101)
    self.assertContainsSubset(lines[1:], rows)
    other = tmp / "again"
    other.mkdir()
    self.assertEqual(pathlib.Path(glue.subset_tsv(
        str(src), 0.1, other)).read_text(), "\n".join(lines) + "\n")


  def test_the_full_set_cell_is_glue_from_scratchs_main_cell(self):
    # At 100% low_resource trains what glue_from_scratch's main grid trains:
    # its configs differ only in where the files live.
    shared = pathlib.Path(tempfile.mkdtemp())
    (shared / "glue/SST-2").mkdir(parents=True)
    for split in ("train", "dev"):
      (shared / f"glue/SST-2/{split}.tsv").write_text(
          "sentence\tlabel\nfine\t1\n")
    out = shared / "results"
    (out / "glue_from_scratch" / "vocab").mkdir(parents=True)
    (out / "glue_from_scratch" / "vocab" / "spm8000.model").write_text(
        "pieces")
    exp = experiment.Experiment(out / "glue_from_scratch")
    budget = dict(steps=7, width=16, seq_len=32)
    exp.run("w16_s7_n32/task=sst2/model=hypermixer/lr=0.001/seed=2",
            lambda: {"eval": {"accuracy": 0.79}})
    ours = low_resource.glue_vocab(experiment.Experiment(
        out / "low_resource", argparse.Namespace(report_only=False)))
    # SentencePiece would not train the same file again: it is copied.
    self.assertEqual(
        (out / "low_resource" / "vocab" / "spm8000.model").read_text(),
        "pieces")

    def cfg(**kw):
      return glue.glue_config(
          "sst2", "hypermixer", "small", 1e-3, shared, seed=2,
          vocab=dict(path=str(out / "low_resource/vocab/spm8000.model"),
                     model_vocab_size=8192), **budget, **kw)
    cell = dict(fraction=1.0, model="hypermixer", seed=2)
    # A train file of other rows: not the same run.
    other = shared / "other.tsv"
    other.write_text("sentence\tlabel\nbad\t0\n")
    low_resource.glue_run(ours, "k", cfg(train_file=str(other)), cell,
                          budget, 1e-3, shared)
    self.assertNotIn("k", ours.runs)
    low_resource.glue_run(ours, "k", cfg(), cell, budget, 1e-3, shared)
    self.assertEqual(ours.runs["k"]["adopted_from"], "glue_from_scratch: "
                     "w16_s7_n32/task=sst2/model=hypermixer/lr=0.001/seed=2")


class GlueConfigTest(absltest.TestCase):

  def test_hypermixer_above_cell_reads_the_papers_table(self):
    above = glue.hypermixer_above
    # The paper: SST-2, HyperMixer 81.4 above MLP-Mixer's 81.2; MNLI, 66.1
    # below linear attention's 66.9.
    hi, lo = [0.80, 0.81, 0.82], [0.70, 0.71, 0.72]
    self.assertEqual(above("sst2", "mlp_mixer", hi, lo),
                     "paper yes; ours agrees: +10.0 [+7.7, +12.3], p < 0.001")
    self.assertEqual(above("mnli", "linear_attention", hi, lo),
                     "paper no; ours disagrees: +10.0 [+7.7, +12.3], "
                     "p < 0.001")
    # The 872 examples of SST-2 dev add their own noise.
    self.assertTrue(above("sst2", "mlp_mixer", hi, lo, 872).startswith(
        "paper yes; ours agrees: +10.0 [+5.7, +14.3]"))
    self.assertEqual(above("sst2", "gmlp", [0.8], [0.7]),
                     "paper yes; ours not decided (1 < 3 seeds)")
    self.assertEqual(above("sst2", "hypermixer", [0.8, 0.9], [0.8, 0.9]), "")
    self.assertEqual(above("sst2", "gmlp", [], [0.7, 0.8]), "")

  def test_budget_table_groups_runs_by_budget_and_model(self):
    def run(acc):
      return {"eval": {"accuracy": acc}}
    runs = {
        "w128_s1000_n64/task=sst2/model=attention/lr=0.001/seed=0": run(0.80),
        "w128_s1000_n64/task=sst2/model=attention/lr=0.001/seed=1": run(0.82),
        "w128_s3000_n64_d0.3/task=sst2/model=mlp_mixer/lr=0.001/seed=0":
            run(0.75),
        # Another task, and a model not asked for, stay out.
        "w128_s1000_n64/task=qnli/model=attention/lr=0.001/seed=0": run(0.5),
        "w128_s1000_n64/task=sst2/model=fnet/lr=0.001/seed=0": run(0.5),
    }
    text = glue.budget_table(runs, ["attention", "mlp_mixer"])
    rows = [line for line in text.splitlines() if line.startswith("| w")]
    self.assertEqual(rows, [
        "| w128_s1000_n64 | 81.0 ± 1.4 (n=2) |  |",
        "| w128_s3000_n64_d0.3 |  | 75.0 (n=1) |"])

  def test_small_models_keep_the_equal_size_rule(self):
    from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
    counts = {}
    for mixer in ("attention", "hypermixer", "mlp_mixer"):
      c = experiment.load_config("glue.py", f"sst2,{mixer}")
      glue.small_model(c, 128)
      counts[mixer] = models.count_params(c.model, under="token_mixing")
    # Each token mixer is within 2% of the Transformer's parameters.
    for mixer, count in counts.items():
      self.assertAlmostEqual(count / counts["attention"], 1.0, delta=0.02,
                             msg=f"{mixer}: {counts}")

  @absltest.skipUnless(HAS_SST2, SKIP_SST2)
  @pytest.mark.slow
  def test_tiny_sst2_run_records_curves(self):
    # The first rows of the SST-2 sample: a few batches to train on, one to
    # evaluate (the run's pipeline, step and curves are what is tested).
    tmp = pathlib.Path(tempfile.mkdtemp())
    for split, rows in (("train", 129), ("dev", 33)):
      with open(SHARED / f"glue/SST-2/{split}.tsv", encoding="utf-8") as f:
        (tmp / f"{split}.tsv").write_text(
            "".join(itertools.islice(f, rows)), encoding="utf-8")
    cfg = glue.glue_config("sst2", "fnet", "small", 1e-3, SHARED, steps=2,
                           width=16, seq_len=32,
                           train_file=str(tmp / "train.tsv"))
    cfg.data.local_files.validation = str(tmp / "dev.tsv")
    cfg.batch_size = cfg.eval_batch_size = 16
    cfg.eval_every = 1
    workdir = tempfile.mkdtemp()
    result = experiment.train(cfg, workdir)
    self.assertEqual(result["step"], 2)
    self.assertEqual(sorted(result["eval_curve"]), [1, 2])
    self.assertEqual(result["eval"]["accuracy"],
                     result["eval_curve"][2]["accuracy"])


if __name__ == "__main__":
  absltest.main()


def test_seed_summary_matches_scipy_and_formats_missing_seeds():
  import scipy.stats  # pylint: disable=g-import-not-at-top
  values = [3e-3, 1e-3, 2.5e-3]
  got = experiment.seed_summary(values)
  ref = scipy.stats.describe(values)
  np.testing.assert_allclose(
      [got["mean"], got["std"], got["min"], got["max"]],
      [ref.mean, np.sqrt(ref.variance), *ref.minmax])
  assert got["seeds"] == 3
  assert experiment.fmt_seed_summary(got, 3) == "2.17e-03 ± 1.0e-03"
  assert experiment.fmt_seed_summary(got, 5).endswith("(3 of 5 seeds)")
  one = experiment.seed_summary([4e-3])
  assert (one["std"], experiment.fmt_seed_summary(one, 1)) == (0.0, "4.00e-03")
  assert experiment.fmt_seed_summary(experiment.seed_summary([]), 3) == "—"
  # A diverged seed is one not run: the others' figures, counted as such.
  diverged = experiment.seed_summary([3e-3, float("nan"), 1e-3])
  assert diverged["seeds"] == 2 and diverged["mean"] == 2e-3
  assert (experiment.fmt_seed_summary(diverged, 3)
          == "2.00e-03 ± 1.4e-03 (2 of 3 seeds)")


def test_glue_tune_selects_on_carved_phrases_and_reports_dev(tmp_path,
                                                             monkeypatch):
  # The wiring of GLUE's --tune, with the trainer replaced: selection runs
  # train on the carved train phrases and are scored once on the carved
  # ones; the seeds train on the carved train phrases and are scored on dev.
  source = tmp_path / "train.tsv"
  source.write_text("sentence\tlabel\n" + "".join(
      f"phrase {i}\t{i % 2}\n" for i in range(40)))
  import ml_collections  # pylint: disable=g-import-not-at-top

  def config(mixer, seed, steps=None):
    c = ml_collections.ConfigDict(dict(
        seed=seed, learning_rate=1e-3, warmup_steps=10,
        num_train_steps=steps or 100, eval_every=20, eval_split="validation",
        data=dict(local_files=dict(train=str(source), validation="dev.tsv"))))
    c.mixer = mixer
    return c
  seen = []

  def fake_run(exp, c, key):
    seen.append((key, c.data.local_files.train, c.data.local_files.validation,
                 c.eval_every, c.learning_rate, c.warmup_steps, c.seed))
    select = "/tune/" in key or "/budget/" in key
    if "/budget/" in key and c.mixer == "attention":
      raise FloatingPointError("loss or gradient became NaN/Inf between "
                               "steps 1 and 10; stopping.")
    # HyperMixer is best at 3e-3; the Transformer at 1e-3. On dev,
    # HyperMixer is clearly above. Shorter runs score below Naive Bayes.
    acc = ((c.learning_rate == (3e-3 if c.mixer == "hypermixer" else 1e-3))
           * c.num_train_steps / 100
           if select else (0.9 if c.mixer == "hypermixer" else 0.6)
           + c.seed / 100)
    return {"eval": {"accuracy": float(acc)}}
  monkeypatch.setattr(glue, "run_cell", fake_run)
  monkeypatch.setattr(glue, "bag_of_words_baselines", lambda c: {
      "naive_bayes": 0.8, "majority": 0.5, "dev_rows": 872,
      "train": c.data.local_files.train,
      "scored": c.data.local_files[c.eval_split]})
  exp = experiment.Experiment(tmp_path / "out",
                              argparse.Namespace(report_only=False))
  split, searched, chosen, runs, base = glue.tune(
      exp, ["hypermixer", "attention"], [0, 1, 2], config, 100, "b/",
      str(source), (1e-3, 3e-3))
  carved_train = split["train"]["path"]
  assert split["validation"]["documents"] == 4
  assert base["train"] == carved_train
  select = [s for s in seen if "/tune/" in s[0]]
  assert len(select) == 8 and all(
      s[1] == carved_train and s[2] == split["validation"]["path"]
      and s[3] == 100 and s[6] == 100 for s in select)
  assert {(s[4], s[5]) for s in select} == {
      (1e-3, 2), (1e-3, 10), (3e-3, 2), (3e-3, 10)}
  final = [s for s in seen if "/tuned/" in s[0]]
  assert [(s[1], s[2], s[3], s[6]) for s in final] == [
      (carved_train, "dev.tsv", 20, seed) for seed in (0, 1, 2)] * 2
  assert chosen == {
      "hypermixer": {"lr": 3e-3, "warmup": 2, "warmup_share": 0.02},
      "attention": {"lr": 1e-3, "warmup": 2, "warmup_share": 0.02}}
  glue.report_tuned(exp, ["hypermixer", "attention"], "0,1,2", 100,
                    (split, searched, chosen, runs, base), (1e-3, 3e-3))
  table = (tmp_path / "out" / "table_tuned.md").read_text()
  assert "| HyperMixer | 0.003, 2% | 91.0 ± 1.0 (n=3) | 81.4 |" in table
  assert "| Transformer | 0.001, 2% | 61.0 ± 1.0 (n=3) | 79.4 | paper yes; " \
         "ours agrees: +30.0" in table
  assert "| HyperMixer | 0.00 | 0.00 | 100.00 * | 100.00 |" in table
  # Half the selection runs right, 4 validation rows: sqrt(.25 / 4).
  assert "binomial standard error at the searches' mean accuracy is 25.00 " \
         "points" in table
  assert "the same for every model, not confirmed on a carved split" in table

  # --budget_check=50: each choice trained 50 steps (seed 100, its warm-up
  # share) on the carved train part, scored on the carved validation part,
  # where Naive Bayes (fitted on the carved train part) sets the bar; the
  # best model clears it at 100 steps only, so the rule picks the 100 used.
  # The Transformer's 50-step run diverges: never the best.
  seen.clear()
  check = glue.budget_check(exp, "b/", (split, searched, chosen, runs, base),
                            ["hypermixer", "attention"], [50], 100, config)
  assert sorted((s[4], s[5], s[6]) for s in seen) == [
      (1e-3, 1, 100), (3e-3, 1, 100)]
  assert all(s[1] == carved_train and s[2] == split["validation"]["path"]
             and s[3] == 50 for s in seen)
  assert check[1]["scored"] == split["validation"]["path"]
  assert check[1]["train"] == carved_train
  assert check[0] == {50: {"hypermixer": 0.5, "attention": -float("inf")},
                      100: {"hypermixer": 1.0, "attention": 1.0}}
  assert selection.length_confirmed(exp.data, "b/", 100,
                                    ["hypermixer", "attention"])
  # Each length run records the carve it was scored on (another carve's runs
  # are retired, not reused).
  assert exp.runs["b/budget/steps=50/model=hypermixer"][
      "carved_validation_sha256"] == split["validation"]["sha256"]
  glue.report_tuned(exp, ["hypermixer", "attention"], "0,1,2", 100,
                    (split, searched, chosen, runs, base), (1e-3, 3e-3),
                    check=check)
  table = (tmp_path / "out" / "table_tuned.md").read_text()
  assert "the rule picks 100 steps, the length used: confirmed" in table
  assert "| HyperMixer | 50.00 | 100.00 |" in table
  assert "| Transformer | diverged | 100.00 |" in table
  assert "| bar: Naive Bayes on these examples | 80.00 | 80.00 |" in table
  assert ("the same for every model, checked on the carved validation split "
          "in the last section") in table
  # The rule reads the best model: one above the bar is enough.
  scores = {50: {"a": 0.85, "b": 0.1}, 100: {"a": 0.9, "b": 0.9}}
  assert selection.shortest_length(scores, 0.8, ["a", "b"],
                                   best_above=True) == 50
  assert selection.shortest_length(scores, 0.95, ["a", "b"],
                                   best_above=True) is None
  assert selection.shortest_length(scores, 0.95, ["a", "b"]) == 50


def test_trained_params_read_the_final_step_or_refuse(tmp_path):
  # The final step's parameters, never an older step in their place (the
  # held-out scores of a run must be of the parameters it ended with).
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.models import zoo  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import checkpoint  # pylint: disable=g-import-not-at-top
  config = experiment.load_config("default.py", "hypermixer")
  config.num_train_steps = 4
  x = zoo.dummy_inputs(config.model)
  params = nn.unbox(zoo.build_model(config.model).init(
      jax.random.key(1), np.zeros(x.shape, x.dtype))["params"])
  at = {s: jax.tree.map(lambda p, s=s: p + s, params) for s in (2, 4)}
  with checkpoint.Checkpointer(tmp_path / "checkpoints", save_every=1) as ck:
    for step in (2, 4):
      ck.save(step, {"params": at[step]})
  got = experiment.trained_params(config, str(tmp_path))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(at[4])):
    np.testing.assert_array_equal(a, b)
  # The final step gone (a run stopped early): an error, not step 2.
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(tmp_path / "checkpoints" / "4")
  with pytest.raises(FileNotFoundError, match=(
      r"has no checkpoint of its final step 4: the run has not finished")):
    experiment.trained_params(config, str(tmp_path))


def test_tfds_carve_holds_out_the_first_tenth_of_the_share_trained_on():
  assert selection.tfds_carve() == {"train": "train[10%:100%]",
                                    "validation": "train[:10%]"}
  assert selection.tfds_carve(0.2) == {"train": "train[2%:20%]",
                                       "validation": "train[:2%]"}
  for bad in (0, 1.5):
    with pytest.raises(ValueError, match=f"fraction={bad}: the share"):
      selection.tfds_carve(bad)


def test_glue_tune_tfds_chooses_on_carved_train_and_reports_dev(
    tmp_path, monkeypatch):
  # The paper scale's search, the trainer replaced: the search trains on
  # the fraction less its first tenth and is scored on that tenth; the
  # seeds train on the same part and are scored on dev. The carved tenth
  # favours lr 1e-4, dev 1e-3: the choice must be 1e-4.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.data import testing as data_testing  # pylint: disable=g-import-not-at-top
  vocab = data_testing.tiny_vocab(str(tmp_path / "vocab"))

  def config(mixer, seed):
    c = glue.glue_config("sst2", mixer, "paper", 1e-5, None, str(tmp_path),
                         seed=seed)
    c.data.vocab_path = vocab
    return c
  seen = []

  def fake_run(exp, c, key):
    carved = c.data.tfds_validation_split and c.eval_split == "validation"
    seen.append((key, c.data.tfds_train_split, c.data.tfds_validation_split,
                 c.eval_split, c.eval_every, c.learning_rate, c.seed))
    best = 1e-4 if carved else 1e-3
    return {"eval": {"accuracy": 0.9 - abs(np.log10(c.learning_rate / best))
                     / 10 + c.seed / 1000}}
  monkeypatch.setattr(glue, "run_cell", fake_run)
  exp = experiment.Experiment(tmp_path / "out",
                              argparse.Namespace(report_only=False))
  with tfds.testing.mock_data(num_examples=7,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    split, searched, chosen, runs = glue.tune_tfds(
        exp, ["hypermixer", "attention"], [0, 1, 2], config, "paper/sst2/",
        (1e-5, 1e-4, 1e-3), fraction=0.5)
  assert split["tfds"] == "glue/sst2/2.0.0"
  assert (split["train"]["split"], split["validation"]["split"]) == (
      "train[5%:50%]", "train[:5%]")
  assert split["validation"]["documents"] == 7   # mock_data ignores slices
  assert len(split["validation"]["sha256"]) == 64
  select = [s for s in seen if "/tune/" in s[0]]
  assert len(select) == 12 and all(
      s[1:5] == ("train[5%:50%]", "train[:5%]", "validation", 50_000)
      and s[6] == selection.SEED for s in select)
  assert chosen["hypermixer"] == chosen["attention"] == {
      "lr": 1e-4, "warmup": 1000, "warmup_share": 0.02}
  final = [s for s in seen if "/tuned/" in s[0]]
  assert [(s[1], s[2], s[3], s[5], s[6]) for s in final] == [
      ("train[5%:50%]", "", "validation", 1e-4, seed)
      for seed in (0, 1, 2)] * 2
  assert [r["seed"] for r in runs["attention"]] == [0, 1, 2]
  assert all(r["carved_validation_sha256"] == split["validation"]["sha256"]
             for rs in (*searched.values(), *runs.values()) for r in rs)


def test_paper_scales_report_the_seeds_at_the_carved_choice(tmp_path,
                                                            monkeypatch):
  # glue_from_scratch and low_resource at --scale=paper (no TFDS here):
  # every table cell is the seeds' dev accuracy at the setting glue.tune_tfds
  # chose, never a maximum over settings or evaluations on dev.
  gfs = script_modules.load("experiments/glue_from_scratch.py")
  calls = []

  def fake_tune(exp, mixers, seeds, config, prefix, lrs, *, fraction=1.0,
                reverse=False):
    calls.append((prefix, tuple(mixers), tuple(seeds), tuple(lrs), fraction,
                  config(mixers[0], seeds[0]).data.tfds_train_split))
    chosen = {m: {"lr": 3e-4, "warmup": 1, "warmup_share": 0.02}
              for m in mixers}
    # The last evaluation is below an earlier one: the report takes the last.
    runs = {m: [{"seed": s, "eval": {"accuracy": 0.5 + 0.1 * (m == "attention")
                                     + s / 100},
                 "eval_curve": {"1": {"accuracy": 0.99},
                                "2": {"accuracy": 0.5 + s / 100}}}
                for s in seeds] for m in mixers}
    return {}, {}, chosen, runs
  for script in (gfs, low_resource):
    monkeypatch.setattr(script.glue, "tune_tfds", fake_tune)
  monkeypatch.setattr(sys, "argv", [
      "x", f"--out={tmp_path / 'gfs'}", "--scale=paper", "--seeds=0,1,2",
      "--mixers=hypermixer,attention", f"--shared={tmp_path}"])
  gfs.main()
  assert [c[0] for c in calls] == [f"paper/{t}/" for t in glue.TASKS]
  assert all(c[1:5] == (("hypermixer", "attention"), (0, 1, 2),
                        glue.PAPER_LRS, 1.0) for c in calls)
  table = (tmp_path / "gfs" / "table.md").read_text()
  assert "| HyperMixer | 51.0 ± 1.0 (n=3) | 81.4 |" in table
  assert "99.0" not in table
  assert "chosen among 10 settings (seed 100) on the first tenth" in table
  calls.clear()
  monkeypatch.setattr(sys, "argv", [
      "x", f"--out={tmp_path / 'lr'}", "--scale=paper", "--seeds=0,1,2",
      f"--shared={tmp_path}"])
  low_resource.main()
  assert [(c[0], c[4]) for c in calls] == [
      (f"{t}/{p}pct/", p / 100) for t in ("mnli", "snli", "qqp")
      for p in (10, 20, 50, 100)]
  table = (tmp_path / "lr" / "table.md").read_text()
  assert "| mnli | 10% | 51.0 ± 1.0 (n=3) | 61.0 ± 1.0 (n=3) | -16.4% |" \
      in table
