"""The accelerator kit's measurements (``experiments/accelerator_kit.py``).

Each section returns a dict of rows; a row that fails records its error
(``guarded``) so one out-of-memory length does not end the run. Nothing
here needs seqio or TensorFlow: accelerator images often lack them.
"""
from __future__ import annotations

import collections
import glob
import os
import shutil
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from hypermixer_jax import sharding
from hypermixer_jax.experiment import bench as bc
from hypermixer_jax.experiment.flags import load_config
from hypermixer_jax.models import attention as attention_lib
from hypermixer_jax.models import hypermixer as hm
from hypermixer_jax.train import compile as tc
from hypermixer_jax.train import flop_count
from hypermixer_jax.train import hlo_costs
from hypermixer_jax.train import metrics as metrics_lib
from hypermixer_jax.train import profiling

MIXERS = ("hypermixer", "mlp_mixer", "gmlp", "attention", "fnet",
          "linear_attention")
BERT = dict(num_layers=12, d_model=768, d_ffn=3072)
TOY_BERT = dict(num_layers=1, d_model=64, d_ffn=128)
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
TOKENS_PER_CALL = 16384
# In the order a run measures them (the first is what a pod user reads).
SECTIONS = ("mlm_mfu", "token_mixing", "smlp_vs_switch", "profile")
# The train steps ``profile`` splits by model part: the three MLM steps
# furthest below the others' MFU and the sMLP / Switch pair.
PROFILED = ("mlp_mixer", "fnet", "hypermixer", "smlp", "switch")


def _random_batch(config, b: int, rng: np.random.Generator) -> dict:
  """A host batch of ``config``'s task (``compile.abstract_batch``'s
  shapes) with valid random contents."""
  out = {}
  for k, s in tc.abstract_batch(config, b).items():
    if k == "segment_ids":
      out[k] = np.ones(s.shape, np.int32)
    elif k == "positions":
      out[k] = np.broadcast_to(np.arange(s.shape[1], dtype=np.int32),
                               s.shape).copy()
    elif k == "masked_positions":
      out[k] = rng.integers(0, config.data.seq_len, s.shape).astype(np.int32)
    elif k == "weights":
      out[k] = np.ones(s.shape, np.float32)
    elif s.dtype == np.int32:
      out[k] = rng.integers(0, config.model.vocab_size, s.shape).astype(
          np.int32)
    else:
      out[k] = rng.standard_normal(s.shape).astype(s.dtype)
  return out


def _one_device(config):
  devices = jax.devices()[:1]
  config.mesh.data, config.mesh.fsdp = 1, 1
  config.mesh.tensor, config.mesh.expert = 1, 1
  return devices, sharding.build_mesh(config.mesh, devices), \
      sharding.get_rules(config.sharding)


def _compiled_step(config, batch_size: int):
  """``(step, state, global batch, rng, host batch)`` of ``config``'s train
  step compiled for one device."""
  _, mesh, rules = _one_device(config)
  batch = _random_batch(config, batch_size, np.random.default_rng(0))
  return (*bc.train_step(config.model, batch, mesh, rules, config=config),
          batch)


def time_train_step(config, batch_size: int, steps: int) -> dict:
  """Seconds per train step of ``config`` on one device, its matmul FLOPs
  (jaxpr count) and XLA's FLOPs, tokens/s and MFU against the peak."""
  step, state, gbatch, rng, batch = _compiled_step(config, batch_size)
  devices = jax.devices()[:1]
  matmul = flop_count.count(tc.trace_train_step(
      config, devices, batch_size)[0].jaxpr).flops
  seconds = bc.time_steps(step, state, gbatch, rng, steps)
  peak = metrics_lib.peak_flops(devices[0].device_kind)
  tokens = int(np.prod(batch["inputs"].shape[:2]))
  return {"step_s": seconds, "matmul_flops": matmul,
          "xla_flops": bc.xla_flops(step), "tokens_per_s": tokens / seconds,
          "batch_size": batch_size, "tflops_per_s": matmul / seconds / 1e12,
          "mfu": matmul / seconds / peak if peak else None}


def setup(toy: bool) -> dict:
  """The sizes a run measures (recorded beside its figures)."""
  bert = TOY_BERT if toy else BERT
  return {"mlm": dict(bert, seq_len=32 if toy else 128,
                      batch_size=4 if toy else 256,
                      hyper_dim=3 * bert["d_model"],
                      num_heads=2 if toy else 12),
          "token_mixing": {"d_model": 64 if toy else 768,
                           "hyper_dim": 192 if toy else 2304,
                           "num_heads": 2 if toy else 12,
                           "tokens_per_call": 256 if toy else TOKENS_PER_CALL},
          "smlp_vs_switch": {"config": "smlp_lm.py:" + ("tiny" if toy
                                                         else "base"),
                             "batch_size": 4 if toy else 32}}


def _mlm_config(mixer: str, toy: bool, dtype: str):
  """``configs/c4_mlm.py:<mixer>`` at the kit's BERT-base width."""
  s = setup(toy)["mlm"]
  c = load_config("c4_mlm.py", mixer)
  c.model.update({k: s[k] for k in BERT})
  c.model.dtype = dtype
  kw = c.model.mixer_kwargs
  if "hyper_dim" in kw:
    kw.hyper_dim = s["hyper_dim"]
  if "num_heads" in kw:
    kw.num_heads = s["num_heads"]
  c.data.seq_len = c.model.max_len = s["seq_len"]
  return c


def mlm_mfu(toy: bool, dtype: str, mixers=MIXERS) -> dict:
  b = setup(toy)["mlm"]["batch_size"]
  return {m: guarded(lambda m=m: time_train_step(
      _mlm_config(m, toy, dtype), b, 2 if toy else 10)) for m in mixers}


def _timed(fn, *args, toy: bool) -> float:
  return bc.time_call(fn, *args, repeats=2 if toy else 5,
                      min_seconds=0.01 if toy else 0.2)


# What the token-mixing rows time as attention; rows without the field
# timed the attention kernel alone on the input as q, k and v (no
# projections: lighter than the module by its four d x d matmuls).
ATTENTION_TIMED = "module (q, k, v and output projections)"
KERNEL_ONLY = "kernel only (no projections)"


def token_mixing(toy: bool, dtype, lengths=None) -> dict:
  """HyperMixing against softmax attention, per length: both as token-mixing
  modules, their projections included (the attention module's q, k, v and
  output projections; cuDNN's flash attention on a GPU)."""
  s = setup(toy)["token_mixing"]
  d, heads, tokens = s["d_model"], s["num_heads"], s["tokens_per_call"]
  lengths = lengths or ((64,) if toy else LENGTHS)
  cudnn = jax.devices()[0].platform == "gpu"
  out = {}
  for n in lengths:
    b = max(1, tokens // n)
    x = jax.random.normal(jax.random.key(0), (b, n, d), dtype)
    mixer = hm.HyperMixing(hyper_dim=s["hyper_dim"], max_len=n, dtype=dtype)
    params = mixer.init(jax.random.key(1), x[:1, :8])

    attn = attention_lib.SelfAttention(
        num_heads=heads, implementation="cudnn" if cudnn else None,
        dtype=dtype)
    attn_params = attn.init(jax.random.key(2), x[:1, :8])

    def hyper(p, x, mixer=mixer):
      return mixer.apply(p, x)

    def attend(p, x, attn=attn):
      return attn.apply(p, x)

    row = {"batch": b, "attention_timed": ATTENTION_TIMED}
    for name, fn, p in (("hypermixing", hyper, params),
                        ("attention", attend, attn_params)):
      fwd = jax.jit(fn)
      both = jax.jit(jax.grad(lambda p, x, fn=fn: jnp.sum(
          jnp.square(fn(p, x).astype(jnp.float32))), argnums=(0, 1)))
      row[name] = guarded(lambda fwd=fwd, both=both, p=p: {
          "forward_s": _timed(fwd, p, x, toy=toy),
          "forward_backward_s": _timed(both, p, x, toy=toy)})
    out[str(n)] = row
  return out


def _smlp_config(token_mixer: str, toy: bool, dense_layers: int | None,
                 dtype: str):
  c = load_config("smlp_lm.py", "tiny" if toy else "base")
  c.model.dtype = dtype
  c.model.token_mixer = token_mixer
  if token_mixer == "attention":
    c.model.moe.tmoe_router = "switch"
  if dense_layers is not None:
    c.model.num_dense_layers = dense_layers
  return c


def _smlp_and_switch(toy: bool, dtype: str):
  """The sMLP LM's config and the Switch Transformer's whose dense depth
  brings its matmul FLOPs per step closest to sMLP's."""
  ref = _smlp_config("gmlp", toy, None, dtype)
  b = setup(toy)["smlp_vs_switch"]["batch_size"]
  devices = jax.devices()[:1]

  def flops(c):
    _one_device(c)
    return flop_count.count(tc.trace_train_step(c, devices, b)[0].jaxpr).flops
  target = flops(ref)
  # A step's matmul FLOPs grow linearly with the dense depth: two traces.
  one, two = (flops(_smlp_config("attention", toy, n, dtype)) for n in (1, 2))
  depth = max(1, round(1 + (target - one) / (two - one)))
  return ref, _smlp_config("attention", toy, depth, dtype)


def smlp_vs_switch(toy: bool, dtype: str) -> dict:
  """Train-step tokens/s of sMLP and of the Switch Transformer at equal
  matmul FLOPs (``_smlp_and_switch``)."""
  ref, switch = _smlp_and_switch(toy, dtype)
  b = setup(toy)["smlp_vs_switch"]["batch_size"]
  return {"smlp": guarded(lambda: time_train_step(ref, b, 2 if toy else 10)),
          "switch": dict(guarded(lambda: time_train_step(
              switch, b, 2 if toy else 10)),
                         num_dense_layers=switch.model.num_dense_layers)}


def profile_step(config, batch_size: int, steps: int, top: int = 12,
                 trace_dir: str | None = None) -> dict:
  """Where one device's time goes in ``config``'s train step: ``steps``
  steps traced with ``jax.profiler`` after two warm-up steps, each
  annotated instruction's time (``profiling.op_times``) given the model
  part of its ``op_name`` (``hlo_costs.instruction_parts``, as compile
  mode's HBM breakdown), per step; the ``top`` instructions by time."""
  step, state, gbatch, rng, _ = _compiled_step(config, batch_size)
  parts = hlo_costs.instruction_parts(step.as_text())
  for _ in range(2):
    state, metrics = step(state, gbatch, rng)
  jax.block_until_ready(metrics)
  directory = trace_dir or tempfile.mkdtemp(prefix="kit_profile")
  jax.profiler.start_trace(directory)
  t0 = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, gbatch, rng)
  jax.block_until_ready(metrics)
  wall = (time.perf_counter() - t0) / steps
  jax.profiler.stop_trace()
  (xplane,) = glob.glob(os.path.join(directory, "**", "*.xplane.pb"),
                        recursive=True)
  times = max(profiling.op_times(xplane).values(),
              key=lambda t: sum(t.values()), default={})
  if trace_dir is None:
    shutil.rmtree(directory)
  by_part = collections.Counter()
  ops = []
  for name, seconds in times.items():
    part, opcode, op_name = parts.get(name, ("unmatched", "?", ""))
    by_part[part] += seconds / steps
    ops.append({"instruction": name, "opcode": opcode, "part": part,
                "op_name": op_name[-120:], "s_per_step": seconds / steps})
  ops.sort(key=lambda o: -o["s_per_step"])
  busy = sum(by_part.values())
  return {"wall_s_per_step": wall, "device_s_per_step": busy,
          "by_part_s": dict(by_part.most_common()), "top": ops[:top],
          "instructions": len(ops)}


def profile(toy: bool, dtype: str, mixers=PROFILED) -> dict:
  """``profile_step`` of the MLM train steps of ``mixers`` and of the sMLP
  and Switch steps of ``smlp_vs_switch`` (names ``smlp`` and ``switch``)."""
  s, steps = setup(toy), 2 if toy else 5
  out = {}
  for m in mixers:
    if m in ("smlp", "switch"):
      continue
    out[m] = guarded(lambda m=m: profile_step(
        _mlm_config(m, toy, dtype), s["mlm"]["batch_size"], steps))
  if {"smlp", "switch"} & set(mixers):
    pair = dict(zip(("smlp", "switch"), _smlp_and_switch(toy, dtype)))
    for m in ("smlp", "switch"):
      if m in mixers:
        out[m] = guarded(lambda m=m: profile_step(
            pair[m], s["smlp_vs_switch"]["batch_size"], steps))
  return out


def guarded(fn) -> dict:
  """``fn()``, or the error it raised (one row's failure, e.g. out of
  memory at N = 32,768, does not end the run)."""
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
            "where": traceback.format_exc().splitlines()[-3:]}


def device_kind(device: str) -> str:
  """``bench.device_name()``'s platform and chip, without the host setup."""
  return device.split(" (")[0]


def section_runs(results: dict, name: str) -> list:
  """The runs that measured section ``name``'s rows, oldest first (a record
  written before rows were tracked holds one run, of every row)."""
  runs = results.get("runs", {}).get(name, [])
  return [runs] if isinstance(runs, dict) else list(runs)


def run_of(results: dict, name: str, row: str) -> dict:
  """The latest run that measured ``row`` of section ``name``."""
  for run in reversed(section_runs(results, name)):
    if run.get("rows") is None or row in run["rows"]:
      return run
  return {}


def add_run(results: dict, name: str, run: dict) -> None:
  """Records ``run`` (its ``rows`` measured) for section ``name``, dropping
  earlier runs none of whose rows are still theirs."""
  kept, later = [], set()
  for r in reversed(section_runs(results, name) + [run]):
    rows = set(results.get(name, {}) if r.get("rows") is None else r["rows"])
    if rows - later:
      kept.append(r)
    later |= rows
  results.setdefault("runs", {})[name] = kept[::-1]


def _mfu_table(results: dict, key: str) -> str:
  def ceiling(m):
    return run_of(results, key, m).get("matmul_flops_per_s")
  return bc.markdown_table(
      ["mixer", "step ms", "tokens/s", "MFU (datasheet peak)",
       "of the measured matmul ceiling", "measured"],
      [[m, r["error"] if "error" in r else f"{r['step_s'] * 1e3:.1f}",
        f"{r.get('tokens_per_s', 0):,.0f}",
        f"{r['mfu']:.1%}" if r.get("mfu") else "-",
        f"{r['tflops_per_s'] * 1e12 / ceiling(m):.1%}"
        if ceiling(m) and "tflops_per_s" in r else "-",
        run_of(results, key, m).get("date", "-")]
       for m, r in results[key].items()])


def _mixing_table(results: dict, key: str) -> str:
  rows = []
  for n, r in results[key].items():
    cells = [n, r["batch"]]
    for name in ("hypermixing", "attention"):
      t = r[name]
      cells += (["error", "error"] if "error" in t else
                [f"{t['forward_s'] * 1e3:.2f}",
                 f"{t['forward_backward_s'] * 1e3:.2f}"])
    ok = "error" not in r["hypermixing"] and "error" not in r["attention"]
    cells += [f"{r['attention'][k] / r['hypermixing'][k]:.2f}x" if ok
              else "-" for k in ("forward_s", "forward_backward_s")]
    rows.append(cells + [r.get("attention_timed", KERNEL_ONLY),
                         run_of(results, key, n).get("date", "-")])
  return bc.markdown_table(
      ["N", "batch", "HyperMixing fwd ms", "HyperMixing fwd+bwd ms",
       "attention fwd ms", "attention fwd+bwd ms",
       "attention / HyperMixing fwd", "attention / HyperMixing fwd+bwd",
       "attention timed", "measured"], rows)


def _switch_table(results: dict, key: str) -> str:
  sw = results[key]
  base = sw.get("switch", {}).get("tokens_per_s")
  return bc.markdown_table(
      ["model", "dense layers", "tokens/s", "of the Switch Transformer's",
       "matmul GFLOP/step", "measured"], [
           [k, v.get("num_dense_layers", "-"),
            v["error"] if "error" in v else f"{v['tokens_per_s']:,.0f}",
            f"{v['tokens_per_s'] / base:.2f}x"
            if base and "tokens_per_s" in v else "-",
            f"{v.get('matmul_flops', 0) / 1e9:,.1f}",
            run_of(results, key, k).get("date", "-")]
           for k, v in sw.items()])


def table(results: dict) -> str:
  """The sections measured so far, as markdown tables, each row with the
  date of the run that measured it (MFU also against that run's matmul
  ceiling). A section kept under another name (``mlm_mfu_<what changed>``:
  the figures before a change) follows its own, under its name."""
  kinds = (("mlm_mfu", _mfu_table), ("token_mixing", _mixing_table),
           ("smlp_vs_switch", _switch_table),
           ("profile", lambda r, k: profile_table(r[k], r, k)))
  text = []
  for base, render in kinds:
    if base in SECTIONS[:3]:    # always shown, even before it is measured
      text.append(render(results if base in results else {base: {}}, base))
    keys = sorted(k for k in results if k == base or k.startswith(base + "_"))
    text += [f"`{key}`:\n\n{render(results, key)}" for key in keys
             if key not in SECTIONS[:3]]
  return "\n\n".join(text)


def profile_table(prof: dict, results: dict | None = None,
                  key: str = "profile") -> str:
  """``profile``'s split: per train step, the device time by part and the
  three instructions that take most (and, given the record, the date of the
  run that measured the row)."""
  rows = []
  for name, r in prof.items():
    if "error" in r:
      rows.append([name, r["error"], "-", "-", "-"])
      continue
    busy = r["device_s_per_step"] or float("nan")
    parts = ", ".join(f"{p} {t / busy:.0%}" for p, t in r["by_part_s"].items()
                      if t >= 0.03 * busy) or r.get("note", "-")
    top = "; ".join(f"{o['instruction']} ({o['part']}) {o['s_per_step'] / busy:.0%}"
                    for o in r["top"][:3])
    rows.append([name, f"{r['wall_s_per_step'] * 1e3:.1f}",
                 f"{busy * 1e3:.1f}", parts, top])
  if results is None:
    return bc.markdown_table(
        ["train step", "wall ms", "device busy ms", "device time by part",
         "largest instructions"], rows)
  return bc.markdown_table(
      ["train step", "wall ms", "device busy ms", "device time by part",
       "largest instructions", "measured"],
      [row + [run_of(results, key, row[0]).get("date", "-")] for row in rows])
