"""``pseudo_attention``: the map of a known linear token mixer, and
``save_png``: a figure without touching matplotlib's global state (a
notebook's backend and pyplot stay as they were)."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

from hypermixer_jax.train import pseudo_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_map_of_a_linear_token_mixer_is_its_matrix_rows_as_outputs():
  """y = W x V (W [N, N] over tokens, V [d_in, d_out] over features):
  ∂y_ia / ∂x_jb = W_ij V_ba, so the map is |W_ij| ||V||_F, row i the output
  token. W is asymmetric (|W| != |W|^T), and N, d_in, d_out are distinct
  primes, so a transposed map or a swapped axis cannot pass."""
  n, d_in, d_out = 7, 3, 5
  rng = np.random.default_rng(0)
  w = np.triu(rng.normal(size=(n, n))) + 0.1 * np.tril(
      rng.normal(size=(n, n)), -1)
  v = rng.normal(size=(d_in, d_out))
  assert np.abs(np.abs(w) - np.abs(w).T).max() > 0.5
  apply_fn = jax.jit(lambda x: jnp.asarray(w, jnp.float32) @ x
                     @ jnp.asarray(v, jnp.float32))
  x = jnp.asarray(rng.normal(size=(n, d_in)), jnp.float32)
  got = np.asarray(pseudo_attention.pseudo_attention(apply_fn, x))
  assert got.shape == (n, n)
  np.testing.assert_allclose(got, np.abs(w) * np.linalg.norm(v), rtol=1e-5,
                             atol=1e-6)


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
