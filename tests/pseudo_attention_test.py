"""``pseudo_attention.save_png``: a figure without touching matplotlib's
global state (a notebook's backend and pyplot stay as they were)."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_save_png_leaves_the_backend_and_pyplot_alone(tmp_path):
  # A fresh interpreter: the backend set first (as a notebook's inline one
  # is) must survive, and pyplot must not be imported by the call.
  script = textwrap.dedent(f"""
      import sys
      import matplotlib
      matplotlib.use("svg")
      import numpy as np
      from hypermixer_jax.train import pseudo_attention
      m = np.triu(np.arange(1.0, 50.0).reshape(7, 7))
      pseudo_attention.save_png({{"a": m, "b": m.T}}, {str(tmp_path / "m.png")!r},
                                inputs=np.arange(7.0), targets=-np.arange(7.0))
      print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
  """)
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["svg", "False"]
  import matplotlib.image  # pylint: disable=g-import-not-at-top
  image = matplotlib.image.imread(tmp_path / "m.png")
  # Two columns of 3.2 inches, two rows (6.8 inches) at 100 dpi; not blank.
  assert image.shape[:2] == (680, 640)
  assert image[..., :3].std() > 0.05
