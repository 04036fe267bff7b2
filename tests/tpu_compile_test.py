"""Compiling for TPU topologies without a TPU (``train/compile.py``).

The compiles need libtpu (the ``[tpu]`` extra); without it those tests skip
with the reason. The parser, the batch search and the abstract batch need
nothing but jax.
"""
import importlib.util
import os
import pathlib
import re

import jax
import numpy as np
import pytest

from hypermixer_jax import data
from hypermixer_jax.models import zoo
from hypermixer_jax.train import compile as tc

# Compiles for TPU take most of this file's ~60 s: scheduled first.
pytestmark = pytest.mark.slow

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def _config(name: str, arg: str):
  spec = importlib.util.spec_from_file_location(name, CONFIGS / name)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


def tiny(family: str, preset: str = "fsdp", layers: int = 1):
  """Tiny configs of each family, dimensions distinct multiples of 8.

  One layer (XLA:TPU's compile time grows with the layers: two take about
  twice as long) unless a test needs a stack (``layers``), and the text
  family's 136-id vocabulary for sMLP too: its pipeline's 32,128 ids add a
  third to the compile and nothing to what is checked."""
  if family == "text":
    c = _config("c4_mlm.py", "hypermixer")
    c.model.update(num_layers=layers, d_model=40, d_ffn=56, vocab_size=136,
                   max_len=24)
    c.model.mixer_kwargs.hyper_dim = 24
    c.data.seq_len = 24
  elif family == "continuous":
    c = _config("imagenet.py", "gmlp_ti")
    c.model.update(num_layers=layers, d_model=40, d_ffn=48, max_len=16,
                   input_dim=24, num_classes=8)
  else:
    c = _config("smlp_lm.py", "tiny")
    c.model.vocab_size = 136
  c.batch_size = c.eval_batch_size = 16
  c.sharding.rules = preset
  c.mesh.data, c.mesh.fsdp = (-1, 1) if preset == "data_parallel" else (1, -1)
  if preset == "expert":
    c.mesh.fsdp, c.mesh.expert = 2, -1
  return c


_DEVICES = {}
_COMPILED = {}
_REPORTED = {}


def devices_of(name: str):
  """The compile-only devices of ``name``; skips where libtpu cannot load."""
  if name not in _DEVICES:
    try:
      _DEVICES[name] = tc.topology_devices(name)
    except ValueError as e:
      pytest.skip(f"libtpu cannot describe TPU topologies here: {e}")
  return _DEVICES[name]


def compiled(name: str, family: str, preset: str = "fsdp", batch: int = 16,
             with_eval: bool = False, layers: int = 1) -> tc.Compiled:
  """``compile_steps`` of a tiny config, shared by the tests (compiles are
  the slow part)."""
  key = (name, family, preset, batch, with_eval, layers)
  if key not in _COMPILED:
    _COMPILED[key] = tc.compile_steps(tiny(family, preset, layers),
                                      devices_of(name), batch_size=batch,
                                      with_eval=with_eval)
  return _COMPILED[key]


def reported(name: str, family: str, preset: str = "fsdp", batch: int = 16,
             with_eval: bool = False, layers: int = 1) -> dict:
  """``tc.report`` of ``compiled(...)``, made once per compile: it reads the
  executable's HLO text (a second or so each time)."""
  key = (name, family, preset, batch, with_eval, layers)
  if key not in _REPORTED:
    _REPORTED[key] = tc.report(compiled(*key))
  return _REPORTED[key]


@pytest.mark.parametrize("family,name", [
    ("text", "v4:2x2x1"), ("continuous", "v4:2x2x1"),
    ("text", "v5e:2x4"), ("smlp", "v5e:2x4")])
def test_each_family_compiles_for_tpu(family, name):
  preset = "expert" if family == "smlp" else "fsdp"
  # The text model's eval step once (its compile is shared with the next
  # tests); compiles dominate this file's time. The text model on v4 is the
  # two-layer stack that the scanned-layers test compares with.
  with_eval = (family, name) == ("text", "v5e:2x4")
  layers = 2 if (family, name) == ("text", "v4:2x2x1") else 1
  r = reported(name, family, preset, with_eval=with_eval, layers=layers)
  assert r["chips"] == (4 if name.startswith("v4") else 8)
  assert r["chip"] == ("TPU v4" if name.startswith("v4") else "TPU v5e")
  assert r["fits"] and r["flops"] > 0 and r["est_mfu"] > 0
  # Parameters are sharded: some all-gather before use.
  assert r["collectives"]["all-gather"][0] > 0
  # A chip sends about (n-1)/n of what it gathers, and more for the
  # gradients' reduction: at least the gathers' share, at most twice all.
  gathered = r["collectives"]["all-gather"][1]
  assert 0.5 * gathered <= r["collective_traffic_bytes"] <= 2 * sum(
      b for _, b in r["collectives"].values())
  assert r["params"] == zoo.count_params(tiny(family, layers=layers).model)
  if family == "smlp":
    # Experts over the "expert" axis dispatch with all-to-all on TPU.
    assert r["collectives"]["all-to-all"][0] > 0
  if with_eval:
    assert 0 < r["eval_flops"] < r["flops"]


def test_matmul_flops_are_the_same_work_under_every_preset():
  # Per chip, data parallelism and fsdp do the same matmuls; XLA's own
  # count may differ (its loops), the jaxpr's may not.
  dp = reported("v5e:2x4", "text", "data_parallel")
  fsdp = reported("v5e:2x4", "text", "fsdp", with_eval=True)
  assert dp["matmul_flops"] == pytest.approx(fsdp["matmul_flops"], rel=1e-6)
  # Without loops XLA counts the matmuls and the elementwise work (most of
  # this tiny model's): a part of it, not all.
  assert dp["loops"] == 0
  assert 0.25 * dp["flops"] < dp["matmul_flops"] < dp["flops"]


def test_fsdp_holds_an_eighth_data_parallel_all():
  # Counted from the model's own shapes: every matrix is split 8 ways under
  # fsdp here, vectors (biases, LayerNorm) may stay whole.
  params = jax.tree.leaves(zoo.abstract_variables(tiny("text").model))
  matrices = sum(x.size for x in params if x.ndim >= 2) * 4  # float32
  vectors = sum(x.size for x in params if x.ndim < 2) * 4
  full = matrices + vectors
  dp = reported("v5e:2x4", "text", "data_parallel")
  fsdp = reported("v5e:2x4", "text", "fsdp", with_eval=True)
  assert dp["param_bytes"] == full
  assert matrices / 8 + vectors / 8 <= fsdp["param_bytes"]
  assert fsdp["param_bytes"] <= matrices / 8 + vectors
  # Adam's two moments follow their parameters.
  assert dp["opt_bytes"] >= 2 * full
  assert fsdp["opt_bytes"] <= 2 * (matrices / 8 + vectors) + 64
  # The executable's arguments (state and batch, in TPU tiles that pad
  # these tiny vectors) hold at least the state, and shrink under fsdp.
  for r in (dp, fsdp):
    assert r["param_bytes"] + r["opt_bytes"] <= r["argument_bytes"]
  assert fsdp["argument_bytes"] < dp["argument_bytes"] / 2


def test_oversized_batch_is_refused_with_what_fits(monkeypatch, capsys):
  devices = devices_of("v5e:2x4")
  total = {b: reported("v5e:2x4", "text", "fsdp", b,
                       with_eval=b == 16)["total_bytes"]
           for b in (8, 16)}
  assert total[8] < total[16]
  # A chip between the two: batch 16 does not fit, 8 does (the search
  # itself: test_largest_batch_matches_brute_force).
  small = tc.Chip("TPU v5e", (total[8] + total[16]) / 2, 819e9, 400e9)
  monkeypatch.setitem(tc.CHIPS, "v5e", small)
  monkeypatch.setattr(tc, "topology_devices", lambda *a: devices)
  monkeypatch.setattr(
      tc, "compile_steps",
      lambda c, d, batch_size=None, with_eval=True, progress=None:
      compiled("v5e:2x4", "text", "fsdp", batch_size or 16, with_eval))
  with pytest.raises(tc.DoesNotFit) as e:
    tc.compile_for_topology(tiny("text", "fsdp"), "v5e:2x4")
  msg = str(e.value)
  assert msg.startswith("text model at batch 16 needs ")
  assert "largest buffers " in msg
  assert "--config.batch_size=8 fits" in msg
  # The search says what it tries, with the elapsed time.
  assert re.search(r"compile: batch 16 does not fit; trying 8 \(\d+ s\)",
                   capsys.readouterr().err)


def test_batch_libtpu_refuses_to_compile_is_a_does_not_fit(monkeypatch):
  """Where the temporaries alone exceed the HBM, libtpu's compiler raises
  RESOURCE_EXHAUSTED instead of returning a program: that is a DoesNotFit
  too, with the bytes it names and the largest batch that compiles."""
  devices = devices_of("v5e:2x4")
  try:   # 8M rows of 24 tokens, one layer: ~54 GiB of temporaries per
    compiled("v5e:2x4", "text", "fsdp", 2**23)   # 16 GiB chip
    pytest.fail("libtpu compiled a program larger than the chip's HBM")
  except Exception as e:  # pylint: disable=broad-except
    refusal = e
  temp, hbm = tc.hbm_refusal(refusal)
  assert temp > 2 * hbm > 0
  assert tc.hbm_refusal(ValueError("RESOURCE_EXHAUSTED: other")) is None
  fitting = compiled("v5e:2x4", "text", "fsdp", 8)

  def compile_steps(c, d, batch_size=None, with_eval=True, progress=None):
    del c, d, with_eval, progress
    if (batch_size or 16) > 8:
      raise refusal                    # what libtpu raised above
    return fitting
  monkeypatch.setattr(tc, "topology_devices", lambda *a: devices)
  monkeypatch.setattr(tc, "compile_steps", compile_steps)
  with pytest.raises(tc.DoesNotFit) as e:
    tc.compile_for_topology(tiny("text", "fsdp"), "v5e:2x4")
  msg = str(e.value)
  assert msg.startswith("text model at batch 16 needs ")
  # libtpu's figure is the program's total (arguments and outputs in it),
  # and the state's share comes from the abstract state.
  assert f"needs {tc._gib(temp)} per chip on v5e:2x4" in msg
  assert "libtpu's total, which refused to compile it" in msg
  state = fitting.state
  assert (f"parameters {tc._gib(tc._per_chip_bytes(state.params))}, "
          f"optimizer {tc._gib(tc._per_chip_bytes(state.opt_state))}") in msg
  assert "--config.batch_size=8 fits" in msg
  # Any other compile error is not taken for a refusal.
  monkeypatch.setattr(tc, "compile_steps",
                      lambda *a, **k: (_ for _ in ()).throw(
                          RuntimeError("INTERNAL: something else")))
  with pytest.raises(RuntimeError, match="something else"):
    tc.compile_for_topology(tiny("text", "fsdp"), "v5e:2x4")


def test_fit_advice_offers_remat_where_activations_dominate():
  c = tiny("text")
  heavy = {"temp_bytes": 10, "param_bytes": 2, "opt_bytes": 4,
           "hbm_bytes": 12}
  light = dict(heavy, temp_bytes=5)
  assert "--config.model.remat=full" in tc.fit_advice(c, heavy, 8)
  assert "--config.batch_size=8 fits" in tc.fit_advice(c, heavy, 8)
  assert "remat" not in tc.fit_advice(c, light, 8)
  assert tc.fit_advice(c, light, 0).startswith("no batch fits")
  # The state alone over the HBM: recomputing activations cannot help.
  full = dict(heavy, param_bytes=5, opt_bytes=10, temp_bytes=40)
  advice = tc.fit_advice(c, full, 0)
  assert "remat" not in advice and "alone" in advice
  assert advice.startswith("no batch fits: shard the parameters")
  c.model.remat = "full"                # already recomputing
  assert "remat" not in tc.fit_advice(c, heavy, 8)


def test_largest_batch_matches_brute_force():
  for limit in (0, 3, 8, 9, 40, 63, 64, 100):
    for start, step in ((64, 1), (64, 8), (96, 8), (16, 8), (100, 8)):
      want = max([b for b in range(step, start, step) if b <= limit],
                 default=0)
      calls = []

      def fits(b, limit=limit, calls=calls):
        calls.append(b)
        return b <= limit
      assert tc.largest_batch(fits, start, step) == want, (limit, start, step)
      assert len(calls) <= 2 * max(1, (start // step).bit_length())


HLO = """
ENTRY %main {
  %all-gather.4 = bf16[512,256]{0,1:T(8,128)(2,1)} all-gather(%p0), channel_id=53
  %all-reduce.1 = (f32[768]{0:T(1024)}, /*index=1*/f32[]{:T(128)}) all-reduce(%a, %b), channel_id=2
  %collective-permute-start = (f32[16,512]{1,0}, f32[16,512]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), channel_id=77
  %collective-permute-done = f32[16,512]{1,0:T(8,128)S(1)} collective-permute-done(%collective-permute-start)
  ROOT %all-to-all = s32[3,5,7]{2,1,0} all-to-all(%copy), channel_id=5
  %fusion.all-gather = f32[9] fusion(%y), kind=kLoop
}
"""


def test_collectives_parse_kinds_and_bytes():
  got = tc.collectives(HLO)
  assert got == {"all-gather": (1, 512 * 256 * 2),
                 "all-reduce": (1, 768 * 4 + 4),
                 "reduce-scatter": (0, 0),
                 "all-to-all": (1, 3 * 5 * 7 * 4),
                 "collective-permute": (1, 16 * 512 * 4)}
  assert tc.largest_buffers(HLO, 1) == [(512 * 256 * 2, "bf16[512,256]")]


# The replica-group forms XLA prints, each with its group size.
TRAFFIC_HLO = """
  %all-gather.4 = bf16[512,256]{0,1} all-gather(%p0), channel_id=53, replica_groups=mesh['axis_0'=2,'axis_1'=16] {'axis_1'}, dimensions={0}
  %all-reduce.1 = (f32[768]{0}, f32[256]{0}) all-reduce(%a, %b), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0','axis_2'}, to_apply=%add
  %reduce-scatter.2 = f32[64]{0} reduce-scatter(%c), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}
  %all-to-all.3 = s32[3,5,8]{2,1,0} all-to-all(%d), channel_id=5, replica_groups={{0,1},{2,3}}
  %all-gather-start = (f32[4]{0}, f32[32]{0}) all-gather-start(%e), channel_id=6, replica_groups={}, dimensions={0}
  %all-gather-done = f32[32]{0} all-gather-done(%all-gather-start)
  %collective-permute = f32[16,512]{1,0} collective-permute(%x), channel_id=77, source_target_pairs={{0,1},{1,0}}
"""


def test_collective_traffic_reads_each_group_form():
  assert tc.group_size("replica_groups=mesh['a'=2,'b'=16] {'b'}", 64) == 16
  assert tc.group_size("replica_groups=mesh['a'=4,'b'=1,'c'=2] {'a','c'}",
                       64) == 8
  assert tc.group_size("replica_groups=[2,4]<=[8]", 64) == 4
  assert tc.group_size("replica_groups={{0,1,2},{3,4,5}}", 64) == 3
  assert tc.group_size("replica_groups={}", 64) == 64
  got = tc.collective_traffic(TRAFFIC_HLO, devices=8)
  # all-gather: (n-1)/n of its result, n = 16 (axis_1), plus the async
  # pair's f32[32] over every device (n = 8, read from its -start).
  assert got["all-gather"] == pytest.approx(
      512 * 256 * 2 * 15 / 16 + 32 * 4 * 7 / 8)
  # all-reduce: twice (n-1)/n over axis_0 x axis_2 (n = 8).
  assert got["all-reduce"] == pytest.approx(2 * (768 + 256) * 4 * 7 / 8)
  # reduce-scatter: (n-1) results (its input is n of them), n = 4.
  assert got["reduce-scatter"] == pytest.approx(64 * 4 * 3)
  assert got["all-to-all"] == pytest.approx(3 * 5 * 8 * 4 / 2)
  assert got["collective-permute"] == 16 * 512 * 4
  assert tc.traffic_factor("all-reduce", 1) == 0.0


def test_gpu_and_unknown_topologies_are_refused():
  for gpu in ("gpu:8", "h100:8", "A100:2x4"):
    with pytest.raises(ValueError, match="GPU meshes cannot be compiled here"):
      tc.topology_devices(gpu)
  with pytest.raises(ValueError, match=r"generation 'v3' is not one of"):
    tc.topology_devices("v3:4x4")


def test_abstract_batch_matches_the_pipeline(shared_data):
  c = _config("c4_mlm.py", "hypermixer")
  c.data.update(vocab_path=str(shared_data / "t5_spm/sentencepiece.model"),
                seq_len=24)
  c.data.local_files.train = str(
      shared_data / "c4/c4_en_train_00000_first1000.jsonl")
  cases = [(c, "train"), (_config("default.py", ""), "validation")]
  for cfg, split in cases:
    real = next(iter(data.build_pipeline(cfg.data, split, batch_size=4,
                                         seed=0, repeat=False,
                                         shuffle=False)))
    spec = tc.abstract_batch(cfg, 4)
    assert sorted(spec) == sorted(real)
    for k, v in real.items():
      assert (spec[k].shape, spec[k].dtype) == (v.shape, np.dtype(v.dtype)), k


def test_scanned_layers_compile_with_the_same_state_and_flag_the_loop():
  # model.scan_layers: the same parameters and optimizer bytes per chip (the
  # stacked leaves shard like the unrolled ones, the layer axis whole), one
  # compiled layer body, and a report that says its costs read the loop
  # body once (XLA counts 3 layers' FLOPs as 1 here).
  unrolled = reported("v4:2x2x1", "text", layers=2)
  c = tiny("text", layers=2)
  c.model.scan_layers = True
  said = []
  r = tc.report(tc.compile_steps(c, devices_of("v4:2x2x1"), batch_size=16,
                                 with_eval=False, progress=said.append))
  # Compile mode says what it is doing, phase by phase.
  assert [w.split()[0] for w in said] == ["tracing", "lowering", "compiling",
                                          "counting"]
  assert r["params"] == unrolled["params"]
  assert r["param_bytes"] == unrolled["param_bytes"]
  assert r["opt_bytes"] == unrolled["opt_bytes"]
  assert r["fits"] and r["loops"] >= 1 and unrolled["loops"] == 0
  # XLA counts the scanned layers' body once; the jaxpr count does not.
  assert r["flops"] < unrolled["flops"]
  assert r["matmul_flops"] == unrolled["matmul_flops"] > 0
  assert r["uncounted_loops"] == 0
  assert r["est_mfu"] == pytest.approx(unrolled["est_mfu"], rel=0.5)
  # HBM traffic counts the layer loop by its trip count: close to the
  # unrolled step's, where XLA's FLOPs fall to about half.
  assert r["hbm_traffic_bytes"] == pytest.approx(
      unrolled["hbm_traffic_bytes"], rel=0.25)
  text = tc.format_report(r)
  assert "reads once" in text and "TFLOP of matmuls" in text
  assert "while loop" not in tc.format_report(unrolled)
  # The breakdown names the model's parts, and the parts add up.
  assert "by part" in text and "feed-forward" in text
  assert sum(r["hbm_bytes_by_part"].values()) == pytest.approx(
      r["hbm_traffic_bytes"])
  assert sum(r["matmul_flops_by_part"].values()) == pytest.approx(
      r["matmul_flops"])
  assert r["matmul_flops_by_part"]["mixer"] > 0



LOOP_HLO = """HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p.1), index=1
  %ag = f32[32]{0} all-gather(%x), channel_id=1, replica_groups={}, dimensions={0}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i2, %x)
}

%odd_cond (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] custom-call(%q), custom_call_target="x"
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %w2 = (s32[], f32[8]{0}) while(%init), condition=%odd_cond, body=%body
  %ar = f32[8]{0} all-reduce(%a), channel_id=2, replica_groups={}, to_apply=%add
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_collectives_in_loops_count_by_trip_count():
  # The body runs 4 times under %w (its condition compares a counter with
  # 4) and once more under %w2, whose condition says nothing: 5 gathers,
  # one loop of unknown trip count; the all-reduce outside runs once.
  times, unknown = tc.loop_multipliers(LOOP_HLO)
  assert times["main"] == 1 and times["body"] == 5 and unknown == 1
  got = tc.collectives(LOOP_HLO)
  assert got["all-gather"] == (5, 5 * 32 * 4)
  assert got["all-reduce"] == (1, 8 * 4)
  traffic = tc.collective_traffic(LOOP_HLO, 4)
  assert traffic["all-gather"] == 5 * 32 * 4 * tc.traffic_factor(
      "all-gather", 4)
  assert tc.count_loops(LOOP_HLO) == 2


def test_expert_parallel_matmuls_count_for_every_shard():
  # The expert preset runs the experts inside shard_map, whose body sees one
  # device's shard: counted once per device of its manual axes, the step's
  # matmuls equal fsdp's (traced only, no compile).
  from hypermixer_jax.train import flop_count  # pylint: disable=g-import-not-at-top
  counts = {}
  for preset in ("fsdp", "expert"):
    traced = tc.trace_train_step(tiny("smlp", preset), devices_of("v5e:2x4"),
                                 16)[0]
    counts[preset] = flop_count.count(traced.jaxpr).flops
  assert counts["expert"] == counts["fsdp"] > 0


@pytest.mark.parametrize("topology,slices,mesh", [
    ("v6e:16x16", 1, dict(data=1, fsdp=64, tensor=4, expert=1)),
    ("v6e:16x16", 1, dict(data=1, fsdp=4, tensor=1, expert=64)),
    ("v5e:16x16", 2, dict(data=2, fsdp=64, tensor=4, expert=1))])
def test_meshes_that_split_a_physical_axis_build(topology, slices, mesh):
  # JAX orders these without splitting a physical axis of the 16 x 16 torus
  # and finds no assignment (the fsdp_tensor and expert presets of the pod
  # plan failed there); build_mesh then lets an axis split one.
  from hypermixer_jax import sharding  # pylint: disable=g-import-not-at-top
  key = f"{topology}/{slices}"
  if key not in _DEVICES:
    try:
      _DEVICES[key] = tc.topology_devices(topology, slices)
    except ValueError as e:
      pytest.skip(f"libtpu cannot describe TPU topologies here: {e}")
  devices = _DEVICES[key]
  m = sharding.build_mesh(mesh, devices)
  assert dict(m.shape) == mesh
  grid = m.devices
  assert sorted(d.id for d in grid.flat) == sorted(d.id for d in devices)
  # Each slice's chips stay together on the data axis (DCN between them).
  for i in range(mesh["data"]):
    assert {getattr(d, "slice_index", 0) for d in grid[i].flat} == (
        {i} if slices > 1 else {0})
  # The 4-chip tensor groups / 64-chip expert groups are neighbours: each
  # group of the innermost split axis spans at most 4 (resp. 16 x 4) chips
  # of one physical row band.
  axis = "tensor" if mesh["tensor"] > 1 else "expert"
  groups = np.moveaxis(grid, list(m.axis_names).index(axis), -1).reshape(
      -1, mesh[axis])
  for g in groups:
    coords = np.array([d.coords[:2] for d in g])
    extent = coords.max(0) - coords.min(0) + 1
    assert extent.prod() == mesh[axis], (axis, coords)


def test_an_eval_batch_the_mesh_cannot_split_stops_before_compiling():
  c = tiny("text", "fsdp")
  c.eval_batch_size = 10          # 8 v5e chips
  said = []
  with pytest.raises(ValueError, match=(
      r"eval_batch_size=10: .*must be divisible by mesh axes.* Set "
      r"--config.eval_batch_size to a multiple of it\.")):
    tc.compile_steps(c, devices_of("v5e:2x4"), batch_size=16,
                     progress=said.append)
  # Stopped after tracing, before lowering and compiling (minutes at size).
  assert len(said) == 1 and said[0].startswith("tracing the train step")


def test_the_estimate_sends_at_half_the_bidirectional_ici_and_adds_dcn():
  # Cloud TPU's ICI figure counts both directions; a chip sends at half of
  # it. v5e: 400 GB/s bidirectional, 25 Gbit/s of DCN per chip.
  r = {"chip": "TPU v5e", "flops": 0.0, "bytes_accessed": 0.0,
       "collective_traffic_bytes": 200e9}
  times, step, _ = tc.estimate(r)
  assert times["collectives"] == pytest.approx(1.0) and "dcn" not in times
  two = dict(r, slices=2, dcn_traffic_bytes=6.25e9)
  times, step, _ = tc.estimate(two)
  assert times["dcn"] == pytest.approx(2.0) and step == times["dcn"]
  assert tc.dcn_uncounted(two) is None and tc.dcn_uncounted(r) is None
  # A record of two slices compiled before the DCN count has no DCN term,
  # and says why; so does a chip without a published DCN figure.
  assert "compiled before" in tc.dcn_uncounted(r, slices=2)
  v4 = dict(two, chip="TPU v4")
  assert "dcn" not in tc.estimate(v4)[0]
  assert "no DCN bandwidth for TPU v4" in tc.dcn_uncounted(v4)


def test_two_slices_count_the_gradient_reduction_between_them():
  # On two slices XLA:TPU hands the cross-slice gradient all-reduce to the
  # hosts as megascale sends: every chip's f32 gradient shard (its
  # parameter bytes) goes over DCN at least once (2(n-1)/n = 1 for n = 2).
  c = tiny("text", "fsdp")
  c.mesh.data = 2
  key = "v5e:2x2/2"
  if key not in _DEVICES:
    try:
      _DEVICES[key] = tc.topology_devices("v5e:2x2", 2)
    except ValueError as e:
      pytest.skip(f"libtpu cannot describe TPU topologies here: {e}")
  r = tc.report(tc.compile_steps(c, _DEVICES[key], with_eval=False))
  assert r["slices"] == 2 and r["mesh"]["data"] == 2
  assert r["param_bytes"] <= r["dcn_traffic_bytes"] <= 4 * (
      r["param_bytes"] + r["opt_bytes"])
  assert "dcn" in r["est_times_s"]
  assert r["est_times_s"]["dcn"] == pytest.approx(
      r["dcn_traffic_bytes"] / tc.CHIPS["v5e"].dcn_bandwidth)
  assert "between the 2 slices (DCN, through the hosts)" in (
      tc.format_report(r))
  one = reported("v5e:2x4", "text", "fsdp", with_eval=True)
  assert one["slices"] == 1 and one["dcn_traffic_bytes"] == 0
  assert "dcn" not in one["est_times_s"]


def test_an_eval_step_that_does_not_fit_names_eval_batch_size(monkeypatch):
  devices = devices_of("v5e:2x4")
  monkeypatch.setattr(tc, "topology_devices", lambda *a: devices)
  c = tiny("text", "fsdp")
  c.eval_batch_size = 2**23           # the train step (batch 16) fits
  with pytest.raises(tc.DoesNotFit, match=(
      r"^the eval step at eval_batch_size=8388608 needs .* per chip "
      r"\(15\.75 GiB HBM, parameters .*\): set --config\.eval_batch_size "
      r"to about (\d+) \(a multiple of 8")) as e:
    tc.compile_for_topology(c, "v5e:2x4", progress=lambda _: None)
  smaller = int(re.search(r"to about (\d+)", str(e.value)).group(1))
  assert 8 <= smaller < 2**23


def test_compile_mode_validates_the_config_as_training_does(monkeypatch):
  c = tiny("text", "fsdp")
  c.grad_accum_steps = 3              # num_train_steps is not a multiple
  monkeypatch.setattr(tc, "topology_devices", lambda *a: pytest.fail(
      "described the topology before validating the config"))
  with pytest.raises(ValueError, match="must be a multiple of "
                     "grad_accum_steps=3"):
    tc.compile_for_topology(c, "v5e:2x4", progress=lambda _: None)


def test_bad_shapes_and_batches_name_their_field():
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed: the [tpu] extra")
  with pytest.raises(ValueError) as e:
    tc.topology_devices("v5e:3x3")
  assert "give a v5e slice shape" in str(e.value)
  assert "pip install" not in str(e.value)
  c = tiny("text", "fsdp")
  with pytest.raises(ValueError, match=(
      r"^batch_size=12: .* Set --config\.batch_size to a multiple of it\.")):
    tc.trace_train_step(c, devices_of("v5e:2x4"), 12)


def test_describing_a_topology_prints_no_libtpu_start_up_noise():
  # In a fresh process (libtpu starts once per process): without a TPU,
  # libtpu's start-up warned about this host's TPU type and workers, with an
  # INVALID_ARGUMENT line above every report.
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  env = {k: v for k, v in os.environ.items()
         if k not in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")}
  out = subprocess.run(
      [sys.executable, "-c", "from hypermixer_jax.train import compile as tc;"
       "print(len(tc.topology_devices('v5e:2x2')))"],
      env=env, capture_output=True, text=True, timeout=300)
  if out.returncode and "libtpu" in out.stderr:
    pytest.skip("libtpu cannot describe TPU topologies here")
  assert out.stdout.strip() == "4", out.stderr[-2000:]
  for noise in ("INVALID_ARGUMENT", "host bounds", "TPU_WORKER_HOSTNAMES",
                "Logging before InitGoogle"):
    assert noise not in out.stderr, out.stderr[-2000:]
