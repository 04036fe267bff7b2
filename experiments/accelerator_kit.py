r"""The measurements to take on a lent accelerator (one GPU or a TPU host).

One run, at most about 8 minutes on one H100 / H200 or TPU host, writes
``OUT/results.json`` (and ``OUT/table.md``):

1. ``mlm_mfu``: the BERT-base-width C4 MLM train step (12 layers, d = 768,
   d_ffn = 3072, 128 tokens, bf16 compute, AdamW) of each of the six
   mixers, measured: seconds per step, tokens/s and MFU = the step's matmul
   FLOPs (``flop_count``, the figure compile mode's estimate uses) per
   second over the device's dense bf16 peak (``metrics.PEAK_FLOPS``).
   Compare with ``main.py --mode=compile`` / ``experiments/pod_plan.py``.
2. ``token_mixing``: HyperMixing (d = 768, d' = 2304, as the BERT-width
   HyperMixer) against ``jax.nn.dot_product_attention`` (12 heads of 64;
   ``implementation='cudnn'``, i.e. flash attention, on a GPU; XLA's
   elsewhere), forward and forward + backward (gradients of sum(y^2) to the
   input and the parameters), N = 512 ... 32,768 at 16,384 tokens per call
   (batch 16,384 / N, at least 1).
3. ``smlp_vs_switch``: the sMLP LM (deterministic sMoE, Base Layers tMoE)
   against a Switch Transformer with as many dense layers as bring its
   matmul FLOPs per step closest to sMLP's: tokens/s of each train step.
4. ``profile`` (asked for with ``--sections``): where the device time of
   some of those train steps goes, by model part and instruction (a
   ``jax.profiler`` trace; on a GPU run it with
   ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` so kernels keep their
   instruction names).

    python experiments/accelerator_kit.py --out experiments/results/accelerator_kit
    python experiments/accelerator_kit.py --toy --out /tmp/kit   # CPU

``--toy`` shrinks every size (CI runs it on CPU); a row that fails (e.g.
out of memory) records its error and the run goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from hypermixer_jax.experiment import bench as bc
from hypermixer_jax.experiment import kit
from hypermixer_jax.train import metrics as metrics_lib


def _flags(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="experiments/results/accelerator_kit")
  p.add_argument("--toy", action="store_true",
                 help="tiny sizes, float32: a check that runs on CPU")
  p.add_argument("--mixers", nargs="*", default=list(kit.MIXERS),
                 help="the MLM train steps to measure")
  p.add_argument("--lengths", nargs="*", type=int, default=None,
                 help="token-mixing lengths (default: 512 ... 32,768)")
  p.add_argument("--sections", nargs="*", default=list(kit.SECTIONS[:3]),
                 choices=kit.SECTIONS,
                 help="what to measure (default: all but profile)")
  p.add_argument("--profiled", nargs="*", default=list(kit.PROFILED),
                 help="the train steps `profile` splits (MLM mixers, smlp, "
                      "switch)")
  p.add_argument("--report_only", action="store_true",
                 help="rewrite table.md from OUT/results.json, measure nothing")
  return p.parse_args(argv)


def _earlier(out: str, device: str, toy: bool) -> dict:
  """OUT/results.json of an earlier run on the same kind of device: its
  sections are kept, the rows measured now replace theirs. A record of
  another device kind (or toy size) is never overwritten."""
  path = os.path.join(out, "results.json")
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    old = json.load(f)
  if (kit.device_kind(old.get("device", "")) != kit.device_kind(device)
      or old.get("toy") != toy):
    raise SystemExit(
        f"{path} holds runs on {old.get('device')!r} (toy={old.get('toy')}),"
        f" this run is on {device!r} (toy={toy}): pass another --out")
  return old


def main(argv=None) -> dict:
  args = _flags(argv)
  if args.report_only:
    with open(os.path.join(args.out, "results.json"), encoding="utf-8") as f:
      results = json.load(f)
    bc.write_outputs(args.out, "table", kit.table(results), results)
    return results
  dtype = "float32" if args.toy else "bfloat16"
  device = bc.device_name()
  results = _earlier(args.out, device, args.toy)
  results.update(device=kit.device_kind(device), toy=args.toy, dtype=dtype,
                 setup=kit.setup(args.toy),
                 peak_flops=metrics_lib.peak_flops(
                     jax.devices()[0].device_kind))
  run = {"jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
         "device": device,
         # This run's dense ceiling: MFU is read against it too.
         "matmul_flops_per_s": bc.matmul_ceiling(
             jnp.dtype(dtype), 256 if args.toy else 8192)}
  sections = {
      "mlm_mfu": lambda: kit.mlm_mfu(args.toy, dtype, args.mixers),
      "token_mixing": lambda: kit.token_mixing(
          args.toy, jnp.dtype(dtype), args.lengths),
      "smlp_vs_switch": lambda: kit.smlp_vs_switch(args.toy, dtype),
      "profile": lambda: kit.profile(args.toy, dtype, args.profiled)}
  for name in args.sections:
    t0 = time.perf_counter()
    # Rows measured now replace theirs; the section's other rows stay, and
    # each row's run (date, ceiling, device flags) stays recorded.
    rows = sections[name]()
    results[name] = {**results.get(name, {}), **rows}
    kit.add_run(results, name, dict(run, rows=list(rows),
                                    wall_s=time.perf_counter() - t0))
    # Written after every section: a run stopped by its time limit keeps
    # what it measured.
    bc.write_outputs(args.out, "table", kit.table(results), results)
    print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
  print(kit.table(results))
  return results


if __name__ == "__main__":
  main()
