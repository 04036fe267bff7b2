"""seqio preprocessors for the text tasks (tf.data, stateless randomness).

Random preprocessors take a ``seed`` from ``seqio.map_over_dataset(num_seeds=1)``;
seqio derives those per-example seeds from the seed given to
``Task.get_dataset``, so a pipeline built twice with one seed is identical.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import seqio
import tensorflow as tf

# Re-exported for the converters (it needs no TensorFlow: data.config).
from hypermixer_jax.data.config import max_predictions  # noqa: F401


def rekey(ds: tf.data.Dataset, key_map: Mapping[str, str]) -> tf.data.Dataset:
  """Renames features (new name -> old name); drops the others."""
  return seqio.preprocessors.rekey(ds, key_map=dict(key_map))


def drop_negative_labels(ds: tf.data.Dataset) -> tf.data.Dataset:
  """Drops examples without a gold label (SNLI '-', encoded -1 by TFDS)."""
  return ds.filter(lambda ex: ex["label"] >= 0)


def split_into_chunks(ds: tf.data.Dataset, sequence_length: Mapping[str, int],
                      key: str = "targets") -> tf.data.Dataset:
  """Cuts each tokenized document into rows of at most ``sequence_length[key]``.

  Long C4 documents give several full rows instead of one truncated row; only
  a document's last chunk is short (packing fills those rows).
  """
  length = sequence_length[key]

  # Plain graph code: no autograph conversion at each pipeline build (as for
  # every function this module maps).
  @tf.autograph.experimental.do_not_convert
  def chunk(ex):
    tokens = ex[key]
    starts = tf.range(0, tf.size(tokens), length)
    return {key: tf.RaggedTensor.from_row_starts(tokens, starts)}

  ds = ds.filter(lambda ex: tf.size(ex[key]) > 0)
  return ds.map(chunk, num_parallel_calls=tf.data.AUTOTUNE).unbatch()


def bert_mask(ex: Mapping[str, tf.Tensor], seed: tf.Tensor, *,
              mask_id: int, first_regular: int, num_regular: int,
              select_rate: float = 0.15, mask_token_rate: float = 0.8,
              random_token_rate: float = 0.1) -> dict[str, tf.Tensor]:
  """BERT masking of ``ex['targets']`` (one unpadded row of token ids).

  Selects ``max(1, round(select_rate * n))`` positions uniformly; of those,
  ``mask_token_rate`` become [MASK], ``random_token_rate`` a uniformly random
  regular token, the rest keep their token. ``weights`` is 1 on every
  selected position (the loss is taken on all of them, not only on [MASK]).

  Returns:
    {'inputs': masked ids, 'targets': original ids, 'weights': int32 0/1}.
  """
  targets = ex["targets"]
  n = tf.size(targets)
  seeds = tf.random.experimental.stateless_split(seed, 3)
  num_select = tf.maximum(
      1, tf.cast(tf.round(select_rate * tf.cast(n, tf.float32)), tf.int32))
  num_select = tf.minimum(num_select, n)
  scores = tf.random.stateless_uniform([n], seed=seeds[0])
  selected_idx = tf.math.top_k(scores, k=num_select, sorted=False).indices
  selected = tf.scatter_nd(selected_idx[:, None],
                           tf.ones([num_select], tf.bool), [n])
  action = tf.random.stateless_uniform([n], seed=seeds[1])
  to_mask = selected & (action < mask_token_rate)
  to_random = selected & (action >= mask_token_rate) & (
      action < mask_token_rate + random_token_rate)
  random_tokens = tf.random.stateless_uniform(
      [n], seed=seeds[2], minval=first_regular, maxval=num_regular,
      dtype=tf.int32)
  inputs = tf.where(to_mask, tf.cast(mask_id, targets.dtype),
                    tf.where(to_random, random_tokens, targets))
  return {"inputs": inputs, "targets": targets,
          "weights": tf.cast(selected, tf.int32)}


def for_host(seed: tf.Tensor, shard_index: int) -> tf.Tensor:
  """An example's stateless seed made the host's own: seqio draws it from
  the example's place in the host's stream and the pipeline's seed, which
  every host shares, so without this the k-th example of every host would
  get the same mask, crop or flip. Host 0 keeps seqio's seed (one host's
  stream is unchanged)."""
  if not shard_index:
    return seed
  return tf.random.experimental.stateless_fold_in(seed, shard_index)


def mask_tokens(ds: tf.data.Dataset, *, shard_index: int = 0,
                **kwargs) -> tf.data.Dataset:
  """``bert_mask`` over a dataset, one stateless seed per example (seqio);
  ``shard_index``: the host's (``for_host``: each host draws its own masks)."""
  @seqio.map_over_dataset(num_seeds=1)
  @tf.autograph.experimental.do_not_convert
  def fn(ex, seed):
    return bert_mask(ex, for_host(seed, shard_index), **kwargs)
  return fn(ds)


def truncate_pair(len_a: tf.Tensor, len_b: tf.Tensor, budget: int):
  """Longest-first truncation of a pair to ``budget`` tokens in all.

  Equivalent to BERT's loop that trims one token at a time from the longer
  sentence; returns the kept lengths.
  """
  keep_a = tf.minimum(len_a, tf.maximum(budget - len_b, (budget + 1) // 2))
  keep_b = tf.minimum(len_b, budget - keep_a)
  return keep_a, keep_b


def encode_pair(ds: tf.data.Dataset, sequence_length: Mapping[str, int],
                output_features: Mapping[str, seqio.Feature], *,
                cls_id: int, sep_id: int,
                keys: Sequence[str] = ("text_a", "text_b")) -> tf.data.Dataset:
  """[CLS] a [SEP] (b [SEP]) with token type ids 0 (a) / 1 (b), and a label.

  The sentence(s) are tokenized with the task's seqio vocabulary and trimmed
  longest-first so that the row fits ``sequence_length['inputs']``.
  """
  vocab = output_features["inputs"].vocabulary
  length = sequence_length["inputs"]
  pair = len(keys) == 2

  @tf.autograph.experimental.do_not_convert
  def fn(ex):
    a = tf.cast(vocab.encode_tf(ex[keys[0]]), tf.int32)
    cls = tf.constant([cls_id], tf.int32)
    sep = tf.constant([sep_id], tf.int32)
    if pair:
      b = tf.cast(vocab.encode_tf(ex[keys[1]]), tf.int32)
      keep_a, keep_b = truncate_pair(tf.size(a), tf.size(b), length - 3)
      a, b = a[:keep_a], b[:keep_b]
      inputs = tf.concat([cls, a, sep, b, sep], 0)
      types = tf.concat([tf.zeros([keep_a + 2], tf.int32),
                         tf.ones([keep_b + 1], tf.int32)], 0)
    else:
      a = a[:length - 2]
      inputs = tf.concat([cls, a, sep], 0)
      types = tf.zeros_like(inputs)
    return {"inputs": inputs, "token_type_ids": types,
            "label": tf.cast(ex["label"], tf.int32)}

  return ds.map(fn, num_parallel_calls=tf.data.AUTOTUNE)


def tokenize_text(ds: tf.data.Dataset,
                  output_features: Mapping[str, seqio.Feature],
                  append_eos: bool) -> tf.data.Dataset:
  """'text' -> 'targets' token ids, optionally ending with EOS (seqio)."""
  ds = rekey(ds, {"targets": "text"})
  ds = seqio.preprocessors.tokenize(ds, output_features,
                                    copy_pretokenized=False, with_eos=append_eos)
  return ds
