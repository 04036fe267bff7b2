"""Tests of FNet's Fourier mixing and the identity mixer."""
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from hypermixer_jax.models import fnet

B, N, D = 2, 7, 5  # distinct primes: a transposed axis cannot pass


def dft_reference(x: np.ndarray) -> np.ndarray:
  """Re(DFT_seq(DFT_hidden(x))) of one sequence [n, d], as explicit loops."""
  n, d = x.shape
  out = np.zeros((n, d))
  for i in range(n):
    for k in range(d):
      acc = 0j
      for j in range(n):
        for l in range(d):
          acc += x[j, l] * np.exp(-2j * np.pi * (i * j / n + k * l / d))
      out[i, k] = acc.real
  return out


_apply = jax.jit(fnet.FourierMixing().apply)


def apply(x, **kw):
  return _apply({}, x, **kw)


class FourierMixingTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.x = np.asarray(jax.random.normal(jax.random.key(0), (B, N, D)))

  def test_matches_numpy_loop_dft(self):
    want = np.stack([dft_reference(self.x[b]) for b in range(B)])
    chex.assert_trees_all_close(apply(self.x), want, atol=1e-4)

  def test_no_parameters(self):
    self.assertEqual(fnet.FourierMixing().init(jax.random.key(0), self.x), {})

  def test_full_mask_equals_fft_path(self):
    mask = np.ones((B, N), bool)
    chex.assert_trees_all_close(apply(self.x, mask=mask), apply(self.x),
                                atol=1e-4)

  def test_padded_equals_unpadded(self):
    lengths = (4, 6)
    mask = np.arange(N)[None] < np.array(lengths)[:, None]
    x = np.where(mask[..., None], self.x, 123.0)  # junk on padding
    got = apply(x, mask=mask)
    for b, n in enumerate(lengths):
      chex.assert_trees_all_close(got[b, :n], dft_reference(self.x[b, :n]),
                                  atol=1e-4)
      chex.assert_trees_all_close(got[b, n:], 0.0)

  def test_segments_never_mix(self):
    # Row 0: segments of length 3 and 4; row 1: 2, 3, then 2 padding.
    seg = np.array([[1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 2, 0, 0]])
    got = apply(self.x, segment_ids=seg)
    for b in range(B):
      for s in (1, 2):
        idx = np.flatnonzero(seg[b] == s)
        chex.assert_trees_all_close(got[b, idx],
                                    dft_reference(self.x[b, idx]), atol=1e-4)
    chex.assert_trees_all_close(got[1, 5:], 0.0)

  def test_bfloat16_computes_in_float32(self):
    x16 = jnp.asarray(self.x, jnp.bfloat16)
    got = fnet.FourierMixing(dtype=jnp.bfloat16).apply({}, x16)
    self.assertEqual(got.dtype, jnp.bfloat16)
    want = np.stack([dft_reference(np.asarray(x16, np.float32)[b])
                     for b in range(B)])
    # Only the final cast rounds: relative error of bf16 (2^-8).
    np.testing.assert_allclose(np.asarray(got, np.float32), want,
                               atol=0.05 * np.abs(want).max())

  def test_long_sequence_angles_are_exact(self):
    # p_i p_j is reduced mod L in integers, so large N stays accurate.
    n = 257
    x = np.asarray(jax.random.normal(jax.random.key(1), (1, n, 3)))
    masked = apply(x, mask=np.ones((1, n), bool))
    chex.assert_trees_all_close(masked, apply(x), atol=2e-3)


class IdentityMixingTest(parameterized.TestCase):

  def test_returns_input(self):
    x = np.asarray(jax.random.normal(jax.random.key(0), (B, N, D)))
    mixer = fnet.IdentityMixing()
    self.assertEqual(mixer.init(jax.random.key(0), x), {})
    np.testing.assert_array_equal(
        mixer.apply({}, x, mask=np.ones((B, N), bool)), x)


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()
