"""Official MLP-Mixer checkpoints (vision_transformer / big_vision ``.npz``) in the zoo.

The release (Tolstikhin et al. 2021; ``gs://mixer_models/...``) stores the
Flax parameters of ``vit_jax/models_mixer.py`` flattened with ``/``:

    stem/kernel                                   [P, P, 3, C]   (conv, stride P)
    stem/bias                                     [C]
    MixerBlock_{i}/LayerNorm_0/{scale,bias}       [C]            (before token mixing)
    MixerBlock_{i}/token_mixing/Dense_0/kernel    [N, D_S]       (acts on [B, C, N])
    MixerBlock_{i}/token_mixing/Dense_0/bias      [D_S]
    MixerBlock_{i}/token_mixing/Dense_1/kernel    [D_S, N]
    MixerBlock_{i}/token_mixing/Dense_1/bias      [N]
    MixerBlock_{i}/LayerNorm_1/{scale,bias}       [C]            (before channel mixing)
    MixerBlock_{i}/channel_mixing/Dense_0/kernel  [C, D_C]  (+ bias [D_C])
    MixerBlock_{i}/channel_mixing/Dense_1/kernel  [D_C, C]  (+ bias [C])
    pre_head_layer_norm/{scale,bias}              [C]
    head/kernel, head/bias                        [C, K], [K]    (absent if K = 0)

with y = x + TM(LN0(x)^T)^T, z = y + CM(LN1(y)), logits = head(mean_n LN(z)),
LayerNorm epsilon 1e-6 and Flax's default (tanh) GELU. The zoo's Mixer
(``family='continuous'``, ``head='image'``, ``block='pre_ln'``, mixer
``mlp_mixer``) is the same network: patches flattened in (row, column,
channel) order make the stem Dense equal to the conv, the token-mixing
kernels are the ``MlpMixerTokenMixing`` weights (``kernel_in`` = Dense_0,
``kernel_out`` = Dense_1), the final LayerNorm and the mean pool are the
encoder's ``final_norm`` and the image head's pool. ``approximate_gelu=True``
selects the release's GELU.
``convert`` reads every array of the file, each of the shape that the model
built from ``stem/kernel``, ``MixerBlock_0`` and ``head/kernel`` expects:
a later block of another width, or an extra array, stops it.

The older layout of the first release files (pre-Linen Flax, as big_vision's
Mixer loader reads them) is accepted too (``from_older_layout``):

    embedding/{kernel,bias}                       (= stem)
    Mixer/encoderblock_{i}/LayerNorm_{j}/...      (pre-Linen numbers: j counts
                                                   every submodule of the block)
    Mixer/encoderblock_{i}/token_mixing_phase_0/{kernel1,bias1,kernel2,bias2}
    Mixer/encoderblock_{i}/channel_mixing_phase_0/{kernel1,bias1,kernel2,bias2}
    Mixer/encoder_norm/{scale,bias}               (= pre_head_layer_norm)

(kernels and biases possibly with extra axes of size 1).

The release's models see pixels scaled to [-1, 1], ``(x - 127.5) / 127.5``,
not ImageNet's mean/std: the conversion records it (``config.json`` of the
output holds ``data.image_normalization='inception'`` beside the model), and
the printed flags set it.

Fine-tuning at another resolution (``adapt_resolution``), which the official
code does not offer: the token-mixing weights are tied to the N = h x w patch
positions. They are functions on the patch grid, so they are resized as
images to the new grid h' x w' (bilinear by default, like ViT's position
embeddings): ``kernel_in`` [h, w, D_S] -> [h', w', D_S], ``kernel_out``
[D_S, h, w] -> [D_S, h', w'], ``bias_out`` [h, w] -> [h', w']. The hidden
units sum over all positions, and each old patch's region is now covered by
N'/N patches, so ``kernel_in`` is divided by N'/N: on an image whose new
patches repeat the old ones (an integer upsampling, ``method='nearest'``)
the hidden activations, and so every output, are exactly the old ones.

    python -m hypermixer_jax.models.official_mixer --npz=imagenet21k_Mixer-B_16.npz \
        --output=/ckpt/mixer_b16_in21k [--image_size=384]
    # a zoo Mixer's own checkpoint, for fine-tuning at 384 pixels:
    python -m hypermixer_jax.models.official_mixer --checkpoint=/ckpt/run \
        --image_size=384 --patch_size=16 --output=/ckpt/run_384

write the parameters as a checkpoint that ``--config.init_checkpoint``
loads (``configs/imagenet.py:mixer_b16`` with the printed ``--config`` flags),
and its ``config.json`` (``imported_config``: the model's sizes, the input
scaling and resolution), which ``--mode=evaluate --workdir=OUTPUT
--config=configs/imagenet.py:mixer_b16`` reads.
"""
from __future__ import annotations

import math
import os
import re
import sys
from typing import Mapping
import zipfile
import zlib

from etils import epath

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from hypermixer_jax.models import encoders
from hypermixer_jax.models import zoo

Params = dict
# What the release's models were trained on (``data.image_normalization``).
IMAGE_NORMALIZATION = "inception"


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """The flat ``{'a/b/c': array}`` of an official ``.npz`` (local or gs://),
  in the current layout (older release files are converted)."""
  path = epath.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"--npz={path}: no such file.")
  try:
    with path.open("rb") as f:
      z = np.load(f, allow_pickle=False)
      if isinstance(z, np.lib.npyio.NpzFile):
        with z:
          flat = {k: np.asarray(z[k]) for k in z.files}
  # A truncated or corrupt download: zipfile's and zlib's own errors, numpy's
  # EOFError or ValueError (a header cut short, bytes that are no array).
  except (zipfile.BadZipFile, zlib.error, EOFError, ValueError) as e:
    raise ValueError(f"--npz={path}: not a readable .npz ({type(e).__name__}: "
                     f"{e}); download it again.") from e
  if not isinstance(z, np.lib.npyio.NpzFile):
    raise ValueError(
        f"--npz={path}: a single array ({type(z).__name__} of shape "
        f"{getattr(z, 'shape', '?')}), not an .npz of named parameters; "
        "the official checkpoints are .npz files (gs://mixer_models/...).")
  return from_older_layout(flat)


def _natural(name: str) -> list:
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _linen_names(names: list[str]) -> dict[str, str]:
  """Pre-Linen submodule names -> Linen's: pre-Linen Flax numbered the
  submodules of a module together (``LayerNorm_0``, ``LayerNorm_2``), Linen
  numbers each prefix on its own (``LayerNorm_0``, ``LayerNorm_1``), in the
  same order."""
  count: dict[str, int] = {}
  out = {}
  for name in sorted(names, key=_natural):
    m = re.fullmatch(r"(.*)_\d+", name)
    if m:
      out[name] = f"{m.group(1)}_{count.setdefault(m.group(1), 0)}"
      count[m.group(1)] += 1
    else:
      out[name] = name
  return out


def from_older_layout(flat: Mapping[str, np.ndarray]
                      ) -> dict[str, np.ndarray]:
  """``flat`` in the current layout (see the module docstring); files
  already in it are returned unchanged."""
  if not any(k.startswith("Mixer/") for k in flat):
    return dict(flat)
  out = {}
  blocks: dict[str, dict[str, np.ndarray]] = {}
  for key, x in flat.items():
    if key.startswith("Mixer/encoderblock_"):
      block, rest = key[len("Mixer/"):].split("/", 1)
      blocks.setdefault(block, {})[rest] = x
    elif key.startswith("Mixer/encoder_norm/"):
      out["pre_head_layer_norm/" + key.rsplit("/", 1)[1]] = x
    elif key.startswith("embedding/"):
      out["stem/" + key.split("/", 1)[1]] = x
    elif key.startswith("Mixer/"):
      raise ValueError(f"older-layout Mixer checkpoint: unexpected {key!r}.")
    else:
      out[key] = x
  for block, params in blocks.items():
    i = block[len("encoderblock_"):]
    modules = _linen_names(sorted({k.split("/", 1)[0] for k in params}))
    for key, x in params.items():
      module, leaf = key.split("/", 1)
      new = modules[module]
      phase = re.fullmatch(r"(token|channel)_mixing_phase_0", module)
      if phase:   # kernel1/bias1 -> Dense_0, kernel2/bias2 -> Dense_1
        m = re.fullmatch(r"(kernel|bias)([12])", leaf)
        if not m:
          raise ValueError(f"older-layout Mixer checkpoint: unexpected "
                           f"{'Mixer/' + block + '/' + key!r}.")
        new = f"{phase.group(1)}_mixing/Dense_{int(m.group(2)) - 1}"
        leaf = m.group(1)
        x = np.squeeze(x)
      out[f"MixerBlock_{i}/{new}/{leaf}"] = x
  return out


def _block_indices(flat: Mapping[str, np.ndarray]) -> list[int]:
  found = sorted({int(m.group(1)) for k in flat
                  if (m := re.match(r"MixerBlock_(\d+)/", k))})
  if found != list(range(len(found))) or not found:
    raise ValueError(f"official Mixer checkpoint: blocks MixerBlock_0.. "
                     f"expected, found indices {found}.")
  return found


def _get(flat, key, ndim=None):
  if key not in flat:
    raise ValueError(f"official Mixer checkpoint has no {key!r} (has e.g. "
                     f"{sorted(flat)[:6]}); is it an MLP-Mixer .npz?")
  x = flat[key]
  if ndim is not None and x.ndim != ndim:
    raise ValueError(f"official Mixer checkpoint: {key} has shape {x.shape}, "
                     f"expected {ndim} dimensions.")
  return x


def model_config(flat: Mapping[str, np.ndarray],
                 num_classes: int | None = None) -> ml_collections.ConfigDict:
  """The zoo Mixer config whose parameters have the checkpoint's shapes.

  The sizes are read from ``stem/kernel``, ``MixerBlock_0`` and
  ``head/kernel`` (``convert`` checks every other array against them).
  ``num_classes`` overrides the checkpoint's head (a new head is then
  initialised when fine-tuning, see ``init_reinit``); without a head in the
  checkpoint it is required.
  """
  stem = _get(flat, "stem/kernel", 4)
  p, p2, c_in, c = stem.shape
  if p != p2 or c_in != 3:
    raise ValueError(f"stem/kernel {stem.shape}: square RGB patches expected.")
  blocks = _block_indices(flat)
  n, d_s = _get(flat, "MixerBlock_0/token_mixing/Dense_0/kernel", 2).shape
  d_c = _get(flat, "MixerBlock_0/channel_mixing/Dense_0/kernel", 2).shape[1]
  side = math.isqrt(n)
  if side * side != n:
    raise ValueError(f"token_mixing kernels have {n} patches, not a square "
                     "grid.")
  if num_classes is None:
    if "head/kernel" not in flat:
      raise ValueError("the checkpoint has no head (num_classes=0 release): "
                       "pass num_classes for the new head.")
    num_classes = int(_get(flat, "head/kernel", 2).shape[1])
  cfg = zoo.get_model_config("mixer_b16")
  cfg.update(num_layers=len(blocks), d_model=int(c), d_ffn=int(d_c),
             max_len=int(n), input_dim=int(p * p * 3), patch_size=int(p),
             num_classes=int(num_classes), approximate_gelu=True)
  cfg.mixer_kwargs.token_mlp_dim = int(d_s)
  return cfg


def _layout(flat: Mapping[str, np.ndarray]) -> dict:
  """The zoo Mixer's ``params`` tree with, at each leaf, the ``.npz`` key
  it is read from (the head only if the file has one)."""
  # common.LayerNorm / common.Dense hold Flax's module as "ln" / "dense".
  def ln(prefix):
    return {"ln": {"scale": f"{prefix}/scale", "bias": f"{prefix}/bias"}}

  def dense(prefix):
    return {"kernel": f"{prefix}/kernel", "bias": f"{prefix}/bias"}

  stack = {}
  for i in _block_indices(flat):
    b = f"MixerBlock_{i}"
    tm0, tm1 = dense(f"{b}/token_mixing/Dense_0"), dense(
        f"{b}/token_mixing/Dense_1")
    stack[f"layer_{i}"] = {
        "mixing_norm": ln(f"{b}/LayerNorm_0"),
        "token_mixing": {"kernel_in": tm0["kernel"], "bias_in": tm0["bias"],
                         "kernel_out": tm1["kernel"], "bias_out": tm1["bias"]},
        "ffn_norm": ln(f"{b}/LayerNorm_1"),
        "feature_mixing": {
            "wi": {"dense": dense(f"{b}/channel_mixing/Dense_0")},
            "wo": {"dense": dense(f"{b}/channel_mixing/Dense_1")}},
    }
  stack["final_norm"] = ln("pre_head_layer_norm")
  layout = {"encoder": {"stem": {"dense": dense("stem")}, "stack": stack}}
  if "head/kernel" in flat:
    layout["classifier"] = {"dense": dense("head")}
  return layout


def convert(flat: Mapping[str, np.ndarray]) -> Params:
  """The zoo Mixer's ``params`` tree (head included if the file has one).

  Every array must have the shape that the model of ``model_config(flat)``
  expects, and every array must be read: a ``ValueError`` names the first
  that does not fit, or those left over.
  """
  # A headless file's head is not read: any size builds the rest.
  cfg = model_config(flat, None if "head/kernel" in flat else 1)
  expected = nn.unbox(zoo.abstract_variables(cfg))["params"]
  why = (f"the model's sizes come from stem/kernel (P={cfg.patch_size}, "
         f"C={cfg.d_model}), MixerBlock_0's token_mixing (N={cfg.max_len}, "
         f"D_S={cfg.mixer_kwargs.token_mlp_dim}) and channel_mixing "
         f"(D_C={cfg.d_ffn}) kernels"
         + (f" and head/kernel (K={cfg.num_classes})" if "head/kernel" in flat
            else "")
         + "; every block must have these widths")

  def read(path, key):
    x = _get(flat, key)
    if key == "stem/kernel":
      # [P, P, 3, C] -> [P*P*3, C]: rows in (row, column, channel) order,
      # the order in which ``encoders.patchify`` flattens a patch.
      x = x.reshape(-1, x.shape[-1])
    want = expected
    for k in path:
      want = want[k.key]
    if x.shape != want.shape:
      raise ValueError(f"official Mixer checkpoint: {key} has shape "
                       f"{flat[key].shape}, the model expects {want.shape} "
                       f"({why}).")
    return np.asarray(x, np.float32)

  layout = _layout(flat)
  params = jax.tree_util.tree_map_with_path(read, layout)
  unread = sorted(set(flat) - set(jax.tree.leaves(layout)), key=_natural)
  if unread:
    # Nothing is allowed to stay behind: vit_jax/models_mixer.py's MlpMixer
    # (and big_vision's) has no other parameters (no pre_logits; two
    # LayerNorms and two MLPs of two Dense each per block).
    more = " ..." if len(unread) > 8 else ""
    raise ValueError(f"official Mixer checkpoint: arrays not read "
                     f"({len(unread)}): {unread[:8]}{more}; the release's "
                     "MlpMixer has no others: is it an MLP-Mixer .npz of this "
                     "layout?")
  return params


def _resize_grid(x: np.ndarray, axis: int, new_side: int,
                 method: str) -> np.ndarray:
  """Resizes axis ``axis`` (N = side^2 patch positions, row-major) of ``x``."""
  n = x.shape[axis]
  side = math.isqrt(n)
  moved = np.moveaxis(x, axis, 0)
  grid = moved.reshape((side, side) + moved.shape[1:])
  out = jax.image.resize(jnp.asarray(grid), (new_side, new_side)
                         + grid.shape[2:], method=method)
  out = np.asarray(out).reshape((new_side * new_side,) + moved.shape[1:])
  return np.moveaxis(out, 0, axis)


def adapt_resolution(params: Params, new_num_patches: int, *,
                     method: str = "linear") -> Params:
  """``params`` with every token-mixing MLP resized to ``new_num_patches``.

  See the module docstring for the method. ``method``: a
  ``jax.image.resize`` method (``linear``, ``cubic``, ``nearest``...).
  Square grids only; ``new_num_patches`` must be a square. Scanned stacks
  (``model.scan_layers``) are resized layer by layer.
  """
  new_side = math.isqrt(new_num_patches)
  if new_side * new_side != new_num_patches:
    raise ValueError(f"new_num_patches={new_num_patches} is not a square "
                     "grid (image_size / patch_size squared).")

  def adapt(tree):
    if isinstance(tree, dict) and isinstance(
        tree.get(encoders.SCANNED), dict) and "layer" in tree[encoders.SCANNED]:
      # A scanned stack (model.scan_layers): each layer's [L, ...] leaves
      # resized layer by layer.
      return encoders.stack_layers(adapt(encoders.unstack_layers(tree)))
    if isinstance(tree, dict) and "kernel_in" in tree and "kernel_out" in tree:
      n = tree["kernel_in"].shape[0]
      if math.isqrt(n) ** 2 != n:
        raise ValueError(f"token-mixing weights for {n} patches: not a "
                         "square grid.")
      return {**tree,
              "kernel_in": _resize_grid(np.asarray(tree["kernel_in"]), 0,
                                        new_side, method) * (n / new_num_patches),
              "kernel_out": _resize_grid(np.asarray(tree["kernel_out"]), 1,
                                         new_side, method),
              "bias_out": _resize_grid(np.asarray(tree["bias_out"]), 0,
                                       new_side, method)}
    if isinstance(tree, dict):
      return {k: adapt(v) for k, v in tree.items()}
    return tree

  return adapt(params)


def import_checkpoint(npz_path: str, *, image_size: int | None = None,
                      num_classes: int | None = None,
                      method: str = "linear"
                      ) -> tuple[ml_collections.ConfigDict, Params]:
  """``(model config, params)`` of an official ``.npz``, at ``image_size``.

  ``image_size`` (pixels, square) other than the checkpoint's adapts the
  token-mixing weights (``adapt_resolution``). A ``num_classes`` different
  from the checkpoint's head drops that head (the new one is initialised).
  """
  flat = load_npz(npz_path)
  cfg = model_config(flat, num_classes)
  params = convert(flat)
  if "classifier" in params and (
      params["classifier"]["dense"]["kernel"].shape[1] != cfg.num_classes):
    del params["classifier"]
  if image_size:
    if image_size % cfg.patch_size:
      raise ValueError(f"image_size={image_size} is not a multiple of the "
                       f"patch size {cfg.patch_size}.")
    n = (image_size // cfg.patch_size) ** 2
    if n != cfg.max_len:
      params = adapt_resolution(params, n, method=method)
      cfg.max_len = n
  return cfg, params


def adapt_checkpoint(path: str, output: str, image_size: int,
                     patch_size: int, *, method: str = "linear") -> int:
  """Writes ``path``'s parameters with token mixing adapted to ``image_size``.

  For the zoo's own Mixer checkpoints (a training workdir, its checkpoints
  folder, a step folder or exported parameters): fine-tuning at another
  resolution then loads the output with ``init_checkpoint`` into the model
  whose ``max_len`` is ``(image_size / patch_size)^2``. Returns the number
  of patches.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  if image_size % patch_size:
    raise ValueError(f"image_size={image_size} is not a multiple of "
                     f"patch_size={patch_size}.")
  directory, step = ckpt_lib.resolve_checkpoint(path)
  state = ocp.PyTreeCheckpointer().restore(ckpt_lib.manager_path(
      os.path.join(directory, str(step), ckpt_lib.STATE)))
  if "params" not in state:
    raise ValueError(f"{directory}/{step} holds no params (has "
                     f"{sorted(state)}).")
  n = (image_size // patch_size) ** 2
  params = adapt_resolution(jax.tree.map(np.asarray, state["params"]), n,
                            method=method)
  artifacts.write_params(output, params, step)
  return n


def main(argv=None) -> None:
  import argparse  # pylint: disable=g-import-not-at-top
  from hypermixer_jax import runtime  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  runtime.hide_accelerators_from_tensorflow()
  p = argparse.ArgumentParser(description="Official MLP-Mixer .npz -> a "
                              "parameters checkpoint for init_checkpoint.")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--npz", help="an official MLP-Mixer .npz")
  src.add_argument("--checkpoint", help="a zoo Mixer checkpoint to adapt to "
                   "--image_size (needs --patch_size)")
  p.add_argument("--output", required=True)
  p.add_argument("--image_size", type=int, default=0)
  p.add_argument("--patch_size", type=int, default=0)
  p.add_argument("--num_classes", type=int, default=None)
  p.add_argument("--method", default="linear")
  a = p.parse_args(argv)
  try:
    if epath.Path(a.output).exists():
      raise FileExistsError(f"--output={a.output} exists; choose a new "
                            "folder (nothing was written).")
    if a.checkpoint:
      if not (a.image_size and a.patch_size):
        p.error("--checkpoint needs --image_size and --patch_size.")
      n = adapt_checkpoint(a.checkpoint, a.output, a.image_size, a.patch_size,
                           method=a.method)
      print(f"wrote {a.output}: token mixing for {n} patches; fine-tune with\n"
            f"  --config.model.max_len={n} --config.data.image_size="
            f"{a.image_size} --config.data.patch_size={a.patch_size} "
            f"--config.init_checkpoint={a.output}")
      return
    cfg, params = import_checkpoint(a.npz, image_size=a.image_size or None,
                                    num_classes=a.num_classes,
                                    method=a.method)
    artifacts.write_params(a.output, params)
    run_config.write(imported_config(cfg), a.output)
  except (OSError, ValueError) as e:
    sys.exit(f"Stopped: {e}")
  print(f"wrote {a.output}; fine-tune it with "
        "--config=configs/imagenet.py:mixer_b16 and\n  "
        + " ".join(config_flags(cfg, a.output)) + "\n(--mode=evaluate "
        f"--workdir={a.output} needs only the --config: its config.json "
        "holds the rest)")


def imported_config(cfg: ml_collections.ConfigDict) -> dict:
  """What a converted checkpoint fixes (its ``config.json``): the model's
  shapes and GELU, as ``configs/imagenet.py`` feeds it (the pipeline cuts
  the patches: ``model.patch_size`` 0, the same parameters), its inputs'
  scaling and resolution."""
  side = math.isqrt(int(cfg.max_len))
  model = {k: cfg[k] for k in ("family", "mixer", "block", "head",
                               "num_layers", "d_model", "d_ffn", "max_len",
                               "input_dim", "num_classes", "approximate_gelu")}
  return {"model": {**model, "mixer_kwargs": {
              "token_mlp_dim": cfg.mixer_kwargs.token_mlp_dim}},
          "data": {"image_normalization": IMAGE_NORMALIZATION,
                   "image_size": side * int(cfg.patch_size),
                   "patch_size": int(cfg.patch_size)}}


def config_flags(cfg: ml_collections.ConfigDict, output: str) -> list[str]:
  """``--config...`` flags that build the converted model and read its
  inputs as the release did (ready to paste after ``configs/imagenet.py``'s
  Mixer)."""
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  fixed = imported_config(cfg)
  skip = ("model.family", "model.mixer", "model.block", "model.head")
  return ([f"--config.{k}={v}" for k, v in run_config.flatten(fixed).items()
           if k not in skip]
          + [f"--config.init_checkpoint={output}"])


if __name__ == "__main__":
  main()
