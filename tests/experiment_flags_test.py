"""hypermixer_jax.experiment.flags: the flags every experiment shares."""
import argparse

import pytest

from hypermixer_jax import experiment


def test_tune_help_prints_a_percent_sign_as_written():
  p = argparse.ArgumentParser()
  experiment.tune_flags(p, "sentences of the 10% subset")
  text = " ".join(p.format_help().split())
  assert "chosen alike on sentences of the 10% subset carved from the " \
         "training set" in text
  assert "option_strings" not in text


def test_tune_needs_the_small_scale():
  p = argparse.ArgumentParser()
  p.add_argument("--scale", default="paper")
  experiment.tune_flags(p, "premises")
  args = p.parse_args(["--tune"])
  with pytest.raises(SystemExit, match="carves its validation split from "
                     "premises; use --scale=small"):
    experiment.check_tune(args, "premises")
  experiment.check_tune(p.parse_args(["--tune", "--scale=small"]), "premises")
