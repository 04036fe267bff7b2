r"""Pod plan: the paper-scale configurations compiled for Cloud TPU topologies.

For each (configuration, sharding preset, topology) cell, the train step is
compiled for TPU without a TPU (``hypermixer_jax.train.compile``: libtpu's
compile-only devices, abstract state) and the per-chip report is kept: fits
or not, HBM per chip, collectives, the roofline estimate of step time and
MFU, and an estimate of the largest global batch that fits (the batch-
proportional part of the temporaries extrapolated linearly from the one
compile; not compiled).

  python experiments/pod_plan.py --out experiments/results/pod_plan
  python experiments/pod_plan.py --out OUT --only glue_mlm_hypermixer --cells 1

Cells are written to ``OUT/results.json`` one by one and a rerun skips the
cells already there, so a long grid can be stopped and resumed; several
processes on one OUT (e.g. one per core, ``--order=reverse`` on the second)
share the grid: a cell being compiled is claimed (``experiment.Experiment``).
``--table``
only prints the markdown table of what is there; ``--hosts`` the input side
of each compiled cell: the examples/s one TPU host's chips consume at the
cell's estimated step time, against what one host core supplies through the
config's input pipeline (``--pipeline_rates``, measured with
``bench_input.py``), i.e. the cores a host needs to feed its chips.
"""
import argparse
import json
import math
import os
import time

from hypermixer_jax import experiment
from hypermixer_jax.train import compile as tc

from hypermixer_jax.experiment import bench as bc  # noqa: E402

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


def _load(path: str, arg: str):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


def _mlm(mixer: str, bert_base: bool = True):
  c = _load("configs/c4_mlm.py", mixer)
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
  c = _load("configs/smlp_lm.py", "base")
  c.model.moe.num_experts = 64
  return c


# Name -> (config factory, what it is).
CONFIGS = {
    "glue_mlm_hypermixer": (lambda: _mlm("hypermixer", False),
                            "configs/c4_mlm.py:hypermixer as it is (GLUE size)"),
    "glue_mlm_hypermixer_bf16": (_glue_mlm_bf16,
                                 "the same in bf16 at batch 2048"),
    **{f"bert_mlm_{m}": (lambda m=m: _mlm(m),
                         f"C4 MLM of glue_{m} at BERT-base width")
       for m in ("hypermixer", "mlp_mixer", "gmlp", "attention", "fnet",
                 "linear_attention")},
    "gmlp_b": (lambda: _load("configs/imagenet.py", "gmlp_b"),
               "configs/imagenet.py:gmlp_b"),
    "mixer_b16": (lambda: _load("configs/imagenet.py", "mixer_b16"),
                  "configs/imagenet.py:mixer_b16"),
    "smlp_base_64e": (_smlp, "configs/smlp_lm.py:base with 64 experts"),
    "causal_lm_hypermixer": (lambda: _load("configs/c4_lm.py", "hypermixer"),
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
  import subprocess  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                          capture_output=True, text=True, check=True
                          ).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--",
                            "hypermixer_jax", "configs"], cwd=root).returncode
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+" if dirty else "")


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
    if "skipped" in r or "error" in r or r.get("refused"):
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
  return bc.markdown_table(
      ["config", "preset", "topology", "examples per host per step",
       "est. step ms", "host consumes /s", "unit", "pipeline",
       "one core supplies /s", "cores a host needs"],
      host_rows(results, rates))


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


def table(results: dict) -> str:
  rows = []
  for key, r in results.items():
    name, preset, topo = key.split("|")
    if "skipped" in r:
      continue
    if "error" in r:
      rows.append([name, preset, topo, "error: " + r["error"][:80]] +
                  [""] * 7)
      continue
    if r.get("refused"):   # libtpu would not compile it: no report
      rows.append([name, preset, topo, "**no**",
                   f"> {_gib(r['temp_bytes'])} / {_gib(r['hbm_bytes'])} "
                   "(temporaries alone; libtpu refused to compile)"] +
                  [""] * 4 + [f"{r['batch_size']} / -", ""])
      continue
    coll = ", ".join(f"{k.replace('collective-', 'c-')} {n}"
                     for k, (n, _) in r["collectives"].items() if n)
    coll_bytes = sum(b for _, b in r["collectives"].values())
    times, _, mfu = tc.estimate(r, traffic_bytes(r))
    limit = max(times, key=times.get)
    hbm = (f"{_gib(r['hbm_traffic_bytes'])} / {_gib(r['bytes_accessed'])}"
           if "hbm_traffic_bytes" in r else f"- / {_gib(r['bytes_accessed'])}")
    rows.append([
        name, preset, topo, "yes" if r["fits"] else "**no**",
        f"{_gib(r['total_bytes'])} / {_gib(r['hbm_bytes'])}",
        # "loops": counted per step (each loop body times its trip count);
        # cells compiled before that count them as written (a dagger).
        f"{coll} ({_gib(coll_bytes)} GiB)" + ("" if "loops" in r else " †"),
        hbm,
        " / ".join(f"{t * 1e3:.1f}" for t in times.values()),
        f"{mfu:.0%} ({limit})" + (" *" if loop_heavy(r) and (
            "hbm_traffic_bytes" not in r) else ""),
        f"{r['batch_size']} / {r['est_max_batch']}", change_note(r)])
  return bc.markdown_table(
      ["config", "preset", "topology", "fits", "HBM/chip GiB (of)",
       "collectives per step (result bytes/chip; † as written)",
       "HBM GiB/step: once / XLA", "est. ms: FLOPs / HBM / ICI",
       "est. MFU (bound)", "batch / est. largest", "what changed"], rows)


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


RECOMMEND_HEAD = """# Recommended setups (compile-mode estimates, not measurements)

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


def recommend_table(results: dict, **kw) -> str:
  return bc.markdown_table(
      ["model", "pod", "preset", "global batch", "est. step ms",
       "est. MFU", "throughput", "chip-hours (paper's budget)",
       "suggested batch (est. MFU)"], recommend_rows(results, **kw))


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


def open_results(out: str):
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
      with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"runs": data}, f, indent=1)
      os.replace(path + ".tmp", path)
  return experiment.Experiment(out)


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


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="experiments/results/pod_plan")
  p.add_argument("--only", nargs="*", default=list(CONFIGS))
  p.add_argument("--presets", nargs="*", default=list(PRESETS))
  p.add_argument("--topologies", nargs="*",
                 default=["v5e-256", "v4-32", "v5p-128", "v6e-256",
                          "2x v5e-256"])
  p.add_argument("--cells", type=int, default=0, help="stop after N cells")
  p.add_argument("--order", choices=("forward", "reverse"), default="forward",
                 help="reverse: the grid from its last cell (a second "
                 "process on the same --out)")
  p.add_argument("--recount", action="store_true",
                 help="add the matmul FLOPs (traced, no compile) to the "
                 "compiled cells recorded without them, then print the "
                 "table")
  p.add_argument("--redo", action="store_true",
                 help="compile again the recorded cells of the grid asked "
                 "for that lack the HBM traffic counted once; the record's "
                 "estimate is kept under 'previous'")
  p.add_argument("--table", action="store_true")
  p.add_argument("--recommend", default="",
                 help="write the recommended-setup table (Markdown) to this "
                 "file, e.g. experiments/results/pod_plan/recommended.md")
  p.add_argument("--hosts", action="store_true",
                 help="print the host-cores table of the compiled cells")
  p.add_argument("--pipeline_rates", default=",".join(
      f"{k}={v:g}" for k, v in PIPELINE_RATES.items()),
                 help="per host core: rows of RATE_SEQ_LEN tokens/s of each "
                 "text pipeline, images/s of the image pipeline")
  args = p.parse_args()
  exp = open_results(args.out)
  results = exp.runs
  if args.hosts:
    rates = {}
    for item in args.pipeline_rates.split(","):
      label, _, value = item.rpartition("=")
      if not label:
        raise SystemExit(f"--pipeline_rates: {item!r} is not PIPELINE=RATE "
                         "(e.g. c4_mlm=3163).")
      rates[label] = float(value)
    print(host_table(results, rates))
    return
  if args.recount:
    for key, r in results.items():
      if ("skipped" in r or "error" in r or "matmul_flops" in r
          or r.get("refused")):
        continue
      r.update(matmul_flops(*key.split("|")))
      exp.save()
      print(key, f"{r['matmul_flops'] / 1e12:.3f} TFLOP of matmuls per chip "
            f"(XLA {r['flops'] / 1e12:.3f})", flush=True)
    args.table = True
  if args.recommend:
    with open(args.recommend, "w", encoding="utf-8") as f:
      f.write(RECOMMEND_HEAD + recommend_table(results) + "\n")
    print(recommend_table(results))
    return
  if args.table:
    print(table(results))
    print("\nNot compiled (of the grid asked for):")
    print(missing(results, args.only, args.presets, args.topologies))
    return
  done = 0
  order = list(cell_order(args.only, args.presets, args.topologies))
  for name, preset, topo in (order[::-1] if args.order == "reverse"
                             else order):
    key = f"{name}|{preset}|{topo}"
    exp.reload()
    if key in exp.runs:
      old = exp.runs[key]
      if not (args.redo and compiled(old) and "hbm_traffic_bytes" not in old):
        continue
      # Compiled again; what the record said is kept beside it.
      r = compile_cell(name, preset, topo)
      r["previous"] = previous_of(name, old)
      exp.reload()
      exp.runs[key] = r
      exp.save()
      print(key, "recompiled", flush=True)
    else:
      # Skipped when another process recorded the cell meanwhile.
      exp.run(key, lambda n=name, p=preset, t=topo: compile_cell(n, p, t))
    done += 1
    if args.cells and done >= args.cells:
      break
  print(table(exp.runs))


if __name__ == "__main__":
  main()
