"""MLM logits only at the selected positions (BERT's max_predictions_per_seq).

The model computes the MLM head at ``masked_positions`` [B, P] only; loss and
gradients must equal the full-vocabulary head's on [B, N] with the same
weights, for unpacked and packed rows. The data side's 15% rounding must fit
P, and a packed row with more selections keeps its first P (the rest get
their original token back and no weight).
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow as tf

from hypermixer_jax import heads
from hypermixer_jax import models
from hypermixer_jax.data import converters
from hypermixer_jax.data import preprocessors
from hypermixer_jax.train import evaluation
from hypermixer_jax.train import steps

B, N, V, P = 3, 13, 41, 4   # batch, length, vocabulary, predictions per row


def _model(mixer="attention"):
  cfg = models.default_model_config()
  cfg.update(dict(family="text", mixer=mixer, head="mlm", num_layers=1,
                  d_model=16, d_ffn=32, max_len=N, vocab_size=V,
                  dropout_rate=0.0))
  if mixer == "attention":
    cfg.mixer_kwargs.num_heads = 2
  return models.build_model(cfg)


def _positions(weights, slots):
  """Selected positions first (in order), then unselected ones (NumPy)."""
  out = []
  for w in weights:
    sel = list(np.flatnonzero(w > 0))
    out.append(sel + [i for i in range(len(w)) if i not in sel][:slots - len(sel)])
  return np.asarray(out, np.int32)


def _batch(packed: bool, seed=0):
  rng = np.random.default_rng(seed)
  targets = rng.integers(1, V, size=(B, N)).astype(np.int32)
  inputs = np.where(rng.random((B, N)) < 0.2, 3, targets).astype(np.int32)
  if packed:   # two examples and padding per row
    seg = np.array([[1] * 5 + [2] * 6 + [0] * 2] * B, np.int32)
    pos = np.array([list(range(5)) + list(range(6)) + [0, 0]] * B, np.int32)
  else:        # one example, rows of different lengths
    lengths = np.array([N, 9, 6])
    seg = (np.arange(N)[None] < lengths[:, None]).astype(np.int32)
    pos = np.arange(N)[None] * seg
  weights = np.zeros((B, N), np.float32)
  for b in range(B):   # at most P selections, never on padding
    real = np.flatnonzero(seg[b] > 0)
    weights[b, rng.choice(real, size=P - b % 2, replace=False)] = 1
  batch = dict(inputs=inputs, targets=targets, weights=weights,
               segment_ids=seg, positions=pos.astype(np.int32))
  return batch, dict(batch, masked_positions=_positions(weights, P))


_ATTENTION = _model()


def _loss(params, batch):
  inputs, kwargs = heads.model_inputs(batch, "mlm")
  out = _ATTENTION.apply({"params": params}, inputs, **kwargs)
  return heads.compute_loss("mlm", out, batch)


@jax.jit
def _full_and_gathered(params, full, gathered):
  """Loss and gradients of both heads, and the gathered logits: one program
  for both parametrisations (their batches have the same shapes)."""
  return (jax.value_and_grad(_loss, has_aux=True)(params, full),
          jax.value_and_grad(_loss, has_aux=True)(params, gathered),
          _ATTENTION.apply({"params": params}, gathered["inputs"],
                           **heads.model_inputs(gathered, "mlm")[1]))


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_gathered_head_equals_full_head(packed):
  full, gathered = _batch(packed)
  params = jax.jit(_ATTENTION.init)(jax.random.key(0), full["inputs"],
                                    segment_ids=full["segment_ids"])["params"]
  ((l_full, m_full), g_full), ((l_gat, m_gat), g_gat), logits = (
      _full_and_gathered(params, full, gathered))
  assert logits.shape == (B, P, V)   # only P positions per row
  np.testing.assert_allclose(l_gat, l_full, rtol=1e-6)
  np.testing.assert_allclose(m_gat["accuracy"], m_full["accuracy"])
  assert m_gat["denominator"] == m_full["denominator"] == full["weights"].sum()
  chex.assert_trees_all_close(g_gat, g_full, rtol=1e-5, atol=1e-7)
  # The loss by hand: cross-entropy at the selected positions only.
  lp = jax.nn.log_softmax(logits, -1)
  tgt = np.take_along_axis(full["targets"], gathered["masked_positions"], 1)
  w = np.take_along_axis(full["weights"], gathered["masked_positions"], 1)
  ce = -np.take_along_axis(np.asarray(lp), tgt[..., None], -1)[..., 0]
  np.testing.assert_allclose(l_full, (ce * w).sum() / w.sum(), rtol=1e-5)


def test_train_and_eval_steps_use_the_gathered_head():
  """The library's steps: same update and same evaluation sums."""
  model = _model("fnet")
  full, gathered = _batch(packed=False, seed=1)
  tx = optax.sgd(0.5)

  @jax.jit
  def run(full, gathered):
    params = model.init(jax.random.key(1), full["inputs"])["params"]
    state = steps.TrainState.create(apply_fn=model.apply, params=params,
                                    tx=tx)
    step = steps.make_train_step(model, "mlm")
    evaluate = evaluation.make_eval_step(model, "mlm")
    return (step(state, full, jax.random.key(2)),
            step(state, gathered, jax.random.key(2)),
            evaluate(state, full), evaluate(state, gathered))

  (s_full, m_full), (s_gat, m_gat), e_full, e_gat = run(full, gathered)
  np.testing.assert_allclose(m_gat["loss"], m_full["loss"], rtol=1e-6)
  chex.assert_trees_all_close(s_gat.params, s_full.params, rtol=1e-5,
                              atol=1e-7)
  chex.assert_trees_all_close(e_gat, e_full, rtol=1e-5)


def test_fifteen_percent_rounding_fits_max_predictions():
  # bert_mask selects max(1, round(rate * n)) of an n-token example
  # (round half to even, as tf.round); every n <= seq_len fits.
  for rate in (0.15, 0.2, 0.1, 0.5):
    for seq_len in range(1, 300):
      slots = preprocessors.max_predictions(seq_len, rate)
      n = np.arange(1, seq_len + 1)
      selected = np.maximum(1, np.round(np.float32(rate) * n.astype(np.float32)))
      assert selected.max() <= slots <= seq_len, (rate, seq_len)
  assert preprocessors.max_predictions(128) == 20   # BERT's value
  assert preprocessors.max_predictions(20) == 3


def test_packed_row_keeps_its_first_predictions():
  """Six 3-token examples, all selected, packed into rows of 12 (P = 2)."""
  examples = [dict(inputs=np.full(3, 90 + i, np.int32),
                   targets=np.arange(3, dtype=np.int32) + 10 * i + 1,
                   weights=np.ones(3, np.int32)) for i in range(6)]
  ds = tf.data.Dataset.from_generator(
      lambda: iter(examples), output_signature={
          k: tf.TensorSpec([None], tf.int32)
          for k in ("inputs", "targets", "weights")})
  conv = converters.MLMFeatureConverter(pack=True, select_rate=0.15)
  lengths = dict(inputs=12, targets=12, weights=12)
  rows = list(conv(ds, lengths).as_numpy_iterator())
  slots = preprocessors.max_predictions(12, 0.15)
  assert slots == 2
  for row in rows:
    assert row["masked_positions"].shape == (slots,)
    kept = np.flatnonzero(row["weights"])
    real = np.flatnonzero(row["segment_ids"])
    np.testing.assert_array_equal(kept, real[:slots])   # the first ones
    np.testing.assert_array_equal(row["masked_positions"], real[:slots])
    dropped = real[slots:]
    # Selections beyond P are undone: original token, no weight.
    np.testing.assert_array_equal(row["inputs"][dropped],
                                  row["targets"][dropped])
    assert (row["inputs"][kept] != row["targets"][kept]).all()


def test_is_argmax_equals_argmax_with_ties_and_infinities():
  rng = np.random.RandomState(0)
  # Small integers: many rows with tied maxima, where the first one wins.
  logits = rng.randint(0, 4, (64, 9, 7)).astype(np.float32)
  logits[0, 0] = -np.inf                 # all -inf: argmax is 0
  logits[0, 1, 3:] = np.inf              # ties at +inf
  labels = rng.randint(0, 7, (64, 9)).astype(np.int32)
  labels[0, 0], labels[0, 1], labels[0, 2] = 0, 3, 6
  want = np.argmax(logits, -1) == labels
  got = np.asarray(jax.jit(heads.is_argmax)(logits, labels))
  np.testing.assert_array_equal(got, want)
  assert 0 < want.mean() < 1                  # both outcomes exercised
  # A tie where the label is the later maximum is not correct.
  row = np.array([[1.0, 5.0, 5.0]], np.float32)
  assert not heads.is_argmax(row, np.array([2]))[0]
  assert heads.is_argmax(row, np.array([1]))[0]
