"""Model/data combinations that must be refused before training starts."""
import os

import pytest

import flag_configs
from hypermixer_jax.train import config_checks
from hypermixer_jax.train import loop

SMLP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "configs", "smlp_lm.py")


def _config(routing: str, packing: bool):
  return flag_configs.load(f"{SMLP}:tiny",
                           f"--config.model.moe.smoe_routing={routing}",
                           f"--config.data.packing={packing}")


def test_partial_routing_with_packing_is_refused():
  config = _config("partial", True)
  with pytest.raises(ValueError, match="packing=False"):
    loop.check_model_fits_data(config)


@pytest.mark.parametrize("routing, packing", [("partial", False),
                                              ("deterministic", True)])
def test_compatible_combinations_pass(routing, packing):
  config = _config(routing, packing)
  loop.check_model_fits_data(config)


def _mlm_config(mixer: str, *overrides):
  path = os.path.join(os.path.dirname(SMLP), "c4_mlm.py")
  return flag_configs.load(f"{path}:{mixer}", *overrides)


@pytest.mark.parametrize("mixer", ["hypermixer", "mlp_mixer"])
def test_slot_mixers_refuse_packing_without_segment_slots(mixer):
  config = _mlm_config(mixer)
  assert not config.data.packing  # the shipped config trains unpacked
  config = _mlm_config(mixer, "--config.data.packing=True")
  with pytest.raises(ValueError, match="max_segments"):
    loop.check_model_fits_data(config)
  # The fix the message names is a valid override of the locked config.
  config = _mlm_config(mixer, "--config.data.packing=True",
                       "--config.model.mixer_kwargs.max_segments=4")
  loop.check_model_fits_data(config)


def test_other_mixers_pack():
  config = _mlm_config("gmlp")
  assert config.data.packing
  loop.check_model_fits_data(config)


def test_a_mixer_swapped_under_another_mixers_options_stops_in_one_line(
    tmp_path):
  # configs/default.py sets HyperMixing's hyper_dim; swapping the mixer on
  # the command line leaves it there. Refused before the workdir is made,
  # naming the option and the fix; the config argument's choice builds.
  config = flag_configs.load(os.path.join(os.path.dirname(SMLP), "default.py"),
                             "--config.model.mixer=mlp_mixer")
  workdir = tmp_path / "run"
  with pytest.raises(config_checks.ConfigError) as e:
    loop.train_and_evaluate(config, str(workdir))
  assert str(e.value).startswith(
      "model.mixer='mlp_mixer' (MlpMixerTokenMixing) does not take "
      "model.mixer_kwargs hyper_dim, which the config sets for its own "
      "mixer; choose the mixer by the config file's argument (e.g. "
      "--config=configs/default.py:mlp_mixer")
  assert "\n" not in str(e.value) and not workdir.exists()
  config_checks.check_model(flag_configs.load(
      os.path.join(os.path.dirname(SMLP), "default.py:mlp_mixer")).model)
  # Any other refusal of the model builder is one line too.
  config = flag_configs.load(os.path.join(os.path.dirname(SMLP), "default.py"),
                             "--config.model.block=post_lm")
  with pytest.raises(config_checks.ConfigError, match=r"^model: unknown "
                     r"block 'post_lm'; valid blocks: "):
    config_checks.check_model(config.model)


def test_a_pseudo_attention_map_of_a_token_model_is_refused():
  # Its Jacobian needs real inputs: on token ids it crashed after training.
  configs = os.path.dirname(SMLP)
  config = flag_configs.load(os.path.join(configs, "default.py"))
  assert config_checks.problems(config) == []
  text = flag_configs.load(os.path.join(configs, "c4_mlm.py") + ":hypermixer")
  text.unlock()
  text.evals = config.evals
  assert config_checks.problems(text) == [
      "evals.pseudo_attention: a pseudo_attention map needs a model of "
      "continuous inputs (the synthetic task), not model.family='text'; use "
      "a config without it"]


@pytest.mark.parametrize("override, line", [
    ("--config.model.mixer_kwargs.hyper_dim=0",
     "model.mixer_kwargs.hyper_dim=0: must be a positive integer"),
    ("--config.data.synthetic.num_examples=-1",
     "data.synthetic.num_examples=-1: must be an integer >= 0 (0: endless)"),
])
def test_sizes_the_models_and_pipelines_divide_by_are_checked(override, line):
  # Before: a ZeroDivisionError inside HyperMixing, a bare StopIteration.
  config = flag_configs.load(
      os.path.join(os.path.dirname(SMLP), "default.py"), override)
  assert config_checks.problems(config) == [line]


@pytest.mark.parametrize("override, start", [
    ("--config.data.task=nosuchtask", "Unknown data.task 'nosuchtask'; "),
    ("--config.data.synthetic.seq_len=16",
     "data.synthetic.seq_len=16 is below the minimum 39 for 4 objects"),
    ("--config.data.synthetic.shapes=('disc',)",
     "data.synthetic.shapes: unknown shape 'disc'; choose from "),
])
def test_bad_data_options_stop_in_one_line(override, start):
  # A DataError (main.py prints it as one 'Stopped:' line), not a traceback.
  from hypermixer_jax import data  # pylint: disable=g-import-not-at-top
  config = flag_configs.load(
      os.path.join(os.path.dirname(SMLP), "default.py"), override)
  with pytest.raises(data.DataError) as e:
    data.build_pipeline(config.data, "train", batch_size=8, seed=0,
                        repeat=True, shuffle=True)
  assert str(e.value).startswith(start) and "\n" not in str(e.value)
