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
