"""experiments/accelerator_kit.py at toy size on CPU (what CI can run)."""
import json

import pytest

from hypermixer_jax.experiment import kit as kit_lib
import script_modules

kit = script_modules.load("experiments/accelerator_kit.py")


@pytest.fixture
def steps_traced_once(monkeypatch):
  """``compile.trace_train_step`` traces each (config, devices, batch) once:
  the sMLP / Switch section traces a step to count its matmul FLOPs when it
  picks the Switch depth and again when it times that step."""
  traced = {}
  trace = kit_lib.tc.trace_train_step

  def cached(config, devices, batch_size=None):
    key = (config.to_json(), tuple(devices), batch_size)
    if key not in traced:
      traced[key] = trace(config, devices, batch_size)
    return traced[key]
  monkeypatch.setattr(kit_lib.tc, "trace_train_step", cached)


@pytest.mark.slow
@pytest.mark.usefixtures("steps_traced_once")
def test_toy_run_writes_every_section(tmp_path):
  kit.main(["--toy", "--mixers", "hypermixer", "--out", str(tmp_path)])
  r = json.loads((tmp_path / "results.json").read_text())
  assert r["toy"] and r["dtype"] == "float32"
  step = r["mlm_mfu"]["hypermixer"]
  # 4 rows of 32 tokens per step; no peak is known for a CPU, so no MFU.
  assert step["tokens_per_s"] * step["step_s"] == pytest.approx(4 * 32)
  assert r["peak_flops"] is None and step["mfu"] is None
  # The matmuls are part of XLA's count (which adds the elementwise work).
  assert 0 < step["matmul_flops"] <= 1.05 * step["xla_flops"]
  row = r["token_mixing"]["64"]
  assert row["batch"] == 256 // 64       # tokens per call / N
  for name in ("hypermixing", "attention"):
    assert row[name]["forward_s"] > 0 and row[name]["forward_backward_s"] > 0
  # Attention is timed as the module HyperMixing stands in for, its
  # projections included, and the table says so.
  assert row["attention_timed"] == kit_lib.ATTENTION_TIMED
  # The Switch Transformer's depth is the one closest to sMLP's FLOPs.
  sw = r["smlp_vs_switch"]
  assert sw["switch"]["num_dense_layers"] >= 1
  assert abs(sw["switch"]["matmul_flops"] - sw["smlp"]["matmul_flops"]) < (
      0.5 * sw["smlp"]["matmul_flops"])
  assert "| hypermixer |" in (tmp_path / "table.md").read_text()
  assert set(r["runs"]) == set(kit_lib.SECTIONS[:3])   # profile: asked for
  # A rerun of one section replaces its rows and keeps the others.
  before = r["mlm_mfu"]
  kit.main(["--toy", "--sections", "token_mixing", "--lengths", "32",
            "--out", str(tmp_path)])
  again = json.loads((tmp_path / "results.json").read_text())
  assert again["mlm_mfu"] == before
  assert list(again["token_mixing"]) == ["64", "32"]
  assert [r["rows"] for r in again["runs"]["token_mixing"]] == [["64"], ["32"]]
  assert again["runs"]["mlm_mfu"] == r["runs"]["mlm_mfu"]
  table = kit.main(["--report_only", "--out", str(tmp_path)])
  assert table == again


def test_a_failing_row_is_recorded_not_fatal():
  got = kit_lib.guarded(lambda: 1 / 0)
  assert got["error"].startswith("ZeroDivisionError: division by zero")


def test_a_record_of_another_device_kind_is_never_overwritten(tmp_path):
  (tmp_path / "results.json").write_text(json.dumps(
      {"device": "gpu:H200 (16 host cores visible)", "toy": False,
       "mlm_mfu": {"x": {}}}))
  # pylint: disable=protected-access
  # The host's setup (allocator, XLA flags) may differ: same device kind.
  same = "gpu:H200 (16 host cores visible; XLA_FLAGS='--a=')"
  assert kit._earlier(str(tmp_path), same, False)["mlm_mfu"]
  for device, toy in (("cpu:cpu (2 host cores visible)", False),
                      (same, True)):
    with pytest.raises(SystemExit, match="results.json holds runs on "
                       "'gpu:H200.*pass another --out"):
      kit._earlier(str(tmp_path), device, toy)


def _mfu_row(tflops):
  return {"step_s": 0.1, "tokens_per_s": 1.0, "mfu": 0.1,
          "tflops_per_s": tflops}


def test_each_row_keeps_the_run_that_measured_it():
  # A record from before rows were tracked: one run of every row.
  results = {"mlm_mfu": {"a": _mfu_row(100.0), "b": _mfu_row(100.0)},
             "runs": {"mlm_mfu": {"date": "d0", "matmul_flops_per_s": 500e12}}}
  results["mlm_mfu"]["b"] = _mfu_row(300.0)      # b measured again
  kit_lib.add_run(results, "mlm_mfu", {"date": "d1", "rows": ["b"],
                                       "matmul_flops_per_s": 600e12})
  assert kit_lib.run_of(results, "mlm_mfu", "a")["date"] == "d0"
  assert kit_lib.run_of(results, "mlm_mfu", "b")["date"] == "d1"
  # Each row's MFU against the ceiling its own run measured.
  table = kit_lib.table(results)
  assert "| a | 100.0 | 1 | 10.0% | 20.0% |" in table
  assert "| b | 100.0 | 1 | 10.0% | 50.0% |" in table
  # Once every row of the first run is measured again, that run is dropped.
  kit_lib.add_run(results, "mlm_mfu", {"date": "d2", "rows": ["a"]})
  assert [r["date"] for r in kit_lib.section_runs(results, "mlm_mfu")] == [
      "d1", "d2"]


def test_profile_splits_a_step_by_model_part():
  c = kit_lib._mlm_config("hypermixer", True, "float32")  # pylint: disable=protected-access
  r = kit_lib.profile_step(c, 2, steps=1, top=5)
  parts = r["by_part_s"]
  assert sum(parts.values()) == pytest.approx(r["device_s_per_step"])
  # A train step's instructions come from the model's parts, its loss and
  # its optimizer (not all "other").
  assert {"mixer", "feed-forward", "optimizer"} <= set(parts), parts
  assert parts.get("other", 0) < 0.5 * r["device_s_per_step"]
  tops = [o["s_per_step"] for o in r["top"]]
  assert len(tops) == 5 and tops == sorted(tops, reverse=True)
  assert "profile" not in kit_lib.profile_table({"x": r}).split("\n")[0]
  assert "| x |" in kit_lib.profile_table({"x": r})
