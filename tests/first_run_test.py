"""What a new user's first CPU run prints: a clean start beside libtpu, a
line while XLA compiles, and train log lines in the README's format."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from hypermixer_jax.train import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What libtpu prints when it starts on a machine without TPU chips.
LIBTPU_NOISE = ("TPU", "libtpu", "jellyfish", "TPU_WORKER_HOSTNAMES",
                "host bounds")
TRAIN_LINE = re.compile(r"\[train\] step \d+/\d+: [^`\n]*[^`\s]")
_LONG = {short: key for key, (short, _) in metrics_lib._SHORT.items()}  # pylint: disable=protected-access


def _reprinted(line: str) -> str:
  """``line`` parsed and written again by ``metrics.log_line``."""
  m = re.fullmatch(r"\[(\w+)\] step (\d+)/(\d+): (.*)", line)
  assert m, line
  scalars = {}
  for part in m[4].split(" "):
    key, value = part.split("=", 1)
    key = _LONG.get(key, key)
    scalars[key] = (float(value[:-1]) / 100 if value.endswith("%")
                    else float(value))
  return metrics_lib.log_line(m[1], int(m[2]), int(m[3]), scalars)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e "
                    "'.[test,tpu]' -c constraints.txt)")
def test_cpu_run_starts_clean_and_says_it_compiles(tmp_path):
  # As a user runs it: no JAX_PLATFORMS, libtpu installed, no TPU chips.
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE")}
  env.update(PYTHONPATH=ROOT, XLA_FLAGS=env["HYPERMIXER_TEST_XLA_FLAGS"])
  cmd = [sys.executable, "-m", "hypermixer_jax.main",
         "--config=configs/default.py", f"--workdir={tmp_path / 'run'}",
         "--config.num_train_steps=4", "--config.log_every=2",
         "--config.warmup_steps=1", "--config.batch_size=8",
         "--config.eval_every=4", "--config.eval_batch_size=64",
         "--config.data.synthetic.num_eval_examples=64",
         "--config.checkpoint_every=4", "--config.evals.pseudo_attention.every=-1",
         "--config.model.num_layers=1"]
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stderr.splitlines()
  noise = [l for l in lines if any(n in l for n in LIBTPU_NOISE)]
  assert not noise, "\n".join(noise)
  said = [l.split("] ", 1)[-1] for l in lines]
  compiling = said.index("compiling the train step ...")
  first = next(i for i, l in enumerate(said) if l.startswith("[train] step"))
  assert compiling < first
  assert any(l.startswith("compiling the train step: done in ")
             for l in said[compiling:first])
  train = [l for l in said if l.startswith("[train] step")]
  assert [l.split(":")[0] for l in train] == ["[train] step 2/4",
                                              "[train] step 4/4"]
  assert [_reprinted(l) for l in train] == train


def test_readme_log_example_is_what_the_logger_prints():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    examples = TRAIN_LINE.findall(f.read())
  assert examples, "README.md shows no '[train] step S/T: ...' log line"
  for line in examples:
    assert _reprinted(line) == line
