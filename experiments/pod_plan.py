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

The grid, a cell's compile and record, and the tables are
``hypermixer_jax.experiment.pods``; this script is their command line.
"""
import argparse

from hypermixer_jax.experiment import pods


def parse_flags() -> argparse.Namespace:
  """The command line (the grid asked for, and what to do with it)."""
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="experiments/results/pod_plan")
  p.add_argument("--only", nargs="*", default=list(pods.CONFIGS))
  p.add_argument("--presets", nargs="*", default=list(pods.PRESETS))
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
      f"{k}={v:g}" for k, v in pods.PIPELINE_RATES.items()),
                 help="per host core: rows of RATE_SEQ_LEN tokens/s of each "
                 "text pipeline, images/s of the image pipeline")
  return p.parse_args()


def pipeline_rates(text: str) -> dict[str, float]:
  """``--pipeline_rates``: ``PIPELINE=RATE,...`` as a dict."""
  rates = {}
  for item in text.split(","):
    label, _, value = item.rpartition("=")
    if not label:
      raise SystemExit(f"--pipeline_rates: {item!r} is not PIPELINE=RATE "
                       "(e.g. c4_mlm=3163).")
    rates[label] = float(value)
  return rates


def recount(exp) -> None:
  """Adds the matmul FLOPs (traced) to the compiled cells without them."""
  for key, r in exp.runs.items():
    if not pods.compiled(r) or "matmul_flops" in r:
      continue
    r.update(pods.matmul_flops(*key.split("|")))
    exp.save()
    print(key, f"{r['matmul_flops'] / 1e12:.3f} TFLOP of matmuls per chip "
          f"(XLA {r['flops'] / 1e12:.3f})", flush=True)


def compile_grid(exp, args: argparse.Namespace) -> None:
  """Compiles the grid's cells not recorded (``--redo``: and those to
  redo), at most ``--cells`` of them, then prints the table."""
  done = 0
  order = list(pods.cell_order(args.only, args.presets, args.topologies))
  for name, preset, topo in (order[::-1] if args.order == "reverse"
                             else order):
    if not pods.record_cell(exp, name, preset, topo, redo=args.redo):
      continue
    done += 1
    if args.cells and done >= args.cells:
      break
  print(pods.table(exp.runs))


def main():
  args = parse_flags()
  exp = pods.open_results(args.out)
  results = exp.runs
  if args.hosts:
    print(pods.host_table(results, pipeline_rates(args.pipeline_rates)))
    return
  if args.recount:
    recount(exp)
    args.table = True
  if args.recommend:
    with open(args.recommend, "w", encoding="utf-8") as f:
      f.write(pods.RECOMMEND_HEAD + pods.recommend_table(results) + "\n")
    print(pods.recommend_table(results))
    return
  if args.table:
    print(pods.table(results))
    print("\nNot compiled (of the grid asked for):")
    print(pods.missing(results, args.only, args.presets, args.topologies))
    return
  compile_grid(exp, args)


if __name__ == "__main__":
  main()
