"""experiments/pod_plan.py: the grid's bookkeeping (no compiles)."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent
                       / "experiments"))
import pod_plan  # noqa: E402  pylint: disable=g-import-not-at-top


def test_missing_lists_cells_not_compiled_and_leaves_out_inapplicable():
  names = ["glue_mlm_hypermixer", "smlp_base_64e"]
  presets, topologies = ["fsdp", "expert"], ["v4-32", "v5e-256"]
  done = {"glue_mlm_hypermixer|fsdp|v4-32": {}}
  # The expert preset needs experts: not a missing cell of the MLM config.
  assert pod_plan.missing(done, names, presets, topologies).splitlines() == [
      "- glue_mlm_hypermixer: fsdp v5e-256",
      "- smlp_base_64e: all cells"]
  done = {f"{n}|{p}|{t}": {} for n in names for p in presets
          for t in topologies}
  assert pod_plan.missing(done, names, presets, topologies) == "(none)"


def test_set_preset_meshes():
  c = pod_plan.CONFIGS["smlp_base_64e"][0]()
  assert pod_plan.set_preset(c, "expert", 256, 2)
  assert (c.mesh.data, c.mesh.expert) == (2, 64)
  c = pod_plan.CONFIGS["glue_mlm_hypermixer"][0]()
  assert not pod_plan.set_preset(c, "expert", 16, 1)
  assert pod_plan.set_preset(c, "data_parallel", 16, 1)
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
  rows = pod_plan.host_rows(
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
  assert text[8] == f"{1000 * pod_plan.RATE_SEQ_LEN:,.0f}"
  assert text[9] == f"{64 * 128 / 4e-3 / (1000 * 128):.1f}"
  assert img[3] == "256" and img[6] == "images"
  assert img[9] == f"{256 / 4e-3 / 50:.1f}"
  # The configurations name their own pipelines.
  assert pod_plan.pipeline_of("bert_mlm_attention") == ("c4_mlm packed", 128)
  assert pod_plan.pipeline_of("bert_mlm_hypermixer") == ("c4_mlm", 128)
  assert pod_plan.pipeline_of("causal_lm_hypermixer") == ("c4_lm packed",
                                                          1024)
  assert pod_plan.pipeline_of("mixer_b16") == ("imagenet_patches", 0)


def test_a_cell_libtpu_refused_is_a_no_with_the_bytes_it_named():
  refused = {"fits": False, "refused": True, "batch_size": 256,
             "chips": 256, "temp_bytes": 33.54 * 2**30,
             "hbm_bytes": 15.75 * 2**30}
  table = pod_plan.table({"smlp_base_64e|data_parallel|v5e-256": refused})
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
  assert pod_plan.loop_heavy(cell)
  # A cell recorded before the matmul count keeps XLA's.
  old = {k: v for k, v in cell.items() if k != "matmul_flops"}
  assert tc.estimate(old)[1] == 1e12 / peak and not pod_plan.loop_heavy(old)
  assert not pod_plan.loop_heavy(dict(cell, matmul_flops=1.05e12))


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
  monkeypatch.setattr(pod_plan, "run_cell", fake)
  grid = ["--out", str(out), "--only", "glue_mlm_hypermixer", "--presets",
          "fsdp", "data_parallel", "--topologies", "v4-32", "v5e-256"]
  monkeypatch.setattr(sys, "argv", ["pod_plan.py", *grid, "--order",
                                    "reverse", "--cells", "1"])
  pod_plan.main()
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
