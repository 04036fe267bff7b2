"""seqio FeatureConverters from task features to the batch formats of
CONTRIBUTING.md (``inputs``, ``targets``, ``weights``, ``segment_ids``,
``positions``, ``token_type_ids``, ``label``).

``segment_ids`` is always present for text: 1..K for the K examples packed in
a row (1 without packing), 0 on padding. ``positions`` restart at 0 in every
segment.
"""
from __future__ import annotations

from typing import Mapping

import seqio
import tensorflow as tf

from hypermixer_jax.data import preprocessors

Spec = seqio.FeatureConverter.FeatureSpec


def _unpacked_segments(ex: Mapping[str, tf.Tensor], key: str) -> dict:
  """segment_ids / positions of an unpacked, right-padded row."""
  real = tf.cast(tf.not_equal(ex[key], 0), tf.int32)
  # A row is one example followed by padding, so the real tokens are a prefix.
  length = tf.reduce_sum(real)
  n = tf.size(ex[key])
  segment_ids = tf.cast(tf.range(n) < length, tf.int32)
  return {"segment_ids": segment_ids,
          "positions": tf.range(n, dtype=tf.int32) * segment_ids}


class _Converter(seqio.FeatureConverter):
  """A FeatureConverter whose output lengths are checked once, when the
  dataset is built, instead of for every row.

  seqio checks each row's feature lengths with assertions in two maps around
  the conversion (input <= task length, output == model length). Here the
  task's last step already trims every feature to its task length, and the
  padding or packing gives every output feature its model length as a
  static shape, so the per-row checks only cost time (SST-2: ~20 of ~120
  CPU-us per example in a one-off run, docs/performance.md, Input pipelines).
  The static
  shapes of the converted dataset are checked instead; a converter built
  with ``apply_length_check=True`` keeps seqio's per-row checks as well.
  """

  def __init__(self, pack: bool, **kwargs):
    kwargs.setdefault("apply_length_check", False)
    super().__init__(pack=pack, **kwargs)

  def __call__(self, ds: tf.data.Dataset,
               task_feature_lengths: Mapping[str, int]) -> tf.data.Dataset:
    convert = super().__call__
    if not self.pack:
      # Plain graph code without autograph (seqio's packing loop needs it).
      convert = tf.autograph.experimental.do_not_convert(convert)
    ds = convert(ds, task_feature_lengths)
    lengths = self.get_model_feature_lengths(task_feature_lengths)
    for k, spec in ds.element_spec.items():
      if k not in lengths:  # a passthrough feature
        continue
      want = [lengths[k]] if self.MODEL_FEATURES[k].rank == 1 else []
      if spec.shape.as_list() != want:
        raise ValueError(
            f"{type(self).__name__}: feature {k!r} has shape "
            f"{spec.shape.as_list()} after conversion, expected {want} "
            f"(task feature lengths {dict(task_feature_lengths)}).")
    return ds


class _TokenLMConverter(_Converter):
  """Shared output side of the two LM converters: one length for every key."""

  MODEL_FEATURES = {"inputs": Spec(dtype=tf.int32),
                    "targets": Spec(dtype=tf.int32),
                    "weights": Spec(dtype=tf.float32),
                    "segment_ids": Spec(dtype=tf.int32),
                    "positions": Spec(dtype=tf.int32)}
  PACKING_FEATURE_DTYPES = {}

  def _with_segments(self, out: dict, ex: Mapping[str, tf.Tensor],
                     prefix: str, tokens_key: str) -> dict:
    """Adds segment_ids/positions: seqio's packed ones, or a padded row's."""
    if self.pack:
      out["segment_ids"] = ex[f"{prefix}_segment_ids"]
      out["positions"] = ex[f"{prefix}_positions"]
    else:
      out.update(_unpacked_segments(ex, tokens_key))
    return out

  def get_model_feature_lengths(self, task_feature_lengths):
    n = task_feature_lengths["targets"]
    return {k: n for k in self.MODEL_FEATURES}


class MLMFeatureConverter(_TokenLMConverter):
  """Masked LM: loss weights on *all* selected positions, and the positions.

  seqio's ``EncoderFeatureConverter`` derives the loss weights from
  ``inputs == mask_id``, which forgets the 10% of selected tokens replaced by a
  random token and the 10% kept unchanged. Here the task provides ``weights``
  (1 on every selected position, see ``preprocessors.bert_mask``) and the
  converter packs or pads them together with the tokens.

  ``masked_positions [P]`` (BERT's ``masked_lm_positions``, P =
  ``preprocessors.max_predictions(length, select_rate)``): the selected
  positions of the row in order, then unselected ones (weight 0), so that the
  model computes MLM logits at P positions instead of all of them. A packed
  row whose examples selected more than P tokens keeps its first P: the others
  get their original token back and weight 0, so every perturbed token still
  carries loss.
  """

  TASK_FEATURES = {"inputs": Spec(dtype=tf.int32),
                   "targets": Spec(dtype=tf.int32),
                   "weights": Spec(dtype=tf.int32)}
  MODEL_FEATURES = {**_TokenLMConverter.MODEL_FEATURES,
                    "masked_positions": Spec(dtype=tf.int32)}

  def __init__(self, pack: bool = True, select_rate: float = 0.15, **kwargs):
    super().__init__(pack=pack, **kwargs)
    self._select_rate = select_rate

  def _convert_features(self, ds, task_feature_lengths):
    # seqio's packer measures each feature by its count of non-zero entries,
    # so 0/1 weights travel as 1/2 and are shifted back after packing.
    ds = ds.map(tf.autograph.experimental.do_not_convert(
        lambda ex: {**ex, "weights": ex["weights"] + 1}),
                num_parallel_calls=tf.data.AUTOTUNE)
    ds = self._pack_or_pad(ds, task_feature_lengths)
    slots = self.get_model_feature_lengths(
        task_feature_lengths)["masked_positions"]

    @tf.autograph.experimental.do_not_convert
    def convert(ex):
      selected = tf.maximum(ex["weights"] - 1, 0)
      keep = selected * tf.cast(tf.cumsum(selected) <= slots, tf.int32)
      inputs = tf.where(selected > keep, ex["targets"], ex["inputs"])
      n = tf.size(keep)
      # Kept positions score n - i > 0, the others -i <= 0: top_k orders the
      # kept ones first, each group by position.
      positions = tf.math.top_k(keep * n - tf.range(n), k=slots).indices
      out = {"inputs": inputs, "targets": ex["targets"],
             "weights": tf.cast(keep, tf.float32),
             "masked_positions": tf.cast(positions, tf.int32)}
      return self._with_segments(out, ex, "targets", "targets")

    return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)

  def get_model_feature_lengths(self, task_feature_lengths):
    lengths = super().get_model_feature_lengths(task_feature_lengths)
    lengths["masked_positions"] = preprocessors.max_predictions(
        task_feature_lengths["targets"], self._select_rate)
    return lengths


class CausalLMFeatureConverter(_TokenLMConverter):
  """Causal LM on top of seqio's ``LMFeatureConverter``, renamed to our keys.

  ``inputs`` are the targets shifted right (BOS = 0 at the start of every
  segment), ``targets`` the next tokens, ``weights`` 1 on real tokens.
  """

  TASK_FEATURES = {"targets": Spec(dtype=tf.int32)}

  def _convert_features(self, ds, task_feature_lengths):
    ds = seqio.LMFeatureConverter(
        pack=self.pack, apply_length_check=self._apply_length_check)(
            ds, task_feature_lengths)

    @tf.autograph.experimental.do_not_convert
    def convert(ex):
      return self._with_segments(
          {"inputs": ex["decoder_input_tokens"],
           "targets": ex["decoder_target_tokens"],
           "weights": tf.cast(ex["decoder_loss_weights"], tf.float32)},
          ex, "decoder", "decoder_target_tokens")

    return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)


class ClassificationFeatureConverter(_Converter):
  """GLUE: padded ``inputs``/``token_type_ids``, ``segment_ids``, ``label``.

  Not packable: one label per row.
  """

  TASK_FEATURES = {"inputs": Spec(dtype=tf.int32),
                   "token_type_ids": Spec(dtype=tf.int32),
                   "label": Spec(dtype=tf.int32, rank=0)}
  MODEL_FEATURES = {"inputs": Spec(dtype=tf.int32),
                    "token_type_ids": Spec(dtype=tf.int32),
                    "segment_ids": Spec(dtype=tf.int32),
                    "label": Spec(dtype=tf.int32, rank=0)}
  PACKING_FEATURE_DTYPES = {}

  def __init__(self, pack: bool = False, **kwargs):
    if pack:
      raise ValueError("Packing is not supported for classification tasks "
                       "(one label per row); set data.packing=False.")
    super().__init__(pack=False, **kwargs)

  def _convert_features(self, ds, task_feature_lengths):
    lengths = {k: v for k, v in task_feature_lengths.items() if k != "label"}
    ds = self._pack_or_pad(ds, lengths)

    @tf.autograph.experimental.do_not_convert
    def convert(ex):
      return {"inputs": ex["inputs"], "token_type_ids": ex["token_type_ids"],
              "segment_ids": _unpacked_segments(ex, "inputs")["segment_ids"],
              "label": ex["label"]}

    return ds.map(convert, num_parallel_calls=tf.data.AUTOTUNE)

  def get_model_feature_lengths(self, task_feature_lengths):
    n = task_feature_lengths["inputs"]
    return {"inputs": n, "token_type_ids": n, "segment_ids": n, "label": 0}
