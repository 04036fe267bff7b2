"""Trivial baselines every experiment prints beside its models (NumPy only).

They see what the models see: the token ids of the library's pipelines (read
with ``experiment.pipeline_arrays``), the same splits and, for language
models, the same scored positions.

* ``naive_bayes``: multinomial Naive Bayes on bags of token ids (GLUE);
* ``majority``: the most frequent train label (GLUE);
* ``unigram_perplexity`` / ``bigram_perplexity``: add-k smoothed counts of
  the train tokens, scored on the held-out positions the language models are
  scored on (for MLM: the masked positions); ``lm_baselines`` both on the
  scored positions of a pipeline's arrays (causal or masked LM).

Token id 0 is padding everywhere (T5's SentencePiece convention) and never
counted.
"""
from __future__ import annotations

import numpy as np

PAD = 0


def _bag_counts(tokens: np.ndarray, labels: np.ndarray, num_classes: int,
                vocab_size: int) -> np.ndarray:
  """``[num_classes, vocab_size]`` token counts per class (padding left out)."""
  tokens = np.asarray(tokens)
  labels = np.asarray(labels)
  rows = np.broadcast_to(labels[:, None], tokens.shape)
  keep = tokens != PAD
  counts = np.zeros((num_classes, vocab_size), np.float64)
  np.add.at(counts, (rows[keep], tokens[keep]), 1.0)
  return counts


def naive_bayes(train_tokens: np.ndarray, train_labels: np.ndarray,
                test_tokens: np.ndarray, *, vocab_size: int,
                num_classes: int | None = None, alpha: float = 1.0
                ) -> np.ndarray:
  """Predicted labels of a multinomial Naive Bayes classifier.

  Each row of ``*_tokens`` ([rows, length] token ids, 0 = padding) is a bag
  of its tokens; P(token | class) is estimated with add-``alpha`` (Laplace)
  smoothing over the vocabulary, the class prior from the train labels.
  Ties go to the lower class id.
  """
  train_labels = np.asarray(train_labels)
  if num_classes is None:
    num_classes = int(train_labels.max()) + 1
  counts = _bag_counts(train_tokens, train_labels, num_classes, vocab_size)
  log_p = np.log(counts + alpha) - np.log(
      counts.sum(1, keepdims=True) + alpha * vocab_size)
  prior = np.log(np.bincount(train_labels, minlength=num_classes)
                 / len(train_labels))
  test_tokens = np.asarray(test_tokens)
  mask = (test_tokens != PAD)[..., None]
  scores = (log_p.T[test_tokens] * mask).sum(1) + prior
  return np.argmax(scores, axis=-1)


def majority(train_labels: np.ndarray, num_test: int) -> np.ndarray:
  """The most frequent train label, ``num_test`` times."""
  return np.full(num_test, np.bincount(np.asarray(train_labels)).argmax())


def _add_k(counts: np.ndarray, k: float) -> np.ndarray:
  """Log-probabilities of add-``k`` smoothed ``counts`` along the last axis."""
  return np.log(counts + k) - np.log(
      counts.sum(-1, keepdims=True) + k * counts.shape[-1])


def unigram_perplexity(train_tokens: np.ndarray, targets: np.ndarray, *,
                       vocab_size: int, k: float = 1.0) -> float:
  """exp of the mean negative log-probability of ``targets`` under add-``k``
  smoothed unigram frequencies of ``train_tokens`` (padding left out)."""
  train_tokens = np.asarray(train_tokens).ravel()
  counts = np.bincount(train_tokens[train_tokens != PAD],
                       minlength=vocab_size).astype(np.float64)
  log_p = _add_k(counts, k)
  return float(np.exp(-log_p[np.asarray(targets).ravel()].mean()))


def bigram_perplexity(train_rows: np.ndarray, previous: np.ndarray,
                      targets: np.ndarray, *, vocab_size: int,
                      k: float = 0.01) -> float:
  """Perplexity of ``targets`` given the token before each
  (``previous``, the same shape) under add-``k`` smoothed bigram counts of
  the train rows ([rows, length]; pairs with padding left out).

  Counts are kept per previous token as a sparse table, so the vocabulary
  may be large.
  """
  train_rows = np.asarray(train_rows)
  a, b = train_rows[:, :-1].ravel(), train_rows[:, 1:].ravel()
  keep = (a != PAD) & (b != PAD)
  pair = a[keep].astype(np.int64) * vocab_size + b[keep]
  uniq, counts = np.unique(pair, return_counts=True)
  totals = np.bincount(a[keep], minlength=vocab_size).astype(np.float64)
  query = (np.asarray(previous).ravel().astype(np.int64) * vocab_size
           + np.asarray(targets).ravel())
  where = np.clip(np.searchsorted(uniq, query), 0, max(len(uniq) - 1, 0))
  found = (uniq[where] == query) if len(uniq) else np.zeros(len(query), bool)
  c = np.where(found, counts[where] if len(uniq) else 0, 0).astype(np.float64)
  prev_total = totals[np.asarray(previous).ravel()]
  log_p = np.log(c + k) - np.log(prev_total + k * vocab_size)
  return float(np.exp(-log_p.mean()))


def lm_baselines(train_tokens: np.ndarray, arrays: dict[str, np.ndarray], *,
                 vocab_size: int, causal: bool,
                 ks: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0)) -> dict:
  """Unigram and add-k bigram perplexity of the scored targets of ``arrays``
  (a pipeline's ``targets`` and ``weights``; scored: weight > 0), counted on
  ``train_tokens`` ([rows, N]).

  The bigram reads the token before each target. ``causal``: the target's
  input (``arrays['inputs']``), and the first target of a row (input BOS =
  PAD, which the counts never hold) is scored by the add-1 unigram; else
  (masked LM) the true previous token of the row, which the model may see
  masked. k: the best of ``ks`` on these positions. Both choices favour the
  baseline. Returns ``unigram``, ``bigram``, ``bigram_k``,
  ``scored_tokens`` and (``causal``) ``row_starts``, the targets read after
  BOS.
  """
  scored = arrays["weights"] > 0
  targets = arrays["targets"][scored]
  if causal:
    previous = arrays["inputs"][scored]
  else:
    previous = np.pad(arrays["targets"], ((0, 0), (1, 0)))[:, :-1][scored]
  uni = unigram_perplexity(train_tokens, targets, vocab_size=vocab_size,
                           k=1.0)
  first = previous == PAD
  uni_first = unigram_perplexity(
      train_tokens, targets[first], vocab_size=vocab_size, k=1.0) \
      if causal and first.any() else 1.0

  def bigram(k):
    if not causal:
      return bigram_perplexity(train_tokens, previous, targets,
                               vocab_size=vocab_size, k=k)
    rest = bigram_perplexity(train_tokens, previous[~first], targets[~first],
                             vocab_size=vocab_size, k=k)
    return float(np.exp((first.sum() * np.log(uni_first)
                         + (~first).sum() * np.log(rest)) / len(targets)))
  table = {k: bigram(k) for k in ks}
  k = min(table, key=table.get)
  out = {"unigram": uni, "bigram": table[k], "bigram_k": k,
         "scored_tokens": int(scored.sum())}
  if causal:
    out["row_starts"] = int(first.sum())
  return out
