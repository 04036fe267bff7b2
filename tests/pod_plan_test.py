"""The pod plan (experiment.pods, experiments/pod_plan.py): the grid's
bookkeeping (no compiles)."""
import json
import pathlib
import sys

import pytest

import script_modules

from hypermixer_jax.experiment import pods

pod_plan = script_modules.load("experiments/pod_plan.py")


def test_missing_lists_cells_not_compiled_and_leaves_out_inapplicable():
  names = ["glue_mlm_hypermixer", "smlp_base_64e"]
  presets, topologies = ["fsdp", "expert"], ["v4-32", "v5e-256"]
  done = {"glue_mlm_hypermixer|fsdp|v4-32": {}}
  # The expert preset needs experts: not a missing cell of the MLM config.
  assert pods.missing(done, names, presets, topologies).splitlines() == [
      "- glue_mlm_hypermixer: fsdp v5e-256",
      "- smlp_base_64e: all cells"]
  done = {f"{n}|{p}|{t}": {} for n in names for p in presets
          for t in topologies}
  assert pods.missing(done, names, presets, topologies) == "(none)"


def test_set_preset_meshes():
  c = pods.CONFIGS["smlp_base_64e"][0]()
  assert pods.set_preset(c, "expert", 256, 2)
  assert (c.mesh.data, c.mesh.expert) == (2, 64)
  c = pods.CONFIGS["glue_mlm_hypermixer"][0]()
  assert not pods.set_preset(c, "expert", 16, 1)
  assert pods.set_preset(c, "data_parallel", 16, 1)
  assert (c.mesh.data, c.mesh.fsdp, c.sharding.rules) == (-1, 1,
                                                          "data_parallel")


def test_host_rows_cores_a_host_needs():
  # A v5e-16 cell (4 hosts of 4 chips): batch 256 at an estimated 4 ms
  # step (HBM-bound: 819e9 B/s x 4e-3 s accessed, FLOPs and collectives
  # far below) consumes 64 rows of 128 tokens per host every 4 ms.
  cell = {"chip": "TPU v5e", "chips": 16, "mesh": {"fsdp": 16},
          "batch_size": 256, "flops": 1e9, "bytes_accessed": 819e9 * 4e-3,
          "collectives": {"all-gather": [1, 1000]},
          "collective_traffic_bytes": 1000.0}
  image = dict(cell, batch_size=1024)
  rows = pods.host_rows(
      {"m|fsdp|v5e-16": cell, "i|fsdp|v5e-16": image,
       "x|fsdp|v5e-16": {"error": "no"},
       "r|fsdp|v5e-16": {"fits": False, "refused": True, "batch_size": 8,
                         "chips": 16, "temp_bytes": 2**35,
                         "hbm_bytes": 2**34}},
      {"c4_mlm": 1000.0, "imagenet_patches": 50.0},
      pipelines={"m": ("c4_mlm", 128), "i": ("imagenet_patches", 0)})
  assert len(rows) == 2
  text, img = rows
  assert text[3:8] == ["64 x 128", "4.0", f"{64 * 128 / 4e-3:,.0f}",
                       "tokens", "c4_mlm"]
  # One core supplies 1,000 rows of RATE_SEQ_LEN (128) tokens per second.
  assert text[8] == f"{1000 * pods.RATE_SEQ_LEN:,.0f}"
  assert text[9] == f"{64 * 128 / 4e-3 / (1000 * 128):.1f}"
  assert img[3] == "256" and img[6] == "images"
  assert img[9] == f"{256 / 4e-3 / 50:.1f}"
  # The configurations name their own pipelines.
  assert pods.pipeline_of("bert_mlm_attention") == ("c4_mlm packed", 128)
  assert pods.pipeline_of("bert_mlm_hypermixer") == ("c4_mlm", 128)
  assert pods.pipeline_of("causal_lm_hypermixer") == ("c4_lm packed", 1024)
  assert pods.pipeline_of("mixer_b16") == ("imagenet_patches", 0)


def test_a_cell_libtpu_refused_is_a_no_with_the_bytes_it_named():
  refused = {"fits": False, "refused": True, "batch_size": 256,
             "chips": 256, "temp_bytes": 33.54 * 2**30,
             "hbm_bytes": 15.75 * 2**30}
  table = pods.table({"smlp_base_64e|data_parallel|v5e-256": refused})
  [row] = [line for line in table.splitlines() if "smlp_base_64e" in line]
  assert "| **no** | > 33.54 / 15.75 (temporaries alone" in row
  assert "256 / -" in row


def test_estimate_takes_the_matmul_flops_and_flags_loop_heavy_cells():
  # v5e: 197 TFLOP/s bf16 peak, 819 GB/s HBM. XLA counted 1 TFLOP per chip,
  # the jaxpr's matmuls 2: the compute term and the MFU follow the matmuls.
  from hypermixer_jax.train import compile as tc  # pylint: disable=g-import-not-at-top
  cell = {"chip": "TPU v5e", "chips": 16, "mesh": {"fsdp": 16},
          "flops": 1e12, "matmul_flops": 2e12, "bytes_accessed": 1e6,
          "collectives": {}, "collective_traffic_bytes": 0.0}
  peak = tc.metrics_lib.peak_flops("TPU v5e")
  times, step, mfu = tc.estimate(cell)
  assert times["compute"] == step == 2e12 / peak and mfu == 1.0
  assert pods.loop_heavy(cell)
  # A cell recorded before the matmul count keeps XLA's.
  old = {k: v for k, v in cell.items() if k != "matmul_flops"}
  assert tc.estimate(old)[1] == 1e12 / peak and not pods.loop_heavy(old)
  assert not pods.loop_heavy(dict(cell, matmul_flops=1.05e12))


def test_two_processes_share_the_grid_and_the_old_layout_moves(
    tmp_path, monkeypatch, capsys):
  import json  # pylint: disable=g-import-not-at-top
  out = tmp_path / "plan"
  out.mkdir()
  done = "glue_mlm_hypermixer|fsdp|v4-32"
  # The earlier layout: cells at the top of results.json.
  (out / "results.json").write_text(json.dumps({done: {"skipped": "x"}}))
  compiled = []

  def fake(name, preset, topo):
    key = f"{name}|{preset}|{topo}"
    if key.endswith("v5e-256"):
      raise ValueError("fsdp does not divide 196\nmore\nadvice")
    compiled.append(key)
    return {"skipped": "fake"}     # a row the table leaves out
  monkeypatch.setattr(pods, "run_cell", fake)
  grid = ["--out", str(out), "--only", "glue_mlm_hypermixer", "--presets",
          "fsdp", "data_parallel", "--topologies", "v4-32", "v5e-256"]
  monkeypatch.setattr(sys, "argv", ["pod_plan.py", *grid, "--order",
                                    "reverse", "--cells", "1"])
  pod_plan.main()
  # --cells 1: the reverse process stops after the grid's last cell.
  first = json.loads((out / "results.json").read_text())["runs"]
  assert sorted(first) == sorted([
      done, "glue_mlm_hypermixer|data_parallel|v5e-256"])
  monkeypatch.setattr(sys, "argv", ["pod_plan.py", *grid])
  pod_plan.main()
  runs = json.loads((out / "results.json").read_text())["runs"]
  # The last cell by the reverse process, the rest by the forward one; the
  # recorded cell kept, none compiled twice.
  assert compiled == ["glue_mlm_hypermixer|data_parallel|v4-32"]
  assert sorted(runs) == sorted([
      done, "glue_mlm_hypermixer|fsdp|v5e-256",
      "glue_mlm_hypermixer|data_parallel|v4-32",
      "glue_mlm_hypermixer|data_parallel|v5e-256"])
  assert runs["glue_mlm_hypermixer|fsdp|v5e-256"]["error"] == (
      "ValueError: fsdp does not divide 196 / more / advice")
  capsys.readouterr()


def _corrected_cell(**kw):
  """A v5e-16 cell recompiled with the HBM traffic counted once: 1 TFLOP of
  matmuls per chip, 2 GB to HBM of which 0.4 GB the optimizer's, at global
  batch 256 (16 per chip), 1 GiB of temporaries on a 16 GiB chip."""
  cell = {"chip": "TPU v5e", "chips": 16, "mesh": {"fsdp": 16},
          "batch_size": 256, "flops": 1e12, "matmul_flops": 1e12,
          "bytes_accessed": 9e9, "hbm_traffic_bytes": 2e9,
          "hbm_bytes_by_part": {"optimizer": 4e8, "mixer": 1.6e9},
          "collectives": {"all-gather": [1, 1000]},
          "collective_traffic_bytes": 1000.0, "fits": True,
          "total_bytes": 2**30 + 2**28, "temp_bytes": 2**30,
          "hbm_bytes": 16 * 2**30, "est_max_batch": 3000, "loops": 0,
          "dtype": "bfloat16"}
  cell.update(kw)
  return cell


def test_estimate_uses_hbm_traffic_once_and_the_table_says_what_changed():
  from hypermixer_jax.train import compile as tc  # pylint: disable=g-import-not-at-top
  cell = _corrected_cell()
  times, _, _ = tc.estimate(cell)
  # 2e9 bytes at v5e's 819 GB/s, not XLA's 9e9.
  assert times["hbm"] == pytest.approx(2e9 / 819e9)
  cell["previous"] = pods.previous_of(
      "bert_mlm_hypermixer", {k: v for k, v in cell.items()
                              if k not in ("hbm_traffic_bytes", "dtype")})
  assert cell["previous"]["est_step_s"] == pytest.approx(9e9 / 819e9)
  note = pods.change_note(cell)
  assert note.startswith(f"was {cell['previous']['est_mfu']:.0%} (hbm, ")
  assert "HBM counted once" in note and "float32 -> bfloat16" in note
  [row] = [line for line in pods.table({"m|fsdp|v5e-16": cell}
                                       ).splitlines() if "| m |" in line]
  assert "| 1.86 / 8.38 |" in row        # GiB once / XLA's


def test_redo_recompiles_only_cells_without_hbm_traffic_and_keeps_previous(
    tmp_path, monkeypatch, capsys):
  import json  # pylint: disable=g-import-not-at-top
  fresh = _corrected_cell(batch_size=512)
  old = {k: v for k, v in _corrected_cell().items()
         if k not in ("hbm_traffic_bytes", "dtype")}
  runs = {"bert_mlm_gmlp|fsdp|v4-32": old,
          "gmlp_b|fsdp|v4-32": _corrected_cell(),
          "mixer_b16|fsdp|v4-32": {"error": "ValueError: no"}}
  (tmp_path / "results.json").write_text(json.dumps({"runs": runs}))
  compiled = []

  def fake(name, preset, topo):
    compiled.append(f"{name}|{preset}|{topo}")
    return dict(fresh)
  monkeypatch.setattr(pods, "run_cell", fake)
  exp = pods.open_results(str(tmp_path))
  # Without --redo a recorded cell is left alone, whatever it holds.
  assert not pods.record_cell(exp, "bert_mlm_gmlp", "fsdp", "v4-32")
  # With it, only the compiled record that lacks the HBM traffic.
  for key in runs:
    pods.record_cell(exp, *key.split("|"), redo=True)
  assert compiled == ["bert_mlm_gmlp|fsdp|v4-32"]
  saved = json.loads((tmp_path / "results.json").read_text())["runs"]
  redone = saved["bert_mlm_gmlp|fsdp|v4-32"]
  assert redone["batch_size"] == 512 and "hbm_traffic_bytes" in redone
  assert redone["previous"] == pods.previous_of("bert_mlm_gmlp", old)
  assert redone["previous"]["dtype"] == "float32"
  assert saved["gmlp_b|fsdp|v4-32"] == runs["gmlp_b|fsdp|v4-32"]
  assert "recompiled" in capsys.readouterr().out


def test_recommendation_picks_the_best_corrected_cell_and_its_budget():
  from hypermixer_jax.train import compile as tc  # pylint: disable=g-import-not-at-top
  good = _corrected_cell()
  worse = _corrected_cell(hbm_traffic_bytes=8e9)
  old = {k: v for k, v in _corrected_cell(flops=9e12).items()
         if k != "hbm_traffic_bytes"}    # not recompiled: left out
  results = {"gmlp_b|fsdp|v5e-16": good, "gmlp_b|data_parallel|v5e-16":
             worse, "gmlp_b|fsdp_tensor|v5e-16": old}
  rows = pods.recommend_rows(results, topologies=("v5e-16", "v4-32"),
                             pipelines={"gmlp_b": ("imagenet", 0)})
  gmlp = [r for r in rows if r[0] == "gmlp_b"]
  assert gmlp[0][2] == "fsdp" and gmlp[1][2].startswith("not compiled")
  _, step, _ = tc.estimate(good)
  rate = 256 / step
  assert gmlp[0][6] == f"{rate:,.0f} images/s"
  assert gmlp[0][7] == f"{300 * 1_281_167 / rate * 16 / 3600:,.0f}"
  assert len(rows) == 2 * len(pods.RECOMMENDED) <= 20


def test_suggested_batch_where_fixed_traffic_holds_mfu_down():
  from hypermixer_jax.train import compile as tc  # pylint: disable=g-import-not-at-top
  # Optimizer traffic dominates: 8 GB fixed, 0.1 GB that grows with the
  # batch. Doubling the batch nearly doubles MFU until compute binds.
  cell = _corrected_cell(hbm_traffic_bytes=8.1e9,
                         hbm_bytes_by_part={"optimizer": 8e9})
  best, better, now, ceiling = tc.suggest_batch(cell)
  assert best > 256 and better >= 1.25 * now and ceiling == 1.0
  peak = tc.metrics_lib.peak_flops("TPU v5e")
  step = 8.1e9 / 819e9
  assert now == pytest.approx(1e12 / peak / step)
  assert "holds MFU down" in tc.batch_advice(cell)
  assert f"--config.batch_size={best}" in tc.batch_advice(cell)
  # All the traffic grows with the batch: no batch helps, and it says so.
  wide = _corrected_cell(hbm_traffic_bytes=40e9, hbm_bytes_by_part={
      "mixer": 40e9})
  best, better, now, ceiling = tc.suggest_batch(wide)
  assert best == 256 and now == pytest.approx(ceiling)
  assert tc.batch_advice(wide).startswith("not the batch (16 examples per "
                                          "chip)")


def test_committed_pages_are_what_the_record_generates():
  """recommended.md and hosts.md beside the pod plan's record are its report
  code's output over the committed results.json, never edited by hand."""
  folder = pathlib.Path(__file__).resolve().parent.parent / (
      "experiments/results/pod_plan")
  runs = json.loads((folder / "results.json").read_text())["runs"]
  assert (folder / "recommended.md").read_text().rstrip("\n") == (
      pods.RECOMMEND_HEAD + pods.recommend_table(runs)).rstrip("\n")
  assert (folder / "hosts.md").read_text().rstrip("\n") == pods.host_table(
      runs, pods.PIPELINE_RATES).rstrip("\n")
