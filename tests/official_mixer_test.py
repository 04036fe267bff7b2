"""Official MLP-Mixer .npz checkpoints in the zoo's Mixer, and resolution change.

The test writes a file with the release's layout (``vit_jax/models_mixer.py``
parameter names and shapes, random values) and checks our model against a
NumPy forward of the official architecture on the same weights.
"""
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from hypermixer_jax import models
from hypermixer_jax.models import official_mixer
from hypermixer_jax.models import zoo

# Distinct sizes, so a transposed axis cannot pass: patch 4, 5x5 grid (N=25),
# C=12, D_S=7, D_C=11, 3 classes, 2 blocks.
P, SIDE, C, DS, DC, K, L = 4, 5, 12, 7, 11, 3, 2
N = SIDE * SIDE


def official_flat(seed=0, head=True):
  rng = np.random.default_rng(seed)
  r = lambda *s: rng.normal(size=s).astype(np.float32) * 0.3  # noqa: E731
  flat = {"stem/kernel": r(P, P, 3, C), "stem/bias": r(C),
          "pre_head_layer_norm/scale": 1 + r(C),
          "pre_head_layer_norm/bias": r(C)}
  for i in range(L):
    b = f"MixerBlock_{i}"
    for ln in ("LayerNorm_0", "LayerNorm_1"):
      flat[f"{b}/{ln}/scale"] = 1 + r(C)
      flat[f"{b}/{ln}/bias"] = r(C)
    for mlp, (d_in, hid) in (("token_mixing", (N, DS)),
                             ("channel_mixing", (C, DC))):
      flat[f"{b}/{mlp}/Dense_0/kernel"] = r(d_in, hid)
      flat[f"{b}/{mlp}/Dense_0/bias"] = r(hid)
      flat[f"{b}/{mlp}/Dense_1/kernel"] = r(hid, d_in)
      flat[f"{b}/{mlp}/Dense_1/bias"] = r(d_in)
  if head:
    flat["head/kernel"] = r(C, K)
    flat["head/bias"] = r(K)
  return flat


def _ln(x, scale, bias):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + 1e-6) * scale + bias


def _gelu_tanh(x):  # Flax's default nn.gelu
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def numpy_official_forward(flat, images):
  """vit_jax/models_mixer.py's MlpMixer, in NumPy (float64)."""
  f = {k: v.astype(np.float64) for k, v in flat.items()}
  b, h, w, _ = images.shape
  p = f["stem/kernel"].shape[0]
  # Conv with kernel P and stride P: one patch per output position.
  x = images.astype(np.float64).reshape(b, h // p, p, w // p, p, 3)
  x = np.einsum("bhpwqc,pqcd->bhwd", x, f["stem/kernel"]) + f["stem/bias"]
  x = x.reshape(b, -1, x.shape[-1])                       # n (h w) c
  i = 0
  while f"MixerBlock_{i}/LayerNorm_0/scale" in f:
    g = lambda k: f[f"MixerBlock_{i}/{k}"]  # noqa: E731
    y = _ln(x, g("LayerNorm_0/scale"), g("LayerNorm_0/bias"))
    y = np.swapaxes(y, 1, 2)                              # [B, C, N]
    y = _gelu_tanh(y @ g("token_mixing/Dense_0/kernel")
                   + g("token_mixing/Dense_0/bias"))
    y = y @ g("token_mixing/Dense_1/kernel") + g("token_mixing/Dense_1/bias")
    x = x + np.swapaxes(y, 1, 2)
    y = _ln(x, g("LayerNorm_1/scale"), g("LayerNorm_1/bias"))
    y = _gelu_tanh(y @ g("channel_mixing/Dense_0/kernel")
                   + g("channel_mixing/Dense_0/bias"))
    x = x + y @ g("channel_mixing/Dense_1/kernel") + g(
        "channel_mixing/Dense_1/bias")
    i += 1
  x = _ln(x, f["pre_head_layer_norm/scale"], f["pre_head_layer_norm/bias"])
  return x.mean(1) @ f["head/kernel"] + f["head/bias"]


@pytest.fixture
def npz(tmp_path):
  path = tmp_path / "Mixer-T_4.npz"
  np.savez(path, **official_flat())
  return str(path)


def _forward(cfg, params, images):
  model = models.build_model(cfg)
  return np.asarray(jax.jit(model.apply)({"params": params}, images))


def test_import_matches_official_forward(npz):
  cfg, params = official_mixer.import_checkpoint(npz)
  assert (cfg.num_layers, cfg.d_model, cfg.d_ffn, cfg.max_len, cfg.patch_size,
          cfg.mixer_kwargs.token_mlp_dim, cfg.num_classes) == (
              L, C, DC, N, P, DS, K)
  # The tree is exactly the model's: same paths, same shapes.
  expected = nn.unbox(zoo.abstract_variables(cfg))["params"]
  assert jax.tree.structure(expected) == jax.tree.structure(params)
  assert jax.tree.leaves(jax.tree.map(lambda a, b: a.shape == b.shape,
                                      expected, params)) == [True] * len(
                                          jax.tree.leaves(params))
  images = np.random.default_rng(1).normal(
      size=(3, SIDE * P, SIDE * P, 3)).astype(np.float32)
  want = numpy_official_forward(official_flat(), images)
  # float32 against float64: measured 6e-8.
  np.testing.assert_allclose(_forward(cfg, params, images), want, rtol=0,
                             atol=1e-6)
  # The exact GELU (the zoo's default) is a different network (3e-5 here):
  # the tolerance can tell them apart.
  cfg.approximate_gelu = False
  assert np.abs(_forward(cfg, params, images) - want).max() > 1e-5


def test_new_head_and_headless_release(tmp_path, npz):
  cfg, params = official_mixer.import_checkpoint(npz, num_classes=5)
  assert cfg.num_classes == 5 and "classifier" not in params
  path = tmp_path / "headless.npz"
  np.savez(path, **official_flat(head=False))
  with pytest.raises(ValueError, match="pass num_classes for the new head"):
    official_mixer.import_checkpoint(str(path))


def test_resolution_change_is_exact_on_upsampled_patch_grid(npz):
  """Nearest-resized token mixing at twice the grid: an image whose 2x2
  blocks of patches repeat the original patches gives the original logits."""
  cfg, params = official_mixer.import_checkpoint(npz)
  cfg2, params2 = official_mixer.import_checkpoint(
      npz, image_size=2 * SIDE * P, method="nearest")
  assert cfg2.max_len == 4 * N
  tm = params2["encoder"]["stack"]["layer_0"]["token_mixing"]
  assert tm["kernel_in"].shape == (4 * N, DS)
  assert tm["kernel_out"].shape == (DS, 4 * N)
  images = np.random.default_rng(2).normal(
      size=(2, SIDE * P, SIDE * P, 3)).astype(np.float32)
  patches = images.reshape(2, SIDE, P, SIDE, P, 3)
  big = np.repeat(np.repeat(patches, 2, axis=1), 2, axis=3).reshape(
      2, 2 * SIDE * P, 2 * SIDE * P, 3)
  np.testing.assert_allclose(_forward(cfg2, params2, big),
                             _forward(cfg, params, images), rtol=1e-4,
                             atol=1e-5)
  # Without the 1/(N'/N) scaling of kernel_in it would not hold.
  tm["kernel_in"] = tm["kernel_in"] * 4
  assert not np.allclose(_forward(cfg2, params2, big),
                         _forward(cfg, params, images), atol=1e-3)


def test_linear_resize_keeps_a_smooth_kernel_smooth():
  """A kernel that is linear in the grid coordinates stays linear (inside)."""
  yy, xx = np.meshgrid(np.arange(SIDE), np.arange(SIDE), indexing="ij")
  ramp = (0.5 * yy + 0.25 * xx).reshape(N, 1).astype(np.float32)
  tm = {"kernel_in": ramp, "bias_in": np.zeros(1, np.float32),
        "kernel_out": ramp.T.copy(), "bias_out": ramp[:, 0].copy()}
  out = official_mixer.adapt_resolution({"t": tm}, 10 * 10)["t"]
  grid = out["bias_out"].reshape(10, 10)
  # Half-pixel centres: new (i, j) sits at old ((i + .5) / 2 - .5, ...).
  c = (np.arange(10) + 0.5) / 2 - 0.5
  want = 0.5 * c[:, None] + 0.25 * c[None, :]
  np.testing.assert_allclose(grid[1:-1, 1:-1], want[1:-1, 1:-1], atol=1e-5)
  np.testing.assert_allclose(out["kernel_in"].reshape(10, 10) * 4, grid,
                             atol=1e-5)


def test_bad_files_are_named(tmp_path):
  flat = official_flat()
  del flat["stem/kernel"]
  path = tmp_path / "bad.npz"
  np.savez(path, **flat)
  with pytest.raises(ValueError, match="no 'stem/kernel'.*MLP-Mixer .npz"):
    official_mixer.import_checkpoint(str(path))
  with pytest.raises(ValueError, match="not a square grid"):
    official_mixer.adapt_resolution(official_mixer.convert(official_flat()),
                                    50)


def _with(arrays):
  """``official_flat()`` with ``arrays`` added or replaced."""
  return {**official_flat(), **arrays}


@pytest.mark.parametrize("flat, key, shape, want", [
    # A second block of another token-mixing width: the zoo's Mixer has one.
    (_with({"MixerBlock_1/token_mixing/Dense_0/kernel": np.zeros((N, 9)),
            "MixerBlock_1/token_mixing/Dense_0/bias": np.zeros(9),
            "MixerBlock_1/token_mixing/Dense_1/kernel": np.zeros((9, N))}),
     "MixerBlock_1/token_mixing/Dense_0/bias", (9,), (DS,)),
    (_with({"MixerBlock_1/LayerNorm_1/scale": np.ones(C + 1)}),
     "MixerBlock_1/LayerNorm_1/scale", (C + 1,), (C,)),
    (_with({"head/bias": np.ones(K + 1)}), "head/bias", (K + 1,), (K,)),
], ids=["block_width", "layer_norm", "head_bias"])
def test_arrays_that_do_not_fit_the_model_are_named(tmp_path, flat, key,
                                                    shape, want):
  """Sizes are read from stem/kernel, MixerBlock_0 and head/kernel; any
  other array of another shape stops the conversion, naming its key."""
  path = tmp_path / "bad.npz"
  np.savez(path, **flat)
  with pytest.raises(SystemExit) as e:
    official_mixer.main(["--npz", str(path), "--output", str(tmp_path / "o")])
  message = str(e.value.code)
  assert message.startswith(
      f"Stopped: official Mixer checkpoint: {key} has shape {shape}, the "
      f"model expects {want} (the model's sizes come from stem/kernel (P={P}, "
      f"C={C}), MixerBlock_0's token_mixing (N={N}, D_S={DS})")
  assert message.endswith("every block must have these widths).")
  assert "\n" not in message and not (tmp_path / "o").exists()


def test_arrays_left_unread_are_named(tmp_path):
  flat = _with({"MixerBlock_0/token_mixing/Dense_2/kernel": np.ones((3, 3)),
                "pre_logits/kernel": np.ones((C, C)),
                "MixerBlock_0/LayerNorm_2/scale": np.ones(C)})
  with pytest.raises(ValueError) as e:
    official_mixer.convert(flat)
  assert str(e.value) == (
      "official Mixer checkpoint: arrays not read (3): "
      "['MixerBlock_0/LayerNorm_2/scale', "
      "'MixerBlock_0/token_mixing/Dense_2/kernel', 'pre_logits/kernel']; the "
      "release's MlpMixer has no others: is it an MLP-Mixer .npz of this "
      "layout?")
  # A file without a head converts (test_new_head_and_headless_release:
  # one whose head is dropped for a new num_classes too).
  path = tmp_path / "headless.npz"
  np.savez(path, **official_flat(head=False))
  cfg, params = official_mixer.import_checkpoint(str(path), num_classes=5)
  assert cfg.num_classes == 5 and "classifier" not in params


@pytest.mark.parametrize("keep", [0, 3000], ids=["empty", "truncated"])
def test_unreadable_npz_stops_in_one_line(tmp_path, npz, keep):
  path = tmp_path / "cut.npz"
  path.write_bytes(open(npz, "rb").read()[:keep])
  with pytest.raises(SystemExit) as e:
    official_mixer.main(["--npz", str(path), "--output", str(tmp_path / "o")])
  cause = ("EOFError: No data left in file" if keep == 0 else
           "BadZipFile: File is not a zip file")
  assert e.value.code == (f"Stopped: --npz={path}: not a readable .npz "
                          f"({cause}); download it again.")


def test_zoo_checkpoint_adapted_for_fine_tuning_at_another_resolution(
    npz, tmp_path, capsys):
  """Our own Mixer checkpoint (here: the imported one, saved by us) adapted
  to twice the grid loads into the larger model through init_checkpoint's
  loader and gives the exact upsampled-grid logits (nearest resize)."""
  from hypermixer_jax.train import artifacts  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  cfg, params = official_mixer.import_checkpoint(npz)
  artifacts.write_params(tmp_path / "run", params, step=11)
  official_mixer.main(["--checkpoint", str(tmp_path / "run"),
                       "--image_size", str(2 * SIDE * P), "--patch_size",
                       str(P), "--method", "nearest",
                       "--output", str(tmp_path / "big")])
  # The flags to paste read the images at the new size too.
  assert (f"--config.model.max_len={4 * N} --config.data.image_size="
          f"{2 * SIDE * P} --config.data.patch_size={P} "
          f"--config.init_checkpoint={tmp_path / 'big'}") in (
              capsys.readouterr().out)
  big_cfg = cfg.copy_and_resolve_references()
  big_cfg.max_len = 4 * N
  fresh = nn.unbox(jax.jit(models.build_model(big_cfg).init)(
      jax.random.key(5), np.zeros((1, 2 * SIDE * P, 2 * SIDE * P, 3),
                                  np.float32))["params"])
  loaded = ckpt_lib.load_pretrained(
      tmp_path / "big", fresh, config_lib.base_config().init_reinit.split(","))
  # The head is re-initialised by default; put the old one back to compare.
  loaded["classifier"] = params["classifier"]
  images = np.random.default_rng(3).normal(
      size=(2, SIDE * P, SIDE * P, 3)).astype(np.float32)
  patches = images.reshape(2, SIDE, P, SIDE, P, 3)
  big = np.repeat(np.repeat(patches, 2, axis=1), 2, axis=3).reshape(
      2, 2 * SIDE * P, 2 * SIDE * P, 3)
  np.testing.assert_allclose(_forward(big_cfg, loaded, big),
                             _forward(cfg, params, images), rtol=1e-4,
                             atol=1e-5)
  with pytest.raises(SystemExit):   # argparse: both sizes are needed
    official_mixer.main(["--checkpoint", str(tmp_path / "run"),
                         "--output", str(tmp_path / "x")])


def older_layout(flat):
  """``flat`` in the first release's layout (pre-Linen names, kernels with
  an extra axis of size 1), as big_vision's Mixer loader reads it."""
  out = {"embedding/kernel": flat["stem/kernel"],
         "embedding/bias": flat["stem/bias"],
         "Mixer/encoder_norm/scale": flat["pre_head_layer_norm/scale"],
         "Mixer/encoder_norm/bias": flat["pre_head_layer_norm/bias"],
         "head/kernel": flat["head/kernel"], "head/bias": flat["head/bias"]}
  for i in range(L):
    old, new = f"Mixer/encoderblock_{i}", f"MixerBlock_{i}"
    # Pre-Linen numbers count every submodule: the second norm is the 3rd.
    for ln_old, ln_new in (("LayerNorm_0", "LayerNorm_0"),
                           ("LayerNorm_2", "LayerNorm_1")):
      for leaf in ("scale", "bias"):
        out[f"{old}/{ln_old}/{leaf}"] = flat[f"{new}/{ln_new}/{leaf}"]
    for mlp in ("token_mixing", "channel_mixing"):
      for j in (0, 1):
        for leaf in ("kernel", "bias"):
          out[f"{old}/{mlp}_phase_0/{leaf}{j + 1}"] = flat[
              f"{new}/{mlp}/Dense_{j}/{leaf}"][None]
  return out


def test_older_release_layout_gives_the_same_model(tmp_path, npz):
  path = tmp_path / "old.npz"
  np.savez(path, **older_layout(official_flat()))
  cfg_old, params_old = official_mixer.import_checkpoint(str(path))
  cfg, params = official_mixer.import_checkpoint(npz)
  assert cfg_old == cfg
  assert jax.tree.structure(params_old) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params_old), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)
  images = np.random.default_rng(4).normal(
      size=(2, SIDE * P, SIDE * P, 3)).astype(np.float32)
  np.testing.assert_allclose(_forward(cfg_old, params_old, images),
                             numpy_official_forward(official_flat(), images),
                             atol=1e-6)
  # The numbering follows the order, not the digits: 2 and 10 sort as numbers.
  assert official_mixer._linen_names(["LayerNorm_10", "LayerNorm_2"]) == {
      "LayerNorm_2": "LayerNorm_0", "LayerNorm_10": "LayerNorm_1"}
  bad = older_layout(official_flat())
  bad["Mixer/encoderblock_0/token_mixing_phase_0/kernel3"] = np.zeros(2)
  np.savez(tmp_path / "bad_old.npz", **bad)
  with pytest.raises(ValueError, match="unexpected 'Mixer/encoderblock_0/"
                     "token_mixing_phase_0/kernel3'"):
    official_mixer.import_checkpoint(str(tmp_path / "bad_old.npz"))


def test_cli_errors_are_one_line(tmp_path, npz):
  np.save(tmp_path / "weights.npy", np.zeros(3, np.float32))
  with pytest.raises(SystemExit) as e:
    official_mixer.main(["--npz", str(tmp_path / "weights.npy"),
                         "--output", str(tmp_path / "o1")])
  assert e.value.code == (
      f"Stopped: --npz={tmp_path / 'weights.npy'}: a single array (ndarray of "
      "shape (3,)), not an .npz of named parameters; the official "
      "checkpoints are .npz files (gs://mixer_models/...).")
  (tmp_path / "taken").mkdir()
  with pytest.raises(SystemExit) as e:
    official_mixer.main(["--npz", npz, "--output", str(tmp_path / "taken")])
  assert e.value.code == (f"Stopped: --output={tmp_path / 'taken'} exists; "
                          "choose a new folder (nothing was written).")
  assert not list((tmp_path / "taken").iterdir())
  with pytest.raises(SystemExit) as e:
    official_mixer.main(["--npz", str(tmp_path / "none.npz"),
                         "--output", str(tmp_path / "o2")])
  assert e.value.code == f"Stopped: --npz={tmp_path / 'none.npz'}: no such file."


def test_printed_flags_build_the_converted_model_with_its_inputs(
    tmp_path, npz, capsys):
  """The printed flags, pasted after configs/imagenet.py:mixer_b16, give a
  model the converted parameters load into, and the release's input
  scaling, which the output's config.json records too."""
  import json  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  out = tmp_path / "mixer"
  official_mixer.main(["--npz", npz, "--output", str(out)])
  printed = capsys.readouterr().out.split()
  pasted = [a for a in printed if a.startswith("--config.")]
  assert "--config.data.image_normalization=inception" in pasted
  assert f"--config.init_checkpoint={out}" in pasted
  argv = ["prog", f"--config={IMAGENET}", *pasted]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  fv(argv)
  config = fv.config
  assert (config.data.image_normalization, config.data.image_size,
          config.data.patch_size) == ("inception", SIDE * P, P)
  # The pipeline's patches are what the model reads.
  assert config.model.input_dim == config.data.patch_size ** 2 * 3
  assert config.model.patch_size == 0
  fresh = nn.unbox(zoo.abstract_variables(config.model))["params"]
  one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  loaded = ckpt_lib.load_pretrained(str(out), jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, np.float32,
                                     sharding=one_device), fresh), reinit=())
  _, params = official_mixer.import_checkpoint(npz)
  np.testing.assert_array_equal(
      loaded["encoder"]["stack"]["layer_1"]["token_mixing"]["kernel_out"],
      params["encoder"]["stack"]["layer_1"]["token_mixing"]["kernel_out"])
  saved = json.loads((out / "config.json").read_text())
  assert saved["data"]["image_normalization"] == "inception"
  assert saved["model"]["num_layers"] == L
  # --mode=evaluate --workdir=OUT --config=...mixer_b16: the saved fields on
  # the file's config give the same model and inputs as the pasted flags.
  from hypermixer_jax.train import run_config  # pylint: disable=g-import-not-at-top
  resolved = run_config.resolve(out / "config.json", {}, given=_imagenet())
  assert resolved.model.to_dict() == config.model.to_dict()
  assert resolved.data.to_dict() == config.data.to_dict()


IMAGENET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "configs", "imagenet.py:mixer_b16")


def _imagenet():
  import importlib.util  # pylint: disable=g-import-not-at-top
  path, arg = IMAGENET.split(":")
  spec = importlib.util.spec_from_file_location("imagenet_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)
