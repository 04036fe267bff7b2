"""``common.gelu``: the erf form with its own derivative rule equals
``jax.nn.gelu(approximate=False)`` (values, first and second derivatives)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from hypermixer_jax.models import common


def _reference(x):
  """GELU in float64: x Phi(x) with SciPy's erfc (accurate in the tails)."""
  x = np.asarray(x, np.float64)
  return 0.5 * x * special.erfc(-x / np.sqrt(2.0))


def test_values_match_float64_and_jax_exact_gelu():
  x = np.linspace(-12, 12, 20001, dtype=np.float32)
  ours = np.asarray(jax.jit(common.gelu)(x), np.float64)
  ref = _reference(x)
  # Absolute error of a float32 rounding of |x| Phi(x).
  np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-6)
  # Relative accuracy where 1 + erf does not cancel (|GELU| > 0.02); in the
  # negative tail only the absolute error above is kept (as PyTorch's).
  big = np.abs(ref) > 2e-2
  np.testing.assert_allclose(ours[big], ref[big], rtol=2e-5)
  np.testing.assert_allclose(
      ours, np.asarray(jax.nn.gelu(x, approximate=False)), rtol=0, atol=2e-6)


def test_derivatives_match_jax_exact_gelu():
  x = jnp.linspace(-8, 8, 4001, dtype=jnp.float32)
  # jitted: op-by-op dispatch of the vmapped derivatives took ~15 s.
  d1 = jax.jit(jax.vmap(jax.grad(common.gelu)))
  d1_ref = jax.jit(jax.vmap(jax.grad(
      lambda v: jax.nn.gelu(v, approximate=False))))
  np.testing.assert_allclose(d1(x), d1_ref(x), rtol=1e-5, atol=1e-6)
  # Analytic: Phi(x) + x phi(x).
  xx = np.asarray(x, np.float64)
  analytic = (0.5 * special.erfc(-xx / np.sqrt(2))
              + xx * np.exp(-xx * xx / 2) / np.sqrt(2 * np.pi))
  np.testing.assert_allclose(d1(x), analytic, rtol=1e-5, atol=1e-6)
  d2 = jax.jit(jax.vmap(jax.grad(jax.grad(common.gelu))))
  d2_ref = jax.jit(jax.vmap(jax.grad(jax.grad(
      lambda v: jax.nn.gelu(v, approximate=False)))))
  np.testing.assert_allclose(d2(x), d2_ref(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_dtype_kept_and_close(dtype):
  x = jnp.linspace(-6, 6, 513).astype(dtype)
  y = common.gelu(x)
  assert y.dtype == dtype
  g = jax.grad(lambda v: jnp.sum(common.gelu(v)))(x)
  assert g.dtype == dtype
  ref = jax.nn.gelu(x.astype(jnp.float32), approximate=False)
  np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2e-2,
                             atol=2e-2)


def test_approximate_is_the_tanh_form():
  x = jnp.linspace(-4, 4, 101)
  np.testing.assert_allclose(common.gelu(x, approximate=True),
                             jax.nn.gelu(x, approximate=True), rtol=1e-6)
  assert np.max(np.abs(common.gelu(x, True) - common.gelu(x))) > 1e-4
