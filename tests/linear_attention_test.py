"""Linear attention's implementations against a NumPy loop and each other.

``attention.linear_attention`` has the chunked form (default) and the
per-position outer products (``outer``, the definition). Both are checked
against a loop over queries and keys written here, for values and gradients,
on packed rows with padding, non-contiguous segment ids, unpacked rows and
rows without segments, causal and not; the chunk sizes used force one chunk,
several chunks and a padded last chunk (N = 13, a prime). Dimensions are
distinct (B=2, H=3, Dh=5, Dv=7) so that a transposed axis cannot pass.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax import models
from hypermixer_jax.models import attention

B, N, H, DH, DV = 2, 13, 3, 5, 7
EPS = 1e-6
# Row 0: three packed examples, padding in the middle and at the end; row 1:
# ids that come back after another id (non-contiguous: the non-causal sums
# join equal ids, the causal prefix sums restart at each change of id).
PACKED = np.array([[1, 1, 1, 2, 2, 0, 3, 3, 3, 3, 3, 0, 0],
                   [1, 1, 2, 2, 2, 1, 1, 3, 3, 2, 2, 2, 0]])
UNPACKED = np.array([[1] * 13, [1] * 9 + [0] * 4])
MASK = np.array([[True] * 13, [True] * 10 + [False] * 3])


def np_linear_attention(q, k, v, mask, seg, causal):
  """The definition, one query and one key at a time (float64)."""
  q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
  b, n = q.shape[:2]
  real = np.ones((b, n), bool) if mask is None else np.asarray(mask)
  if seg is not None:
    real = real & (seg > 0)
  run = None if seg is None else np.cumsum(
      np.concatenate([np.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], 1),
      axis=1)
  y = np.zeros(q.shape[:3] + (v.shape[-1],))
  for r in range(b):
    for i in range(n):
      for h in range(q.shape[2]):
        s_mat, s_vec = np.zeros((q.shape[-1], v.shape[-1])), np.zeros(q.shape[-1])
        for j in range(n):
          if not real[r, j] or (causal and j > i):
            continue
          if seg is not None and not causal and seg[r, j] != seg[r, i]:
            continue
          if seg is not None and causal and run[r, j] != run[r, i]:
            continue
          s_mat = s_mat + np.outer(k[r, j, h], v[r, j, h])
          s_vec = s_vec + k[r, j, h]
        y[r, i, h] = q[r, i, h] @ s_mat / (q[r, i, h] @ s_vec + EPS)
  return y


def _qkv(n=N, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  # Features are non-negative (phi = elu + 1 > 0).
  q, k = (jax.nn.elu(jax.random.normal(kk, (B, n, H, DH))) + 1 for kk in ks[:2])
  return q, k, jax.random.normal(ks[2], (B, n, H, DV))


CASES = {  # name: (mask, segment_ids)
    "plain": (None, None),
    "mask": (MASK, None),
    "packed": (None, PACKED),
    "packed_and_mask": (MASK, PACKED),
    "unpacked": (None, UNPACKED),
}
# chunk 64: one chunk (the quadratic form); 3: five chunks, the last padded;
# 1: every token its own chunk.
IMPLS = (("outer", 64), (None, 64), (None, 3), (None, 1))
CAUSAL = pytest.mark.parametrize("causal", [False, True],
                                 ids=["bidir", "causal"])


def _call(q, k, v, name, causal, impl=None, chunk=64, packed=True):
  mask, seg = CASES[name]
  return attention.linear_attention(
      q, k, v, mask=None if mask is None else jnp.asarray(mask),
      segment_ids=None if seg is None else jnp.asarray(seg), causal=causal,
      packed=packed, chunk_size=chunk, implementation=impl, eps=EPS)


def _grads(fn, q, k, v):
  """Gradients w.r.t. q, k, v of a weighted sum of ``fn``'s outputs."""
  w = jax.random.normal(jax.random.key(9), q.shape[:3] + (DV,))
  return jax.grad(lambda *a: jnp.sum(w * fn(*a)), (0, 1, 2))(q, k, v)


@CAUSAL
@pytest.mark.parametrize("name", CASES)
def test_matches_numpy_loop(name, causal):
  q, k, v = _qkv()
  ys = jax.jit(lambda *a: [_call(*a, name, causal, impl, chunk)
                           for impl, chunk in IMPLS])(q, k, v)
  ref = np_linear_attention(q, k, v, *CASES[name], causal)
  for (impl, chunk), y in zip(IMPLS, ys):
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5,
                               err_msg=f"{impl or 'chunked'} {chunk}")


@CAUSAL
@pytest.mark.parametrize("name", ["mask", "packed_and_mask", "unpacked"])
def test_gradients_match_outer(name, causal):
  q, k, v = _qkv(seed=1)
  impls = IMPLS[:3]
  ref, *ours = jax.jit(lambda *t: [
      _grads(lambda *a, i=i, c=c: _call(*a, name, causal, i, c), *t)
      for i, c in impls])(q, k, v)
  for (_, chunk), got in zip(impls[1:], ours):
    for g, r in zip(got, ref):
      assert float(jnp.abs(r).max()) > 1e-3
      np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5,
                                 err_msg=f"chunk {chunk}")


@CAUSAL
def test_unpacked_rows_declared(causal):
  """packed=False gives the same values and gradients on rows of one
  example, and NaN (not a silent mix) at tokens of a second example."""
  q, k, v = _qkv(seed=2)
  fn = lambda packed: lambda *a: _call(*a, "unpacked", causal,  # noqa: E731
                                       packed=packed)
  (y0, g0), (y1, g1) = jax.jit(lambda *t: [
      (fn(p)(*t), _grads(fn(p), *t)) for p in (False, True)])(q, k, v)
  np.testing.assert_allclose(y0, y1, rtol=1e-5, atol=1e-6)
  for g, r in zip(g0, g1):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
  y = attention.linear_attention(q, k, v, segment_ids=jnp.asarray(PACKED),
                                 causal=causal, packed=False)
  np.testing.assert_array_equal(np.isnan(y).all((2, 3)), PACKED > 1)
  assert not np.isnan(y[PACKED <= 1]).any()


def _shapes(jaxpr):
  """Shapes of every intermediate of a jaxpr, sub-jaxprs included."""
  for eqn in jaxpr.eqns:
    yield from (tuple(o.aval.shape) for o in eqn.outvars)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _shapes(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _shapes(sub)


@CAUSAL
@pytest.mark.parametrize("name,chunk,packed", [
    ("packed", 64, True), ("packed", 3, True), ("unpacked", 64, False),
    ("plain", 3, True)])
def test_no_per_position_state(name, chunk, packed, causal):
  """Forward and backward hold nothing of N Dh Dv elements per row and
  head (the outer form's [B, N, H, Dh, Dv]); the outer form does."""
  q, k, v = _qkv()
  size = B * N * H * DH * DV

  def biggest(impl):
    fn = lambda *a: _call(*a, name, causal, impl, chunk, packed)  # noqa: E731
    loss = lambda *a: jnp.sum(fn(*a) ** 2)  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v).jaxpr
    return max(int(np.prod(s)) for s in _shapes(jaxpr))

  assert biggest("outer") >= size
  assert biggest(None) < size / 2


def test_module_matches_outer_with_gradients():
  """LinearAttention end to end (projections, elu + 1, packed rows with
  padding, N=13 in chunks of 3): values and gradients w.r.t. the parameters
  and the input equal the outer form's."""
  x = jax.random.normal(jax.random.key(4), (B, N, 15))
  seg = jnp.asarray(PACKED)
  params = nn.meta.unbox(attention.LinearAttention(H).init(
      jax.random.key(0), x))

  def value_and_grad(module):
    return jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(
        module.apply(p, x, segment_ids=seg))), (0, 1))(params, x)

  pairs = jax.jit(lambda: [
      [value_and_grad(attention.LinearAttention(H, causal=causal, **kw))
       for kw in (dict(chunk_size=3), dict(implementation="outer"))]
      for causal in (False, True)])()
  for (l1, g1), (l2, g2) in pairs:
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_bad_arguments():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"implementation='flash'; expected "
                     r"None \(chunked\) or one of \('chunked', 'outer'\)"):
    attention.linear_attention(q, k, v, implementation="flash")
  with pytest.raises(ValueError, match=r"chunk_size=0 must be >= 1"):
    attention.linear_attention(q, k, v, chunk_size=0)


def test_packed_false_refuses_packing():
  """A model declared on unpacked rows says so to the training loop."""
  cfg = models.get_model_config("glue_linear_attention")
  assert models.model_facts(cfg).packing_error is None
  cfg.mixer_kwargs.packed = False
  error = models.model_facts(cfg).packing_error
  assert error.startswith("model.mixer='linear_attention' has "
                          "mixer_kwargs.packed=False")
  assert "--config.data.packing=False" in error
