"""Pseudo-attention maps (HyperMixer paper §4.7).

The pseudo-attention of output token i on input token j is the size of the
gradient of output i with respect to input j, ``||∂y_i / ∂x_j||``. A model
without token mixing (the ``none`` control) sees only its per-token layers'
receptive field: with the synthetic task's conv stem (``model.conv_stem=(5,
5)``, two kernel-5 convolutions) the map is the band ``|i - j| <= 4``, and it
is diagonal only without a stem. On the synthetic task a good model should
look, at each position, at the other object of the same shape.
"""
from __future__ import annotations

import io
import os
from typing import Callable, Mapping

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from hypermixer_jax.train import storage


def pseudo_attention(apply_fn: Callable[[jax.Array], jax.Array],
                     x: jax.Array) -> jax.Array:
  """``[N, N]`` map of ``||∂ apply_fn(x)[i] / ∂ x[j]||`` for one sequence.

  Args:
    apply_fn: maps ``[N, d_in]`` floats to ``[N, d_out]`` (one example, no
      batch axis; wrap the model call to add and remove it).
    x: ``[N, d_in]`` input.
  """
  jac = jax.jacrev(apply_fn)(x)  # [N, d_out, N, d_in]
  return jnp.sqrt(jnp.sum(jnp.square(jac), axis=(1, 3)))  # [N, N]


def save_png(maps: Mapping[str, np.ndarray], path: str, *,
             inputs: np.ndarray | None = None,
             targets: np.ndarray | None = None) -> None:
  """One panel per model; each row scaled to its maximum for display.

  ``inputs``/``targets`` (``[N]``) are drawn above the maps when given.
  """
  # An explicit Figure drawn by the Agg canvas: pyplot and matplotlib's
  # global backend are left alone (a notebook's inline plots keep working).
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  names = list(maps)
  rows = 2 if inputs is not None else 1
  fig = Figure(figsize=(3.2 * len(names), 3.2 * rows + 0.4))
  FigureCanvasAgg(fig)
  axes = fig.subplots(rows, len(names), squeeze=False,
                      gridspec_kw={"height_ratios": [1, 3][-rows:]})
  for col, name in enumerate(names):
    m = np.asarray(maps[name], np.float64)
    m = m / np.maximum(m.max(axis=1, keepdims=True), 1e-12)
    if inputs is not None:
      ax = axes[0, col]
      ax.plot(np.asarray(inputs), label="input")
      if targets is not None:
        ax.plot(np.asarray(targets), label="target")
      ax.set_xlim(0, len(inputs) - 1)
      ax.set_xticks([])
      if col == 0:
        ax.legend(fontsize="small", loc="upper right")
    ax = axes[rows - 1, col]
    ax.imshow(m, cmap="viridis", aspect="auto", interpolation="nearest")
    ax.set_title(name)
    ax.set_xlabel("input token j")
    if col == 0:
      ax.set_ylabel("output token i")
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=100)
  storage.path(path).write_bytes(buffer.getvalue())


class Evaluator:
  """Declared evaluator (``config.evals``, type ``pseudo_attention``): the
  map of the first example of ``split`` (default ``config.eval_split``),
  saved as ``<workdir>/<filename>`` and to TensorBoard.

  For models of continuous per-token inputs ``[B, N, 1]`` with per-token
  ``targets`` (the synthetic task). ``run`` returns ``map [N, N]`` and the
  example's ``inputs``/``targets`` ``[N]``.
  """

  def __init__(self, context, *, split: str = "",
               filename: str = "pseudo_attention.png"):
    self.ctx = context
    self.split = split
    self.filename = filename

  def run(self, state, step: int) -> dict[str, np.ndarray]:
    c = self.ctx
    example = next(iter(c.pipeline(self.split or c.config.eval_split, 1)))
    params = jax.device_get(state.params)
    x = jnp.asarray(example["inputs"][0])
    apply = jax.jit(lambda x: c.model.apply({"params": params}, x[None])[0])
    out = {"map": np.asarray(pseudo_attention(apply, x)),
           "inputs": np.asarray(example["inputs"][0, :, 0]),
           "targets": np.asarray(example["targets"][0, :, 0])}
    if c.is_main:
      path = os.path.join(c.workdir, self.filename)
      title = c.config.model.get("mixer", "model")
      save_png({title: out["map"]}, path, inputs=out["inputs"],
               targets=out["targets"])
      import matplotlib.image  # pylint: disable=g-import-not-at-top
      png = io.BytesIO(storage.path(path).read_bytes())
      c.write_image("pseudo_attention", step,
                    matplotlib.image.imread(png, format="png")[..., :3])
      logging.info("pseudo-attention map written to %s", path)
    return out
