r"""Token-mixing cost against sequence length (Mai et al. 2023, §4.4, Fig. 2).

The paper times one input through the token-mixing stage of HyperMixer and
of the Transformer (repeated 1,000 times) and counts its floating-point
operations, as functions of the length N. Here: the token-mixing module of
each of the six ~11M GLUE models (zoo ``glue_<mixer>``, d=256: HyperMixer
with tied hypernetworks d'=768, self-attention and linear attention with 4
heads, MLP-Mixer's token MLP D_S=512, gMLP's spatial gating unit d_ffn=512,
FNet's Fourier transform), alone, on one example ``[1, N, d]``:

* wall time: the jitted forward, compiled once; at each N every mixer and
  a 1024 x 1024 float32 matmul (the machine's ceiling at that moment) timed
  in the same interleaved rounds (``bench.against_ceiling``), the median
  round reported, with the mixer's FLOP/s as a fraction of the ceiling;
* FLOPs: XLA's count for the compiled forward (attention's on its
  materialised form: XLA counts the CPU's block-wise scan body once);
* the growth exponent: the log-log slope over the upper half of the lengths
  (time in units of its rounds' ceiling: lengths are timed at different
  moments).

MLP-Mixer's and gMLP's token mixers have weights per position, so each N
gets a module built for that N (``max_len=N``). A length whose compiled
forward needs more than ``--max_gib`` (XLA's memory analysis) is skipped and
recorded as such.

  --scale=small  N = 32 ... 8192 (powers of 2) on this machine's CPU, 5
                 rounds of ~0.3 s per mixer and N.
  --scale=paper  the same modules, N = 32 ... 16384, 10 rounds of ~1 s
                 (meant for an accelerator).

  taskset -c 1 python experiments/token_mixing_cost.py --scale=small --out=experiments/results/token_mixing_cost

Writes ``results.json``, ``table.md`` and ``token_mixing_cost.png`` (time
and FLOPs against N, log-log) into ``--out``.
"""
from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hypermixer_jax import experiment
from hypermixer_jax import models
from hypermixer_jax.experiment import bench
from hypermixer_jax.models import zoo

MIXERS = ("hypermixer", "attention", "linear_attention", "mlp_mixer", "gmlp",
          "fnet")
LABELS = {"hypermixer": "HyperMixer", "attention": "Attention",
          "linear_attention": "Linear attention", "mlp_mixer": "MLP-Mixer",
          "gmlp": "gMLP (SGU)", "fnet": "FNet"}
SCALES = {
    "small": dict(lengths=tuple(2 ** k for k in range(5, 14)), rounds=5,
                  min_seconds=0.3),
    "paper": dict(lengths=tuple(2 ** k for k in range(5, 15)), rounds=10,
                  min_seconds=1.0),
}
PAPER_CLAIM = (
    "Paper (§4.4, Fig. 2; a figure, no numbers): for short inputs the "
    "Transformer's token mixing needs slightly fewer FLOPs than HyperMixer's "
    "(the hidden layer dominates), yet HyperMixer is faster in wall time at "
    "every N; at long N attention's quadratic term dominates and it becomes "
    "much slower than HyperMixer, whose cost is linear in N.")


def mixer_module(mixer: str, n: int):
  """``(module, d)``: the token mixer of zoo ``glue_<mixer>`` for length n."""
  return zoo.token_mixer(f"glue_{mixer}", n)


def _counted_module(module):
  """The module whose compiled forward gives the FLOP count. Softmax
  attention runs block-wise on CPU for long rows (a scan with an online
  softmax), and XLA's cost analysis counts a scan's body once, not once per
  step; the same arithmetic materialised (``implementation='xla'``) is
  counted instead. Linear attention needs no stand-in here: on one unpacked,
  non-causal row its chunked form is a single einsum, no scan."""
  if isinstance(module, models.SelfAttention):
    return module.clone(implementation="xla")
  return module


def prepare(mixer: str, n: int, *, max_gib: float = 8.0, seed: int = 0
            ) -> tuple[dict, object]:
  """``(record, call)`` of one ``[1, n, d]`` example through ``mixer``: its
  compiled forward, XLA's FLOPs and memory, and a call to time (None where
  it needs more than ``max_gib``)."""
  module, d = mixer_module(mixer, n)
  counted = _counted_module(module)
  x = jax.random.normal(jax.random.key(seed), (1, n, d), jnp.float32)
  params = jax.jit(module.init)(jax.random.key(seed + 1), x)
  fwd = jax.jit(module.apply)
  t0 = time.perf_counter()
  compiled = fwd.lower(params, x).compile()
  compile_s = time.perf_counter() - t0
  need = experiment.compiled_bytes(compiled)
  cost = bench.xla_cost(compiled if counted is module else jax.jit(
      counted.apply).lower(params, x).compile())
  out = dict(mixer=mixer, n=n, d=d, flops=float(cost.get("flops", np.nan)),
             bytes_accessed=float(cost.get("bytes accessed", np.nan)),
             memory_gib=need / 2 ** 30, compile_s=compile_s,
             params=int(sum(np.prod(p.shape)
                            for p in jax.tree.leaves(params))))
  if need > max_gib * 2 ** 30:
    out.update(skipped=f"needs {need / 2 ** 30:.1f} GiB > --max_gib={max_gib}")
    return out, None
  return out, lambda: compiled(params, x)


TIMED = "interleaved rounds with a 1024 x 1024 float32 matmul ceiling"


def measure_length(mixers: Sequence[str], n: int, *, rounds: int,
                   min_seconds: float, max_gib: float = 8.0
                   ) -> dict[str, dict]:
  """``{mixer: record}`` at length ``n``: every mixer and the matmul
  ceiling timed in the same interleaved rounds (``bench.against_ceiling``)."""
  t0 = time.perf_counter()
  prepared = {m: prepare(m, n, max_gib=max_gib) for m in mixers}
  records = {m: out for m, (out, _) in prepared.items()}
  timed = bench.against_ceiling(
      {m: (call, out["flops"]) for m, (out, call) in prepared.items()
       if call is not None}, rounds, min_seconds)
  for m, r in records.items():
    r.update(timed.get(m, {}), **({"timed": TIMED} if m in timed else {}))
    # The whole length's compiles and rounds, shared by its mixers.
    r["wall_s"] = time.perf_counter() - t0
  return records


growth_exponent = bench.loglog_slope


def run(exp: experiment.Experiment, *, lengths: Sequence[int],
        mixers: Sequence[str] = MIXERS, rounds: int = 5,
        min_seconds: float = 0.3, max_gib: float = 8.0) -> dict:
  """Measures every (mixer, N), records them in ``exp``, writes the table and
  figure; returns ``{mixer: {'time': exponent, 'flops': exponent}}``. The
  mixers of one N are timed together (``measure_length``); an N whose
  mixers are all recorded is not timed again."""
  lengths = sorted(int(n) for n in lengths)
  for n in lengths:
    if all(f"{m}/n{n}" in exp.runs for m in mixers):
      continue
    got = measure_length(mixers, n, rounds=rounds, min_seconds=min_seconds,
                         max_gib=max_gib)
    for mixer in mixers:
      exp.run(f"{mixer}/n{n}", lambda m=mixer: got[m])
  series = {m: [exp.runs[f"{m}/n{n}"] for n in lengths] for m in mixers}
  # Time in units of the same rounds' matmul ceiling (seconds x FLOP/s):
  # the lengths are timed at different moments, whose load may differ.
  exponents = {m: dict(
      time=growth_exponent([r["n"] for r in rs], [
          r["time_s"] * r.get("ceiling_flops_s", 1.0)
          if r.get("time_s") is not None else None for r in rs]),
      flops=growth_exponent([r["n"] for r in rs], [r["flops"] for r in rs]))
      for m, rs in series.items()}
  exp.save(exponents=exponents, lengths=lengths, mixers=list(mixers),
           device=str(jax.devices()[0].device_kind),
           backend=jax.default_backend())
  _write_table(exp, lengths, mixers, series, exponents, rounds)
  _plot(exp, series, mixers)
  return exponents


def _write_table(exp, lengths, mixers, series, exponents, rounds) -> None:
  """``table.md``: times (and the rounds' ceiling) and FLOPs per N, with
  attention against HyperMixer."""
  def cell(r, key, scale):
    v = r.get(key)
    return "—" if v is None or not np.isfinite(v) else f"{v * scale:.3g}"

  heads = [f"N={n}" for n in lengths]
  time_rows = [[LABELS[m]] + [cell(r, "time_s", 1e3) for r in series[m]]
               + [f"{exponents[m]['time']:.2f}"] for m in mixers]
  # The machine's matmul FLOP/s in the same rounds, per N.
  ceilings = [next((exp.runs[f"{m}/n{n}"]["ceiling_flops_s"] for m in mixers
                    if "ceiling_flops_s" in exp.runs[f"{m}/n{n}"]), None)
              for n in lengths]
  time_rows.append(["matmul ceiling (GFLOP/s)"] + [
      "—" if c is None else f"{c / 1e9:.3g}" for c in ceilings] + [""])
  flop_rows = [[LABELS[m]] + [cell(r, "flops", 1e-6) for r in series[m]]
               + [f"{exponents[m]['flops']:.2f}"] for m in mixers]
  # Attention against HyperMixer at each N (the same rounds' times).
  pair = ("attention", "hypermixer")
  if all(m in mixers for m in pair):
    for rows, key in ((time_rows, "time_s"), (flop_rows, "flops")):
      rows.append(["Attention / HyperMixer"] + [
          _ratio(exp.runs[f"attention/n{n}"].get(key),
                 exp.runs[f"hypermixer/n{n}"].get(key)) for n in lengths]
                  + [""])
  table = (
      "Median wall time (ms) of one example through the token mixer:\n\n"
      + experiment.markdown_table(["mixer"] + heads + ["exponent"], time_rows)
      + "\n\nXLA-counted forward FLOPs (millions):\n\n"
      + experiment.markdown_table(["mixer"] + heads + ["exponent"], flop_rows))
  notes = (
      f"Backend {jax.default_backend()} ({jax.devices()[0].device_kind}), "
      f"d=256, one example, float32; time: median over {rounds} rounds of "
      "jitted calls, the mixers of one N and a matmul ceiling in the same "
      "interleaved rounds; exponent: log-log slope over the upper half of N "
      "(time in units of its rounds' matmul ceiling). "
      "— : skipped (memory). " + PAPER_CLAIM)
  exp.write_table("Token-mixing cost against sequence length", table, notes)


def _ratio(a, b) -> str:
  ok = a is not None and b and np.isfinite(a) and np.isfinite(b)
  return f"{a / b:.2f}x" if ok else "—"


def _plot(exp, series, mixers) -> None:
  fig, axes = experiment.figure(ncols=2)
  for ax, key, label in ((axes[0, 0], "time_s", "median wall time (s)"),
                         (axes[0, 1], "flops", "XLA forward FLOPs")):
    for m in mixers:
      pts = [(r["n"], r.get(key)) for r in series[m]
             if r.get(key) is not None and np.isfinite(r.get(key))]
      if pts:
        ax.plot(*zip(*pts), marker="o", ms=3, label=LABELS[m])
    experiment.style_axes(ax, "sequence length N", label, xscale="log2",
                          yscale="log", legend=0)
  axes[0, 0].legend(fontsize=7)
  axes[0, 0].set_title(f"one example, {jax.default_backend()}")
  axes[0, 1].set_title("token mixing, d=256")
  exp.save_figure(fig, "token_mixing_cost")


def main() -> None:
  p = experiment.parser("token_mixing_cost", __doc__)
  p.add_argument("--mixers", default=",".join(MIXERS))
  p.add_argument("--max_len", type=int, default=0,
                 help="longest N (0: the scale's)")
  p.add_argument("--max_gib", type=float, default=8.0,
                 help="skip lengths whose compiled forward needs more memory")
  args = experiment.parse(p)
  setting = dict(SCALES[args.scale])
  if args.max_len:
    setting["lengths"] = tuple(n for n in setting["lengths"]
                               if n <= args.max_len)
  exp = experiment.Experiment(args.out, args)
  run(exp, mixers=args.mixers.split(","), max_gib=args.max_gib, **setting)


if __name__ == "__main__":
  main()
