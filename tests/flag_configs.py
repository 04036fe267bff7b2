"""Configs for tests, loaded as the command line loads them (locked, with
``--config.field=value`` overrides), so a test's overrides are checked like
a user's."""
import os

from absl import flags
from ml_collections import config_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.py")


def load(spec: str, *overrides: str):
  """The config of ``--config=spec`` with ``overrides`` (flag strings)."""
  argv = ["prog", f"--config={spec}", *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  fv(argv)
  return fv.config


# A tiny default job (HyperMixer on the synthetic task): steps 4 and 8 saved
# and evaluated. Tests that share it share its compiled programs (the
# persistent compilation cache of tests/conftest.py).
TINY = ["--config.model.num_layers=1", "--config.model.d_model=16",
        "--config.model.d_ffn=32", "--config.model.max_len=40",
        "--config.model.mixer_kwargs.hyper_dim=8",
        "--config.data.synthetic.seq_len=40",
        "--config.data.synthetic.num_eval_examples=48",
        "--config.batch_size=8", "--config.eval_batch_size=16",
        "--config.eval_steps=-1", "--config.warmup_steps=2",
        "--config.num_train_steps=8", "--config.eval_every=4",
        "--config.checkpoint_every=4", "--config.keep_checkpoints=3",
        "--config.log_every=4", "--config.evals.pseudo_attention.every=-1"]
