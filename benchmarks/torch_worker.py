"""PyTorch side of the benchmarks that compare with PyTorch code.

Run by ``experiment.bench.TorchTimed`` as a child process with the
interpreter of an environment that has torch (torch is no dependency of this
project, and this file imports nothing of it): ``python torch_worker.py
WORKLOAD JSON``.
It builds the workload, then answers each line ``warm`` (two untimed calls,
then sizes a round to ``min_seconds``) or ``round`` (seconds per call over one
round) on stdout, so that the parent can interleave its own rounds with
these on one core. One torch thread.

Workloads (JSON keys):
* ``mha``: ``nn.MultiheadAttention(d, heads)`` forward on ``[batch, n, d]``,
  ``need_weights=False`` (PyTorch's fused path), inference mode.
* ``hypermixing`` / ``hypermixing_train``: the official HyperMixing
  (``official``: a checkout of idiap/hypermixing, imported from there, never
  copied) with ``hyper_dim``, self-mixing, forward in inference mode, or
  forward + backward of ``sum(y^2)`` to the parameters and the input.
* ``matmul``: ``torch.matmul(a, b)`` in inference mode, ``a`` of shape
  ``lhs`` and ``b`` of shape ``rhs``; ``lhs_t`` / ``rhs_t``: the operand is
  made with its last two axes swapped and viewed transposed, as the
  official HyperMixing passes its values and W2 to ``bmm``.
* ``sleep``: sleeps ``seconds`` (tests the protocol without torch).
"""
from __future__ import annotations

import json
import sys
import time


def build(workload: str, cfg: dict):
  """The call to time, built from ``cfg`` (see the module doc)."""
  if workload == "sleep":  # the protocol's own test: no torch needed
    return lambda: time.sleep(cfg["seconds"])
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(1)
  torch.manual_seed(0)
  if workload == "matmul":
    def operand(shape, transposed):
      if not transposed:
        return torch.randn(shape)
      return torch.randn([*shape[:-2], shape[-1], shape[-2]]).transpose(-1, -2)
    a = operand(cfg["lhs"], cfg.get("lhs_t"))
    b = operand(cfg["rhs"], cfg.get("rhs_t"))

    def product():
      with torch.inference_mode():
        return torch.matmul(a, b)
    return product
  x = torch.randn(cfg["batch"], cfg["n"], cfg["d"])
  if workload == "mha":
    mha = torch.nn.MultiheadAttention(cfg["d"], cfg["heads"],
                                      batch_first=True).eval()

    def call():
      with torch.inference_mode():
        return mha(x, x, x, need_weights=False)[0]
    return call
  if workload in ("hypermixing", "hypermixing_train"):
    sys.path.insert(0, cfg["official"])
    from hypermixing import HyperMixing  # pylint: disable=g-import-not-at-top
    mixer = HyperMixing(cfg["d"], cfg["hyper_dim"], num_heads=cfg["heads"],
                        max_length=cfg["n"] + 2)
    if workload == "hypermixing":
      def call():
        with torch.inference_mode():
          return mixer(x, x, x)
      return call
    xg = x.clone().requires_grad_(True)

    def train_call():
      mixer.zero_grad(set_to_none=True)
      xg.grad = None
      loss = mixer(xg, xg, xg).square().sum()
      loss.backward()
      return loss
    return train_call
  raise ValueError(f"unknown torch workload {workload!r}")


def serve(workload: str, cfg: dict) -> None:
  call = build(workload, cfg)
  inner = 1
  for line in sys.stdin:
    cmd = line.strip()
    if cmd == "warm":
      call()
      t0 = time.perf_counter()
      call()
      once = max(time.perf_counter() - t0, 1e-9)
      inner = max(1, int(-(-cfg["min_seconds"] // once)))
      print("ok", flush=True)
    elif cmd == "round":
      t0 = time.perf_counter()
      for _ in range(inner):
        call()
      print((time.perf_counter() - t0) / inner, flush=True)
    else:
      return


if __name__ == "__main__":
  serve(sys.argv[1], json.loads(sys.argv[2]))
