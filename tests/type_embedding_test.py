"""Token-type embeddings looked up as a one-hot product equal nn.Embed."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax.models import encoders


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_hot_lookup_equals_the_gather_and_its_gradient(dtype):
  embed = nn.Embed(3, 8, dtype=dtype)
  ids = jnp.array([[0, 1, 2, 1, 1], [2, 2, 0, 0, 1]])
  params = embed.init(jax.random.key(0), ids)

  def loss(p, lookup):
    y = embed.apply(p, ids, method=lookup).astype(jnp.float32)
    return jnp.sum(y * jnp.arange(8.0)), y

  gather = lambda m, i: m(i)
  one_hot = lambda m, i: encoders._few_rows_lookup(m, i)  # pylint: disable=protected-access
  (_, want), g_want = jax.value_and_grad(loss, has_aux=True)(params, gather)
  (_, got), g_got = jax.value_and_grad(loss, has_aux=True)(params, one_hot)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # The table's gradient: rows summed over the tokens of each type.
  np.testing.assert_allclose(g_got["params"]["embedding"],
                             g_want["params"]["embedding"], rtol=1e-6)
  counts = np.bincount(np.asarray(ids).ravel(), minlength=3)
  np.testing.assert_allclose(g_got["params"]["embedding"],
                             counts[:, None] * np.arange(8.0)[None, :])

