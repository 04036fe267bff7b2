"""Pseudo-attention maps (HyperMixer paper §4.7).

The pseudo-attention of output token i on input token j is the size of the
gradient of output i with respect to input j, ``||∂y_i / ∂x_j||``. For a model
without token mixing it is diagonal; on the synthetic task a good model
should look, at each position, at the other object of the same shape.
"""
from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np


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
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  names = list(maps)
  rows = 2 if inputs is not None else 1
  fig, axes = plt.subplots(
      rows, len(names), figsize=(3.2 * len(names), 3.2 * rows + 0.4),
      squeeze=False, gridspec_kw={"height_ratios": [1, 3][-rows:]})
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
  fig.savefig(path, dpi=100)
  plt.close(fig)
