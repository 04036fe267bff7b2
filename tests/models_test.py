"""Tests of the blocks, encoders, heads and ``build_model``."""

from absl.testing import parameterized
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hypermixer_jax import models
from hypermixer_jax import sharding
from hypermixer_jax.models import blocks
from hypermixer_jax.models import fnet

# Distinct primes where possible, so that a transposed axis cannot pass.
B, N, D, F, V, C = 2, 7, 12, 17, 31, 3
IMAGE, PATCH = (8, 12), 4  # 2 x 3 = 6 patches
MIXER_KWARGS = {
    "hypermixer": dict(hyper_dim=5),
    "mlp_mixer": dict(token_mlp_dim=5),
    "gmlp": dict(d_ffn=10),
    "amlp": dict(d_ffn=10, tiny_attention_dim=5),
    "attention": dict(num_heads=2),
    "linear_attention": dict(num_heads=2),
    "fnet": {},
    "none": {},
}
MIXERS = tuple(MIXER_KWARGS)


def tiny_config(mixer: str, task: str = "classify", **overrides):
  cfg = models.default_model_config()
  cfg.update(mixer=mixer, num_layers=1, d_model=D, d_ffn=F, max_len=N,
             vocab_size=V, num_classes=C, dropout_rate=0.1,
             position_embeddings="learned")
  cfg.mixer_kwargs.update(MIXER_KWARGS[mixer])
  if task == "mlm":
    cfg.head = "mlm"
  elif task == "classify":
    cfg.head = "pair_classify"
  elif task == "image":
    n = (IMAGE[0] // PATCH) * (IMAGE[1] // PATCH)
    cfg.update(family="continuous", head="image", max_len=n,
               input_dim=PATCH * PATCH * 3, patch_size=PATCH,
               position_embeddings="none", type_vocab_size=0)
  cfg.update(overrides)
  return cfg


def task_batch(task: str):
  k1, k2 = jax.random.split(jax.random.key(1))
  if task == "image":
    inputs = jax.random.normal(k1, (B,) + IMAGE + (3,))
    return inputs, {}, jax.random.randint(k2, (B,), 0, C)
  ids = jax.random.randint(k1, (B, N), 0, V)
  segment_ids = jnp.array([[1] * N, [1] * 5 + [0] * (N - 5)])
  kw = dict(segment_ids=segment_ids,
            token_type_ids=jnp.array([[0] * 3 + [1] * (N - 3)] * B))
  if task == "mlm":
    return ids, kw, jax.random.randint(k2, (B, N), 0, V)
  return ids, kw, jax.random.randint(k2, (B,), 0, C)


def layer_norm(x, p, eps=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p["ln"]["scale"] + p["ln"]["bias"]


def gelu(x):
  return np.asarray(jax.nn.gelu(jnp.asarray(x), approximate=False))


# (mixer, task) -> float32 parameters, initialised (eagerly, which is slow)
# once and shared by the float32 and bfloat16 cases of ForwardBackwardTest.
_INIT_PARAMS = {}


class ForwardBackwardTest(parameterized.TestCase):

  @parameterized.product(mixer=MIXERS, dtype=("float32", "bfloat16"))
  def test_trains(self, mixer, dtype):
    # The three tasks' models share one jit (one compilation per test).
    tasks = ("mlm", "classify", "image")
    built, params = {}, {}
    for task in tasks:
      cfg = tiny_config(mixer, task, dtype=dtype, param_dtype="float32")
      built[task] = (models.build_model(cfg),) + task_batch(task)
      model, inputs, kw, _ = built[task]
      init = lambda m=model, i=inputs, kw=kw: nn.unbox(  # noqa: E731
          m.init(jax.random.key(0), i, **kw))["params"]
      if (mixer, task) not in _INIT_PARAMS:
        _INIT_PARAMS[mixer, task] = init()
      else:
        # This dtype's own init, abstractly: param_dtype=float32 makes its
        # parameters the other dtype's (same tree, shapes and dtypes), so
        # the values initialised once per mixer and task are reused.
        chex.assert_trees_all_equal_shapes_and_dtypes(
            _INIT_PARAMS[mixer, task], jax.eval_shape(init))
      params[task] = _INIT_PARAMS[mixer, task]

    def loss_fn(params):
      losses, logits = {}, {}
      for task, (model, inputs, kw, labels) in built.items():
        logits[task] = model.apply(
            {"params": params[task]}, inputs, **kw, deterministic=False,
            rngs={"dropout": jax.random.key(2)})
        losses[task] = optax.softmax_cross_entropy_with_integer_labels(
            logits[task], labels).mean()
      return sum(losses.values()), (losses, logits)

    (total, (losses, logits)), grads = jax.jit(
        jax.value_and_grad(loss_fn, has_aux=True))(params)
    # One small step against the gradient lowers the loss (same dropout
    # masks); in bfloat16 the losses stay close to float32's.
    if dtype == "float32":
      stepped = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
      self.assertLess(float(jax.jit(loss_fn)(stepped)[0]), float(total))
    else:
      f32 = {t: (models.build_model(tiny_config(mixer, t, dtype="float32")),)
             + task_batch(t)
             for t in tasks}
      for task, (model, inputs, kw, labels) in f32.items():
        ref = optax.softmax_cross_entropy_with_integer_labels(
            model.apply({"params": params[task]}, inputs, **kw,
                        deterministic=False,
                        rngs={"dropout": jax.random.key(2)}), labels).mean()
        np.testing.assert_allclose(float(losses[task]), float(ref),
                                   rtol=5e-2, err_msg=task)
    for task in tasks:
      for leaf in jax.tree.leaves(params[task]):
        self.assertEqual(leaf.dtype, jnp.float32)
      self.assertEqual(logits[task].shape,
                       (B, N, V) if task == "mlm" else (B, C))
      self.assertTrue(np.isfinite(losses[task]), task)
      chex.assert_tree_all_finite(grads[task])
      layer = grads[task]["encoder"]["stack"]["layer_0"]
      if mixer in ("fnet", "none"):
        self.assertNotIn("token_mixing", layer)
        continue
      for path, g in jax.tree_util.tree_leaves_with_path(
          layer["token_mixing"]):
        self.assertGreater(
            float(jnp.abs(g).max()), 0.0,
            f"{task}: zero gradient for token_mixing"
            f"{jax.tree_util.keystr(path)}")


class MlmHeadTest(parameterized.TestCase):

  def test_logits_are_tied_to_the_input_embedding(self):
    model = models.build_model(tiny_config("attention", "mlm",
                                           dropout_rate=0.0))
    inputs, kw, _ = task_batch("mlm")
    variables = nn.unbox(model.init(jax.random.key(0), inputs, **kw))
    params = variables["params"]
    # Only one [V, d]-sized matrix exists: the input embedding.
    shapes = [l.shape for l in jax.tree.leaves(params)]
    self.assertEqual(sum(s in ((V, D), (D, V)) for s in shapes), 1)
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(
        jax.random.key(3), p.shape), params)  # non-trivial bias and LN
    logits, state = model.apply({"params": params}, inputs, **kw,
                                capture_intermediates=True,
                                mutable=["intermediates"])
    h = state["intermediates"]["mlm_head"]["transform_norm"]["__call__"][0]
    emb = params["encoder"]["token_embed"]["embedding"]
    want = np.asarray(h) @ np.asarray(emb).T + np.asarray(
        params["mlm_head"]["output_bias"])
    chex.assert_trees_all_close(logits, want, atol=1e-5)

  def test_output_gradient_reaches_the_embedding_of_absent_tokens(self):
    # A token id that is not in the input only gets gradient through E^T.
    model = models.build_model(tiny_config("none", "mlm", dropout_rate=0.0))
    inputs = jnp.zeros((B, N), jnp.int32)
    labels = jnp.full((B, N), 5)
    params = nn.unbox(model.init(jax.random.key(0), inputs))["params"]

    def loss_fn(p):
      logits = model.apply({"params": p}, inputs)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, labels).mean()
    grads = jax.grad(loss_fn)(params)
    g = grads["encoder"]["token_embed"]["embedding"]
    self.assertGreater(float(jnp.abs(g[5]).max()), 0.0)


class MixerBlockTest(parameterized.TestCase):
  """One block against a hand-written NumPy composition (FNet mixing)."""

  def setUp(self):
    super().setUp()
    self.x = np.asarray(jax.random.normal(jax.random.key(0), (B, N, D)))

  def params(self, layout):
    block = blocks.MixerBlock(fnet.FourierMixing, F, layout=layout)
    params = nn.unbox(block.init(jax.random.key(1), self.x))["params"]
    params = jax.tree.map(lambda p: p + 0.3 * jax.random.normal(
        jax.random.key(4), p.shape), params)
    return block, jax.tree.map(np.asarray, params)

  def reference(self, layout, p):
    mix = lambda h: np.real(np.fft.fft2(h, axes=(-2, -1)))  # noqa: E731
    ffn = lambda h: gelu(h @ p["feature_mixing"]["wi"]["dense"]["kernel"]  # noqa: E731
                         + p["feature_mixing"]["wi"]["dense"]["bias"]
                         ) @ p["feature_mixing"]["wo"]["dense"]["kernel"] + (
                             p["feature_mixing"]["wo"]["dense"]["bias"])
    x = self.x
    if layout == "pre_ln":
      y = x + mix(layer_norm(x, p["mixing_norm"]))
      return y + ffn(layer_norm(y, p["ffn_norm"]))
    y = layer_norm(x + mix(x), p["mixing_norm"])
    return layer_norm(y + ffn(y), p["ffn_norm"])

  @parameterized.parameters("pre_ln", "post_ln")
  def test_matches_hand_composition(self, layout):
    block, p = self.params(layout)
    got = block.apply({"params": p}, self.x)
    chex.assert_trees_all_close(got, self.reference(layout, p), atol=1e-4)

  def test_layouts_differ(self):
    block, p = self.params("pre_ln")
    post = blocks.MixerBlock(fnet.FourierMixing, F, layout="post_ln")
    diff = np.abs(block.apply({"params": p}, self.x)
                  - post.apply({"params": p}, self.x)).max()
    self.assertGreater(diff, 1e-2)

  def test_unknown_layout(self):
    block = blocks.MixerBlock(fnet.FourierMixing, F, layout="sandwich")
    with self.assertRaisesRegex(ValueError, "pre_ln, post_ln"):
      block.init(jax.random.key(0), self.x)


class PaddingTest(parameterized.TestCase):

  @parameterized.parameters(*MIXERS)
  def test_padded_equals_unpadded(self, mixer):
    model = models.build_model(tiny_config(mixer, dropout_rate=0.0))
    ids = jax.random.randint(jax.random.key(5), (B, N), 1, V)
    types = jnp.array([[0, 0, 1, 1, 1, 1, 1]] * B)
    lengths = (4, N)
    seg = (jnp.arange(N)[None] < jnp.array(lengths)[:, None]).astype(jnp.int32)
    padded_ids = jnp.where(seg > 0, ids, 0)
    params = model.init(jax.random.key(0), ids)
    apply = model.apply  # eager: three shapes, no compilation worth caching
    padded = apply(params, padded_ids, segment_ids=seg, token_type_ids=types)
    for b, n in enumerate(lengths):
      alone = apply(params, ids[b:b + 1, :n],
                    segment_ids=jnp.ones((1, n), jnp.int32),
                    token_type_ids=types[b:b + 1, :n])
      chex.assert_trees_all_close(padded[b], alone[0], atol=1e-4)


class CausalTest(parameterized.TestCase):

  @parameterized.parameters("attention", "linear_attention", "hypermixer",
                            "none")
  def test_causal_lm_never_reads_the_future(self, mixer):
    cfg = tiny_config(mixer, head="causal_lm", dropout_rate=0.0)
    model = models.build_model(cfg)
    ids = jax.random.randint(jax.random.key(5), (1, N), 0, V)
    params = model.init(jax.random.key(0), ids)
    apply = jax.jit(model.apply)  # both calls share one compilation
    base = apply(params, ids)
    self.assertEqual(base.shape, (1, N, V))
    changed = apply(params, ids.at[0, 4].set((ids[0, 4] + 1) % V))
    chex.assert_trees_all_close(changed[:, :4], base[:, :4], atol=1e-5)
    self.assertGreater(float(jnp.abs(changed[:, 4:] - base[:, 4:]).max()), 0)


class ConfigErrorTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("unknown_mixer", dict(mixer="transformerz"), "hypermixer, mlp_mixer"),
      ("unknown_head", dict(head="seq2seq"), "valid heads: mlm"),
      ("unknown_block", dict(block="sandwich"), "pre_ln, post_ln, gmlp"),
      ("unknown_family", dict(family="audio"), "text, continuous"),
      ("unknown_dtype", dict(dtype="float8"), "float32, bfloat16"),
      ("unknown_positions", dict(position_embeddings="rope"),
       "learned, sinusoidal, none"),
      ("heads_do_not_divide", dict(mixer_kwargs=dict(num_heads=5)),
       "not divisible by num_heads=5"),
      ("causal_fnet", dict(mixer="fnet", head="causal_lm", mixer_kwargs={}),
       "needs a causal token mixer.*causal mixers: .*attention"),
      ("causal_mlp_mixer", dict(mixer="mlp_mixer", head="causal_lm",
                                mixer_kwargs={}), "no causal mode"),
      ("gmlp_block_other_mixer", dict(block="gmlp"), "needs mixer 'gmlp'"),
  )
  def test_raises(self, overrides, message):
    cfg = tiny_config("attention").to_dict()
    cfg.update(overrides)
    if "mixer_kwargs" in overrides:
      cfg["mixer_kwargs"] = overrides["mixer_kwargs"]
    with self.assertRaisesRegex(ValueError, message):
      models.build_model(cfg)

  def test_unknown_mixer_kwarg_lists_the_valid_ones(self):
    cfg = tiny_config("hypermixer")
    cfg.mixer_kwargs.hyperdim = 3
    with self.assertRaisesRegex(ValueError, r"\['hyperdim'\].*hyper_dim"):
      models.build_model(cfg)

  def test_wrong_input_width(self):
    model = models.build_model(tiny_config("none", "image"))
    with self.assertRaisesRegex(ValueError, "input_dim=48"):
      model.init(jax.random.key(0), jnp.zeros((1, 6, 47)))

  def test_gmlp_block(self):
    cfg = tiny_config("gmlp", block="gmlp")
    model = models.build_model(cfg)
    inputs, kw, _ = task_batch("classify")
    params = jax.eval_shape(model.init, jax.random.key(0), inputs, **kw)
    layer = params["params"]["encoder"]["stack"]["layer_0"]
    self.assertNotIn("feature_mixing", layer)


class ShardingTest(parameterized.TestCase):

  def test_sharded_init_and_apply_on_8_devices(self):
    mesh = sharding.build_mesh(dict(data=2, fsdp=2, tensor=2))
    rules = sharding.get_rules("fsdp_tensor")
    # Sizes divisible by the mesh axes they are split over.
    cfg = tiny_config("hypermixer", "mlm", vocab_size=32, d_ffn=16,
                      dropout_rate=0.0)
    cfg.mixer_kwargs.hyper_dim = 6
    model = models.build_model(cfg)
    ids = jax.random.randint(jax.random.key(5), (B * 2, N), 0, 32)
    variables, _ = sharding.sharded_init(
        lambda k: model.init(k, ids), jax.random.key(0), mesh, rules)
    emb = variables["params"]["encoder"]["token_embed"]["embedding"]
    self.assertEqual(emb.sharding.spec, jax.P("tensor", "fsdp"))
    wi = variables["params"]["encoder"]["stack"]["layer_0"]["feature_mixing"]
    self.assertEqual(wi["wi"]["dense"]["kernel"].sharding.spec,
                     jax.P("fsdp", "tensor"))
    sharded = jax.jit(sharding.within(model.apply, mesh, rules))(
        variables, ids)
    chex.assert_trees_all_close(
        sharded, model.apply(jax.device_get(variables), ids), atol=1e-4)


class PatchifyTest(parameterized.TestCase):

  def test_stem_equals_strided_conv(self):
    images = jax.random.normal(jax.random.key(0), (B,) + IMAGE + (3,))
    kernel = jax.random.normal(jax.random.key(1), (PATCH, PATCH, 3, D))
    conv = jax.lax.conv_general_dilated(
        images, kernel, (PATCH, PATCH), "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"))      # [B, 2, 3, D]
    dense = models.patchify(images, PATCH) @ kernel.reshape(-1, D)
    chex.assert_trees_all_close(dense, conv.reshape(B, -1, D), atol=1e-4)


class ConvStemTest(parameterized.TestCase):

  def test_conv_stem_equals_numpy_loop_and_ignores_padding(self):
    n, k1, k2 = 5, 3, 2            # an even kernel pins 'SAME' (pad more after)
    enc = models.ContinuousEncoder(
        layer=None, num_layers=0, d_model=D, max_len=N, input_dim=1,
        final_norm=False, conv_stem=(k1, k2))
    x = np.asarray(jax.random.normal(jax.random.key(0), (1, n, 1)))
    params = nn.meta.unbox(enc.init(jax.random.key(1), x)["params"])
    leaves, tree = jax.tree_util.tree_flatten(params)
    params = jax.tree_util.tree_unflatten(tree, [   # non-zero biases too
        a + 0.1 * jax.random.normal(jax.random.key(10 + i), a.shape)
        for i, a in enumerate(leaves)])
    p = jax.device_get(params)

    def conv(h, kernel, bias):    # h [n, d], kernel [k, d, d], 'SAME'
      k = kernel.shape[0]
      lo = (k - 1) // 2
      padded = np.pad(h, ((lo, k - 1 - lo), (0, 0)))
      out = np.stack([sum(padded[i + j] @ kernel[j] for j in range(k))
                      for i in range(h.shape[0])])
      return np.asarray(jax.nn.gelu(out + bias, approximate=False))

    h = x[0] @ p["stem"]["dense"]["kernel"] + p["stem"]["dense"]["bias"]
    for i in range(2):
      h = conv(h, np.asarray(p[f"conv_stem_{i}"]["kernel"]),
               np.asarray(p[f"conv_stem_{i}"]["bias"]))
    chex.assert_trees_all_close(enc.apply({"params": params}, x)[0], h,
                                atol=1e-5)

    # Through build_model with a mixer: padding must not leak into real tokens.
    cfg = models.default_model_config()
    cfg.update(family="continuous", head="regression", mixer="hypermixer",
               num_layers=1, d_model=D, d_ffn=F, max_len=N, input_dim=1,
               dropout_rate=0.0, position_embeddings="none", type_vocab_size=0,
               conv_stem=(k1, k2))
    cfg.mixer_kwargs.update(MIXER_KWARGS["hypermixer"])
    model = models.build_model(cfg)
    junk = 7.0 * np.ones((1, N - n, 1), np.float32)
    padded = np.concatenate([x, junk], axis=1)
    seg = np.array([[1] * n + [0] * (N - n)])
    variables = model.init(jax.random.key(2), padded, segment_ids=seg)
    chex.assert_trees_all_close(
        model.apply(variables, padded, segment_ids=seg)[:, :n],
        model.apply(variables, x), atol=1e-5)


if __name__ == "__main__":
  from absl.testing import absltest
  absltest.main()
