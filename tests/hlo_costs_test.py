"""HBM traffic counted once (``train/hlo_costs.py``) against bytes counted by
hand, on small programs compiled for one TPU v5e chip (libtpu's compile-only
devices; skipped without the ``[tpu]`` extra) and on hand-written HLO."""
import jax
import jax.numpy as jnp
import pytest

from hypermixer_jax.train import compile as tc
from hypermixer_jax.train import hlo_costs as hc

MIB = 2**20


def _chip():
  try:
    return tc.topology_devices("v5e:2x2")[0]
  except ValueError as e:
    pytest.skip(f"libtpu cannot describe TPU topologies here: {e}")


def _compile(fn, shapes, msa: bool):
  """``(XLA's cost analysis, hlo_costs.traffic)`` of ``fn`` on one chip,
  memory-space assignment on or off."""
  dev = _chip()
  sh = jax.NamedSharding(jax.sharding.Mesh([dev], ("x",)), jax.P())
  args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes]
  c = jax.jit(fn).trace(*args).lower().compile(
      compiler_options={"xla_msa_enable": "true" if msa else "false"})
  return c.cost_analysis(), hc.traffic(c.as_text())


def _chain(x, w1, w2):
  return jnp.tanh(jnp.tanh(x @ w1) @ w2)


@pytest.mark.slow
def test_matmul_chain_counts_each_hbm_transfer_once():
  # Three 2048 x 2048 bf16 matrices (8 MiB each) in, one out. By hand: the
  # chip must read x, w1, w2 and write the result: 4 matrices; without
  # on-chip memory the intermediate also goes to HBM and back: 6.
  shapes = [((2048, 2048), jnp.bfloat16)] * 3
  xla_on, on = _compile(_chain, shapes, msa=True)
  xla_off, off = _compile(_chain, shapes, msa=False)
  assert on.hbm_bytes == 4 * 8 * MIB
  assert off.hbm_bytes == 6 * 8 * MIB
  # XLA's rule (operands + results in any memory space) is what
  # ``xla_bytes`` reproduces: equal to XLA's figure without MSA, and with
  # it over 3x the traffic (each prefetch counted 4 times, the on-chip
  # operands again).
  assert xla_off["bytes accessed"] == pytest.approx(off.hbm_bytes, rel=1e-4)
  assert on.xla_bytes == pytest.approx(xla_on["bytes accessed"], rel=1e-3)
  assert xla_on["bytes accessed"] > 3 * on.hbm_bytes
  assert on.moves_xla_bytes >= 2 * 4 * 8 * MIB   # two prefetches, 4x each


@pytest.mark.slow
def test_scan_body_counts_once_per_trip():
  # 8 steps of x <- tanh(x @ w), 1024 x 1024 float32 (4 MiB). Without
  # on-chip memory each step reads x and w (converted once to bf16, 2 MiB)
  # and writes x: at least 8 x 10 MiB, which XLA's figure (the body read
  # once) does not reach. With MSA the loop runs on chip: x and w read
  # once, the result written once.
  def scan(x, w):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None,
                        length=8)[0]
  shapes = [((1024, 1024), jnp.float32)] * 2
  xla_off, off = _compile(scan, shapes, msa=False)
  assert off.hbm_bytes >= 8 * 10 * MIB > xla_off["bytes accessed"]
  body = [it for it in off.items if it.runs == 8]
  assert body and all(it.hbm_bytes % 8 == 0 for it in body)
  # Loop bodies read once, our rule gives XLA's figure.
  assert sum(it.xla_bytes / it.runs for it in off.items) == pytest.approx(
      xla_off["bytes accessed"], rel=1e-3)
  _, on = _compile(scan, shapes, msa=True)
  assert on.hbm_bytes == pytest.approx(3 * 4 * MIB, rel=0.01)


@pytest.mark.slow
def test_gather_reads_rows_unless_the_table_is_prefetched():
  # 1024 rows of a 32768 x 512 float32 table (64 MiB): 2 MiB of rows, 2 MiB
  # out. Without MSA the table is not read whole; with it, XLA prefetches
  # the whole table into on-chip memory, which is 64 MiB of real traffic
  # (counted once here, 4 times by XLA).
  def gather(table, ids):
    return jnp.take(table, ids, axis=0)
  shapes = [((32768, 512), jnp.float32), ((1024,), jnp.int32)]
  _, off = _compile(gather, shapes, msa=False)
  assert 4 * MIB <= off.hbm_bytes <= 3 * (4 * MIB + 4096)
  xla_on, on = _compile(gather, shapes, msa=True)
  if on.moves_xla_bytes:          # the table was prefetched
    assert 64 * MIB <= on.hbm_bytes < 2 * 64 * MIB
    assert xla_on["bytes accessed"] > 3 * 64 * MIB


HLO = """HloModule m

%fused_dus (p0: f32[64,128], p1: f32[8,128], p2: s32[]) -> f32[64,128] {
  %p0 = f32[64,128]{1,0} parameter(0)
  %p1 = f32[8,128]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[64,128]{1,0} dynamic-update-slice(%p0, %p1, %p2, %z)
}

%fused_slice (q0: f32[64,128]) -> f32[8,128] {
  %q0 = f32[64,128]{1,0:S(1)} parameter(0)
  ROOT %s = f32[8,128]{1,0} slice(%q0), slice={[0:8], [0:128]}
}

ENTRY %main (a: f32[64,128], b: f32[8,128], i: s32[]) -> f32[64,128] {
  %a = f32[64,128]{1,0} parameter(0), metadata={op_name="state.params['encoder']['stack']['layer_0']['token_mixing']['w']"}
  %b = f32[8,128]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %cs = (f32[64,128]{1,0:S(1)}, f32[64,128]{1,0}, u32[]{:S(2)}) copy-start(%a)
  %cd = f32[64,128]{1,0:S(1)} copy-done(%cs)
  %ss = ((f32[64,128]{1,0}), f32[16,128]{1,0:S(1)}, s32[]{:S(2)}) slice-start(%a), slice={[0:16], [0:128]}
  %sd = f32[16,128]{1,0:S(1)} slice-done(%ss)
  %f = f32[8,128]{1,0} fusion(%cd), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(step)/transpose(jvp(Model))/encoder/stack/layer_0/feature_mixing/wi/mul"}
  %e = (f32[16,128]{1,0}, f32[16,128]{1,0:S(1)}, u32[]{:S(2)}) copy-start(%sd)
  %ed = f32[16,128]{1,0} copy-done(%e)
  ROOT %u = f32[64,128]{1,0} fusion(%a, %f, %i), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(step)/add", stack_frame_id=1}
}

FileNames
1 "site-packages/optax/_src/transform.py"

FunctionNames
1 "update_fn"

FileLocations
1 {file_name_id=1 function_name_id=1 line=1 end_line=1 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
"""


def test_hand_written_module_by_hand():
  t = hc.traffic(HLO)
  by = {it.name: it for it in t.items}
  row = 128 * 4                                   # one f32 row of 128
  # The prefetch reads a from HBM once (64 rows); the slice prefetch 16
  # rows; the eviction writes 16 rows to HBM.
  assert by["cs"].hbm_bytes == 64 * row
  assert by["ss"].hbm_bytes == 16 * row
  assert by["e"].hbm_bytes == 16 * row
  # The fusion reads its operand from on-chip memory, writes 8 rows.
  assert by["f"].hbm_bytes == 8 * row
  # In place: the update (8 rows) read and written, the buffer not read.
  assert by["u"].hbm_bytes == 8 * row + 8 * row + 4
  assert t.hbm_bytes == (64 + 16 + 16 + 8 + 16) * row + 4
  # Parts: the prefetch of a token-mixing parameter, a backward
  # feed-forward op, the optimizer's update (its stack frame's file).
  assert by["cs"].part == "mixer" and by["f"].part == "feed-forward"
  assert by["u"].part == "optimizer"
  assert t.by_part["mixer"] >= 64 * row


def test_instruction_parts_cover_every_instruction_as_traffic_does():
  parts = hc.instruction_parts(HLO)
  # Fused computations' instructions are named too (a profile of a CPU
  # program can name them), the scheduled ones with traffic's parts.
  assert {"s", "dus", "cs", "f", "u"} <= set(parts)
  for it in hc.traffic(HLO).items:
    assert parts[it.name][0] == it.part and parts[it.name][1] == it.opcode
  assert parts["f"][2].endswith("feature_mixing/wi/mul")


@pytest.mark.parametrize("op_name,files,part", [
    ("jit(train_step)/jvp(Model)/encoder/stack/layer_3/token_mixing/"
     "hypernetwork/hidden/dense/dot_general", (), "mixer"),
    ("jit(train_step)/transpose(jvp(Model))/encoder/stack/layers/layer/"
     "feature_mixing/wo/dense/dot_general", (), "feed-forward"),
    ("jit(train_step)/jvp(Model)/decoder/layer_1/smoe/experts/dot_general",
     (), "moe"),
    ("jit(train_step)/jvp(Model)/encoder/stack/layer_0/mixing_norm/ln/mul",
     (), "norm & dropout"),
    ("jit(train_step)/jvp(Model)/mlm_head/transform/dense/dot_general", (),
     "head"),
    ("jit(train_step)/jvp(Model)/encoder/token_embed/jit(_take)/gather", (),
     "embedding"),
    ("jit(train_step)/mul", ("/x/optax/_src/transform.py",), "optimizer"),
    ("jit(train_step)/log_softmax", ("/x/hypermixer_jax/heads.py",), "loss"),
    ("jit(train_step)/mul", (), None),
    # Any root module under autodiff (the sMLP LM is not called Model).
    ("jit(train_step)/transpose(jvp(SmlpLM))/layer_7/smoe/"
     "smoe.spatial_mixing/spatial/scatter-add", (), "moe"),
    ("jit(train_step)/transpose(jvp(SmlpLM))/layer_2/attention/"
     "vmap(jit(_where))/select_n", ("/x/optax/_src/transform.py",), "mixer"),
    ("jit(train_step)/jvp(SmlpLM)/embed.attend/dot_general", (), "head"),
])
def test_parts_from_op_names(op_name, files, part):
  assert hc.part_of(op_name, files) == part


def test_tiles_pad_array_bytes():
  # f32[2,24,40] in (8,128) tiles: 24 -> 24, 40 -> 128.
  assert hc.shape_bytes("f32[2,24,40]{2,1,0:T(8,128)}") == 2 * 24 * 128 * 4
  # Minor-to-major {0,1}: dimension 0 is the minor one.
  assert hc.shape_bytes("f32[136,5]{0,1:T(8,128)}") == 8 * 256 * 4
  assert hc.shape_bytes("(bf16[4]{0}, s32[])") == 12
  assert hc.arrays("f32[8]{0:T(128)S(1)}") == [(512, False)]


COND_HLO = """HloModule c

%small (s: f32[256,128]) -> f32[256,128] {
  %s = f32[256,128]{1,0} parameter(0)
  ROOT %neg = f32[256,128]{1,0} negate(%s)
}

%big (t: f32[256,128]) -> f32[256,128] {
  %t = f32[256,128]{1,0} parameter(0)
  %e = f32[256,128]{1,0} exponential(%t)
  %ag = f32[1024,128]{1,0} all-gather(%e), channel_id=1, replica_groups={}, dimensions={0}
  ROOT %l = f32[256,128]{1,0} log(%e)
}

%gathers (u: f32[256,128]) -> f32[256,128] {
  %u = f32[256,128]{1,0} parameter(0)
  %g1 = f32[4096,128]{1,0:S(1)} all-gather(%u), channel_id=2, replica_groups={}, dimensions={0}
  ROOT %c = f32[256,128]{1,0} copy(%u)
}

ENTRY %main (p: pred[], x: f32[256,128]) -> f32[256,128] {
  %p = pred[] parameter(0)
  %x = f32[256,128]{1,0} parameter(1)
  %k = s32[] convert(%p)
  ROOT %r = f32[256,128]{1,0} conditional(%k, %x, %x, %x), branch_computations={%small, %big, %gathers}
}
"""


def test_a_conditional_counts_its_costliest_branch_once():
  # A step runs one branch of a conditional (gradient accumulation's emit
  # or hold): the HBM traffic takes the branch that moves most, the
  # collectives the one that sends most, never the sum of all three.
  m = 256 * 128 * 4
  t = hc.traffic(COND_HLO)
  by = {it.name: it.hbm_bytes for it in t.items}
  # %big: exp reads x, writes e; the gather reads e, writes 4 e; log
  # reads e and writes its result: 9 matrices; %small 2; %gathers 3 (its
  # 16-matrix gather lands in on-chip memory), but it sends the most.
  assert "neg" not in by and "e" in by and "g1" not in by
  assert t.hbm_bytes == 9 * m + 5              # and the pred's convert
  times, _ = hc.loop_multipliers(COND_HLO, "collectives")
  assert "gathers" in times and "big" not in times and "small" not in times
  assert tc.collectives(COND_HLO)["all-gather"] == (1, 16 * m)
  with pytest.raises(ValueError, match="weigh='flops': one of"):
    hc.loop_multipliers(COND_HLO, "flops")


def test_collective_permute_start_writes_its_destination():
  # collective-permute-start's result tuple is (operand, destination,
  # context words): the destination in HBM is written, as an all-gather's
  # result is; before, the last element (a u32[] context word) was taken.
  permute = """HloModule m

ENTRY %main (a: f32[1024,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  %cps = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%a), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %cpd = f32[1024,1024]{1,0} collective-permute-done(%cps)
}
"""
  t = hc.traffic(permute)
  assert t.hbm_bytes == 2 * 4 * MIB          # read a, write the result
  on_chip = permute.replace(
      "(f32[1024,1024]{1,0}, f32[1024,1024]{1,0}, u32",
      "(f32[1024,1024]{1,0}, f32[1024,1024]{1,0:S(1)}, u32")
  assert hc.traffic(on_chip).hbm_bytes == 4 * MIB


FUSED_BRANCH_HLO = """HloModule c

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused (f: f32[1024,1024]) -> f32[] {
  %f = f32[1024,1024]{1,0} parameter(0)
  %e1 = f32[1024,1024]{1,0} exponential(%f)
  %e2 = f32[1024,1024]{1,0} log(%e1)
  %e3 = f32[1024,1024]{1,0} tanh(%e2)
  %e4 = f32[1024,1024]{1,0} negate(%e3)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%e4, %z), dimensions={0,1}, to_apply=%add
}

%reduce_branch (t: f32[1024,1024]) -> f32[] {
  %t = f32[1024,1024]{1,0} parameter(0)
  ROOT %fu = f32[] fusion(%t), kind=kLoop, calls=%fused
}

%copy_branch (u: f32[1024,1024]) -> f32[] {
  %u = f32[1024,1024]{1,0} parameter(0)
  %c1 = f32[1024,1024]{1,0} copy(%u)
  %c2 = f32[1024,1024]{1,0} copy(%c1)
  %c3 = f32[1024,1024]{1,0} copy(%c2)
  ROOT %sl = f32[] constant(0)
}

ENTRY %main (p: s32[], x: f32[1024,1024]) -> f32[] {
  %p = s32[] parameter(0)
  %x = f32[1024,1024]{1,0} parameter(1)
  ROOT %r = f32[] conditional(%p, %x, %x), branch_computations={%reduce_branch, %copy_branch}
}
"""


def test_a_branch_is_weighed_by_its_traffic_not_its_fused_body():
  # The reduce branch's fusion has a long body but moves one matrix in (and
  # a scalar out); the copy branch moves six. The weighing counts a
  # fusion's bytes at its instruction, as the traffic does.
  m = 1024 * 1024 * 4
  times, _ = hc.loop_multipliers(FUSED_BRANCH_HLO)
  assert "copy_branch" in times and "reduce_branch" not in times
  assert hc.traffic(FUSED_BRANCH_HLO).hbm_bytes == 6 * m
