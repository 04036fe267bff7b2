"""The experiments' entry points and the shape of the experiments/ folder."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed")
@pytest.mark.parametrize("entry", [
    "from hypermixer_jax.experiment import flags; flags.parser('x', 'doc')",
    "from hypermixer_jax.experiment import bench; bench.parser('doc')",
])
def test_script_parsers_keep_libtpu_out(entry):
  """An experiment trains in-process, without main.run(): building its
  parser first must keep libtpu (installed, no TPU chip) from starting, as
  main.run() does, or its start-up lines reach every script's stderr."""
  code = entry + "\nimport jax\nprint(jax.config.jax_platforms, " \
      "jax.devices()[0].platform)\n"
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120,
                       env=dict(env, PYTHONPATH=ROOT), capture_output=True,
                       text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["cpu", "cpu"]
  assert out.stderr.strip() == "", out.stderr
