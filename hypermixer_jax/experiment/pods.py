"""The pod plan (``experiments/pod_plan.py``): the paper-scale configurations
compiled for Cloud TPU topologies under each sharding preset, one cell's
compile and its record, and the tables read from the record (the grid, the
recommended setup per model and pod, the host cores that feed its chips).

A cell is ``(configuration, preset, topology)``, recorded in
``results.json`` under the key ``"name|preset|topology"``; the compile is
``hypermixer_jax.train.compile``'s (libtpu's compile-only devices, abstract
state), so no TPU is needed.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import time

from hypermixer_jax import experiment
from hypermixer_jax.experiment import bench
from hypermixer_jax.train import compile as tc

# Accelerator type -> (libtpu topology, slices).
TOPOLOGIES = {
    "v4-32": ("v4:2x2x4", 1), "v5p-128": ("v5p:4x4x4", 1),
    "v5e-256": ("v5e:16x16", 1), "v6e-256": ("v6e:16x16", 1),
    "2x v5e-256": ("v5e:16x16", 2), "v5e-16": ("v5e:4x4", 1),
}
PRESETS = ("fsdp", "data_parallel", "fsdp_tensor", "expert")
# Chips per host of the multi-host slices of each generation (Cloud TPU's
# system-architecture pages: 4-chip VMs for v4, v5e, v5p and v6e pods).
CHIPS_PER_HOST = 4
# Examples/s one host core supplies through each pipeline, measured on this
# project's CPU machine (one core, experiments/README.md "Pod plan"):
#   bench_input.py --shards=8 --batch_size=64 --batches=300 \
#     --warmup_batches=30 --seq_len=128 --only "c4_mlm,c4_mlm packed,c4_lm packed"
#   bench_input.py --batch_size=32 --batches=60 --warmup_batches=6 \
#     --only "imagenet_patches 224/16"
# Text pipelines: rows of RATE_SEQ_LEN tokens per second (a config with
# longer rows gets proportionally fewer: the per-token work dominates).
PIPELINE_RATES = {"c4_mlm": 3163.0, "c4_mlm packed": 2313.0,
                  "c4_lm packed": 2932.0, "imagenet_patches": 90.2}
RATE_SEQ_LEN = 128
BERT_BASE = dict(num_layers=12, d_model=768, d_ffn=3072)


# ---------------------------------------------------------------------------
# The grid.
# ---------------------------------------------------------------------------
def _mlm(mixer: str, bert_base: bool = True):
  c = experiment.load_config("c4_mlm.py", mixer)
  if bert_base:
    # The precision policy's choice on TPU, stated so that the cells do not
    # depend on the config's default.
    c.model.dtype = "bfloat16"
    c.model.update(BERT_BASE)
    kw = c.model.mixer_kwargs
    if "hyper_dim" in kw:          # the GLUE model's 3 d
      kw.hyper_dim = 3 * c.model.d_model
    if "num_heads" in kw:
      kw.num_heads = 12
    c.batch_size = 2048            # the gMLP paper's BERT setting
  return c


def _glue_mlm_bf16():
  """The GLUE-size MLM with bf16 compute and 8x the batch: what the roofline
  says would lift its MFU."""
  c = _mlm("hypermixer", False)
  c.model.dtype = "bfloat16"
  c.batch_size = 2048
  return c


def _smlp():
  c = experiment.load_config("smlp_lm.py", "base")
  c.model.moe.num_experts = 64
  return c


# Name -> (config factory, what it is).
CONFIGS = {
    "glue_mlm_hypermixer": (
        lambda: _mlm("hypermixer", False),
        "configs/c4_mlm.py:hypermixer as it is (GLUE size)"),
    "glue_mlm_hypermixer_bf16": (_glue_mlm_bf16,
                                 "the same in bf16 at batch 2048"),
    **{f"bert_mlm_{m}": (lambda m=m: _mlm(m),
                         f"C4 MLM of glue_{m} at BERT-base width")
       for m in ("hypermixer", "mlp_mixer", "gmlp", "attention", "fnet",
                 "linear_attention")},
    "gmlp_b": (lambda: experiment.load_config("imagenet.py", "gmlp_b"),
               "configs/imagenet.py:gmlp_b"),
    "mixer_b16": (lambda: experiment.load_config("imagenet.py", "mixer_b16"),
                  "configs/imagenet.py:mixer_b16"),
    "smlp_base_64e": (_smlp, "configs/smlp_lm.py:base with 64 experts"),
    "causal_lm_hypermixer": (
        lambda: experiment.load_config("c4_lm.py", "hypermixer"),
        "configs/c4_lm.py:hypermixer (N = 1024)"),
}


def set_preset(c, preset: str, chips: int, slices: int) -> bool:
  """Sets the mesh of ``preset``; False where the preset is meaningless."""
  experts = c.model.get("moe", {}).get("num_experts", 0) if (
      c.model.family == "smlp") else 0
  if preset == "expert" and not experts:
    return False
  c.sharding.rules = preset
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.expert = slices, -1, 1, 1
  if preset == "data_parallel":
    c.mesh.data, c.mesh.fsdp = -1, 1
  elif preset == "fsdp_tensor":
    c.mesh.tensor = 4
  elif preset == "expert":
    c.mesh.expert = math.gcd(experts, chips // slices)
  return True


def cell_order(names, presets, topologies):
  """Most useful first: fsdp everywhere, then the other presets."""
  for preset in presets:
    for topo in topologies:
      for name in names:
        yield name, preset, topo


def missing(results: dict, names, presets, topologies) -> str:
  """The grid's cells not in ``results``, one line per configuration
  (presets that do not apply, expert without experts, are left out)."""
  lines = []
  for name in names:
    applies = [p for p in presets if set_preset(CONFIGS[name][0](), p, 256, 1)]
    left = [f"{preset} {topo}" for preset in applies for topo in topologies
            if f"{name}|{preset}|{topo}" not in results]
    if left:
      lines.append(f"- {name}: " + ("all cells" if len(left) == len(applies)
                                     * len(topologies) else ", ".join(left)))
  return "\n".join(lines) or "(none)"


# ---------------------------------------------------------------------------
# One cell: its compile and its record.
# ---------------------------------------------------------------------------
def cell_config(name: str, preset: str, topo: str):
  """``(config, devices, batch step)`` of a cell; config None where the
  preset does not apply."""
  c = CONFIGS[name][0]()
  topology, slices = TOPOLOGIES[topo]
  devices = tc.topology_devices(topology, slices)
  if not set_preset(c, preset, len(devices), slices):
    return None, devices, 0
  with c.unlocked():
    mesh = tc.sharding.build_mesh(c.mesh, devices)
    step = tc.batch_step(mesh, tc.sharding.get_rules(c.sharding))
    c.batch_size = -(-int(c.batch_size) // step) * step
  return c, devices, step


def matmul_flops(name: str, preset: str, topo: str) -> dict:
  """The per-chip matmul FLOPs of a cell's train step, traced (no compile):
  for cells recorded before the report counted them."""
  c, devices, _ = cell_config(name, preset, topo)
  traced = tc.trace_train_step(c, devices)[0]
  count = tc.flop_count.count(traced.jaxpr)
  return {"matmul_flops": count.flops / len(devices),
          "uncounted_loops": count.uncounted_loops}


def run_cell(name: str, preset: str, topo: str) -> dict:
  """A cell's record: the compiled step's per-chip report with the compile
  time, the compute dtype, the source commit and the largest global batch
  estimated to fit; ``refused`` where libtpu would not compile it."""
  c, devices, step = cell_config(name, preset, topo)
  if c is None:
    return {"skipped": "no experts"}
  t, cpu = time.perf_counter(), time.process_time()
  r, refused = tc.try_report(c, devices, with_eval=False)
  if refused is not None:
    # The temporaries alone exceed a chip's HBM: libtpu compiles nothing.
    return {"fits": False, "refused": True, "batch_size": int(c.batch_size),
            "chips": len(devices), "temp_bytes": refused[0],
            "hbm_bytes": refused[1],
            "compile_cpu_s": time.process_time() - cpu}
  # Wall time depends on the host's load; CPU seconds (all threads) less so.
  r["compile_s"] = time.perf_counter() - t
  r["dtype"] = str(c.model.get("dtype", ""))
  r["commit"] = source_commit()
  r["compile_cpu_s"] = time.process_time() - cpu
  # Temporaries grow with the batch; the state does not.
  fixed = r["total_bytes"] - r["temp_bytes"]
  per_example = r["temp_bytes"] / r["batch_size"]
  room = r["hbm_bytes"] - fixed
  r["est_max_batch"] = (int(room / per_example) // step * step
                        if room > 0 else 0)
  return r


def source_commit() -> str:
  """The checkout's commit, ``+`` when its tracked files differ from it."""
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                          cwd=experiment.REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--",
                            "hypermixer_jax", "configs"],
                           cwd=experiment.REPO).returncode
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+" if dirty else "")


def compile_cell(name: str, preset: str, topo: str) -> dict:
  """``run_cell``, with a failure recorded as the cell's result."""
  try:
    return run_cell(name, preset, topo)
  except Exception as e:  # pylint: disable=broad-except
    # The first lines name the cause (e.g. the parameters a mesh axis
    # does not divide); the tail is the generic advice.
    lines = str(e).splitlines()
    return {"error": f"{type(e).__name__}: " + " / ".join(
        line.strip() for line in lines[:4])[:600]}


def compiled(r: dict) -> bool:
  """Whether a cell's record holds a compiled step's report."""
  return not ("skipped" in r or "error" in r or r.get("refused"))


def previous_of(name: str, r: dict) -> dict:
  """What a cell's record said, kept beside its recompile: the estimate as
  its own figures give it (``tc.estimate``: XLA's bytes accessed where it
  has no HBM traffic counted once), the bytes and the compute dtype (the
  text MLM configs computed in float32 before the precision policy)."""
  times, step, mfu = tc.estimate(r, traffic_bytes(r))
  dtype = r.get("dtype") or ("float32" if name.startswith(
      ("bert_mlm", "causal_lm")) or name == "glue_mlm_hypermixer"
                             else "bfloat16")
  return {"est_mfu": mfu, "est_limit": max(times, key=times.get),
          "est_step_s": step, "bytes_accessed": r["bytes_accessed"],
          "dtype": dtype, "batch_size": r["batch_size"]}


def open_results(out: str) -> experiment.Experiment:
  """The grid's ``experiment.Experiment`` (cells under ``runs``, claimed
  while compiling, so that one process per core can work one grid); a
  ``results.json`` of the earlier flat layout (cells at the top) is moved
  under ``runs`` first."""
  path = os.path.join(out, "results.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
    if "runs" not in data:
      os.makedirs(out, exist_ok=True)
      tmp = f"{path}.{os.getpid()}.tmp"
      with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"runs": data}, f, indent=1)
      os.replace(tmp, path)
  return experiment.Experiment(out)


def record_cell(exp: experiment.Experiment, name: str, preset: str,
                topo: str, *, redo: bool = False) -> bool:
  """Compiles a cell into ``exp`` unless it is recorded; with ``redo``, a
  compiled record without the HBM traffic counted once, or of several
  slices without their cross-slice (DCN) bytes, is compiled again and what
  it said kept under ``previous``. False where it was recorded (``exp.run``
  also skips a cell another process records meanwhile)."""
  key = f"{name}|{preset}|{topo}"
  exp.reload()
  if key not in exp.runs:
    exp.run(key, lambda: compile_cell(name, preset, topo))
    return True
  old = exp.runs[key]
  stale = "hbm_traffic_bytes" not in old or (
      TOPOLOGIES[topo][1] > 1 and "dcn_traffic_bytes" not in old)
  if not (redo and compiled(old) and stale):
    return False
  r = compile_cell(name, preset, topo)
  r["previous"] = previous_of(name, old)
  exp.reload()
  exp.runs[key] = r
  exp.save()
  print(key, "recompiled", flush=True)
  return True


# ---------------------------------------------------------------------------
# The grid's table.
# ---------------------------------------------------------------------------
def _gib(x):
  return f"{x / 2**30:.2f}"


def traffic_bytes(r: dict) -> float:
  """The bytes a chip sends in the cell's collectives: recorded by the
  compile (``tc.collective_traffic``), or for a cell compiled before that
  was recorded, estimated from its result bytes by kind with groups of the
  slice's size (``tc.traffic_factor``)."""
  if "collective_traffic_bytes" in r:
    return r["collective_traffic_bytes"]
  n = r["chips"] // max(1, r["mesh"].get("data", 1)) if r["mesh"].get(
      "fsdp", 1) > 1 else r["chips"]
  return sum(b * tc.traffic_factor(k, n)
             for k, (_, b) in r["collectives"].items())


def loop_heavy(r: dict) -> bool:
  """Whether loop bodies read once distort the cell's bytes and collectives
  beyond the few percent of XLA's windowed dot-general loops: its matmul
  FLOPs exceed XLA's whole count (which includes the elementwise work) by
  over 10%."""
  return r.get("matmul_flops", 0.0) > 1.1 * r["flops"]


def change_note(r: dict) -> str:
  """What a recompiled cell's estimate was and why it moved: HBM traffic
  counted once instead of XLA's bytes accessed, and the compute dtype."""
  prev = r.get("previous")
  if not prev:
    return ("XLA's bytes accessed (not recompiled)"
            if "hbm_traffic_bytes" not in r else "")
  why = ["HBM counted once (XLA's bytes accessed "
         f"{_gib(prev['bytes_accessed'])} GiB)"]
  if prev.get("dtype") != r.get("dtype"):
    why.append(f"{prev.get('dtype')} -> {r.get('dtype')}")
  if prev.get("batch_size") != r["batch_size"]:
    why.append(f"batch {prev['batch_size']} -> {r['batch_size']}")
  return (f"was {prev['est_mfu']:.0%} ({prev['est_limit']}, "
          f"{prev['est_step_s'] * 1e3:.1f} ms): " + "; ".join(why))


def _compiled_row(name: str, preset: str, topo: str, r: dict) -> list:
  coll = ", ".join(f"{k.replace('collective-', 'c-')} {n}"
                   for k, (n, _) in r["collectives"].items() if n)
  coll_bytes = sum(b for _, b in r["collectives"].values())
  times, _, mfu = tc.estimate(r, traffic_bytes(r))
  limit = max(times, key=times.get)
  hbm = (f"{_gib(r['hbm_traffic_bytes'])} / {_gib(r['bytes_accessed'])}"
         if "hbm_traffic_bytes" in r else f"- / {_gib(r['bytes_accessed'])}")
  # Several slices: the DCN term, or why there is none (the estimate is
  # then a lower bound that leaves out the cross-slice reduction).
  dcn = (" / DCN not counted" if tc.dcn_uncounted(r, TOPOLOGIES[topo][1])
         else "")
  return [
      name, preset, topo, "yes" if r["fits"] else "**no**",
      f"{_gib(r['total_bytes'])} / {_gib(r['hbm_bytes'])}",
      # "loops": counted per step (each loop body times its trip count);
      # cells compiled before that count them as written (a dagger).
      f"{coll} ({_gib(coll_bytes)} GiB)" + ("" if "loops" in r else " †"),
      hbm,
      " / ".join(f"{t * 1e3:.1f}" for t in times.values()) + dcn,
      f"{mfu:.0%} ({limit})" + (" *" if loop_heavy(r) and (
          "hbm_traffic_bytes" not in r) else ""),
      f"{r['batch_size']} / {r['est_max_batch']}", change_note(r)]


def table(results: dict) -> str:
  """The grid's Markdown table: per recorded cell, whether it fits, its
  HBM and collectives per chip and the roofline estimate of its step."""
  rows = []
  for key, r in results.items():
    name, preset, topo = key.split("|")
    if "skipped" in r:
      continue
    if "error" in r:
      rows.append([name, preset, topo, "error: " + r["error"][:80]] +
                  [""] * 7)
    elif r.get("refused"):   # libtpu would not compile it: no report
      rows.append([name, preset, topo, "**no**",
                   f"> {_gib(r['temp_bytes'])} / {_gib(r['hbm_bytes'])} "
                   "(temporaries alone; libtpu refused to compile)"] +
                  [""] * 4 + [f"{r['batch_size']} / -", ""])
    else:
      rows.append(_compiled_row(name, preset, topo, r))
  return bench.markdown_table(
      ["config", "preset", "topology", "fits", "HBM/chip GiB (of)",
       "collectives per step (result bytes/chip; † as written)",
       "HBM GiB/step: once / XLA", "est. ms: FLOPs / HBM / ICI (/ DCN)",
       "est. MFU (bound)", "batch / est. largest", "what changed"], rows)


# ---------------------------------------------------------------------------
# The recommended setups.
# ---------------------------------------------------------------------------
# The paper's budget of each configuration, in its unit (tokens or images):
# the gMLP paper's MLM ablation setting (125k steps of 2048 x 128 tokens,
# ../shared/PAPERS.md), 300 ImageNet epochs (configs/imagenet.py), the
# sMLP config's 100k steps of 256 x 1024 tokens (configs/smlp_lm.py).
BUDGETS = {"mlm": 125_000 * 2048 * 128, "imagenet": 300 * 1_281_167,
           "smlp": 100_000 * 256 * 1024}
RECOMMENDED = ("bert_mlm_hypermixer", "bert_mlm_mlp_mixer", "bert_mlm_gmlp",
               "bert_mlm_attention", "bert_mlm_fnet",
               "bert_mlm_linear_attention", "gmlp_b", "mixer_b16",
               "smlp_base_64e")
RECOMMEND_HEAD = """### Recommended setups (compile-mode estimates, not measurements)

Written by `python experiments/pod_plan.py --recommend FILE` from
`results.json`: per model and pod, the fitting cell of highest estimated MFU
among those compiled with the HBM traffic counted once
(`hypermixer_jax/train/hlo_costs.py`); roofline step time, MFU (matmul FLOPs
at the chip's bf16 peak over the step), throughput, chip-hours for the
paper's budget (MLM: 125k steps of 2048 x 128 tokens; ImageNet: 300 epochs;
sMLP: 100k steps of 256 x 1024 tokens) and, where the per-chip batch holds
MFU down, the batch `main.py --mode=compile` suggests (its estimated MFU).
The full grid: `python experiments/pod_plan.py --table`.

"""


def _budget(name: str) -> tuple[float, str]:
  if name.startswith("bert_mlm"):
    return BUDGETS["mlm"], "tokens"
  if name in ("gmlp_b", "mixer_b16"):
    return BUDGETS["imagenet"], "images"
  return BUDGETS["smlp"], "tokens"


def recommend_rows(results: dict, topologies=("v5e-256", "v4-32"),
                   pipelines: dict | None = None) -> list[list]:
  """Per model and pod: the fitting cell of highest estimated MFU among
  those compiled with the HBM traffic counted once, with its step time,
  throughput, chip-hours for the paper's budget (``BUDGETS``) and the batch
  ``tc.suggest_batch`` proposes where the per-chip batch holds MFU down."""
  rows = []
  for name in RECOMMENDED:
    for topo in topologies:
      cells = [(key.split("|")[1], r) for key, r in results.items()
               if key.startswith(f"{name}|") and key.endswith(f"|{topo}")
               and compiled(r) and r.get("fits") and "hbm_traffic_bytes" in r]
      if not cells:
        rows.append([name, topo, "not compiled with the corrected estimator"]
                    + [""] * 6)
        continue
      preset, r = max(cells, key=lambda c: tc.estimate(c[1])[2])
      _, step, mfu = tc.estimate(r)
      _, length = (pipelines or {}).get(name) or pipeline_of(name)
      budget, unit = _budget(name)
      rate = r["batch_size"] * max(length, 1) / step
      best, better, now, _ = tc.suggest_batch(r)
      rows.append([
          name, topo, preset, r["batch_size"], f"{step * 1e3:.1f}",
          f"{mfu:.0%}", f"{rate:,.0f} {unit}/s",
          f"{budget / rate * r['chips'] / 3600:,.0f}",
          f"{best} ({better:.0%})" if best > r["batch_size"] and (
              better >= 1.25 * now) else "-"])
  return rows


def recommend_table(results: dict, **kw) -> str:
  """``recommend_rows`` as a Markdown table (``RECOMMEND_HEAD`` its page's
  head)."""
  return bench.markdown_table(
      ["model", "pod", "preset", "global batch", "est. step ms",
       "est. MFU", "throughput", "chip-hours (paper's budget)",
       "suggested batch (est. MFU)"], recommend_rows(results, **kw))


# ---------------------------------------------------------------------------
# The host cores that feed a host's chips.
# ---------------------------------------------------------------------------
def pipeline_of(name: str) -> tuple[str, int]:
  """(the input pipeline a configuration trains on, as ``bench_input.py``
  labels it: the data task, ' packed' when it packs rows; its row length,
  0 for images)."""
  data = CONFIGS[name][0]().data
  if data.task.startswith("imagenet"):
    return "imagenet_patches", 0
  return (data.task + (" packed" if data.get("packing", False) else ""),
          int(data.seq_len))


def host_rows(results: dict, rates: dict[str, float],
              pipelines: dict[str, tuple[str, int]] | None = None
              ) -> list[list]:
  """Per compiled cell: what a host's chips consume per second at the
  estimated step time (an upper bound: the roofline step is a lower bound),
  in tokens (text rows x their length) or images; the pipeline; what one
  core supplies through it in the same unit (``rates``: rows of
  ``RATE_SEQ_LEN`` or images per second); and the cores a host needs."""
  rows = []
  for key, r in results.items():
    if not compiled(r):
      continue
    name, preset, topo = key.split("|")
    pipeline, length = (pipelines or {}).get(name) or pipeline_of(name)
    _, step, _ = tc.estimate(r, traffic_bytes(r))
    per_host = r["batch_size"] * min(CHIPS_PER_HOST, r["chips"]) / r["chips"]
    need = per_host * max(length, 1) / step
    rate = rates.get(pipeline)
    supply = rate * (RATE_SEQ_LEN if length else 1) if rate else None
    rows.append([name, preset, topo,
                 f"{per_host:g} x {length}" if length else f"{per_host:g}",
                 f"{step * 1e3:.1f}", f"{need:,.0f}",
                 "tokens" if length else "images", pipeline,
                 f"{supply:,.0f}" if supply else "not measured",
                 f"{need / supply:.1f}" if supply else ""])
  return rows


def host_table(results: dict, rates: dict[str, float]) -> str:
  """``host_rows`` as a Markdown table."""
  return bench.markdown_table(
      ["config", "preset", "topology", "examples per host per step",
       "est. step ms", "host consumes /s", "unit", "pipeline",
       "one core supplies /s", "cores a host needs"],
      host_rows(results, rates))
