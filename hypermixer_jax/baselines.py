"""Trivial baselines every experiment prints beside its models (NumPy only).

They see what the models see: the token ids of the library's pipelines (read
with ``experiment.pipeline_arrays``), the same splits and, for language
models, the same scored positions.

* ``naive_bayes``: multinomial Naive Bayes on bags of token ids (GLUE);
* ``majority``: the most frequent train label (GLUE);
* ``ridge_classifier``: a linear classifier fitted in closed form on
  feature vectors (images: the raw pixels), its ridge penalty picked on a
  held-out part of the train rows;
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


def _standardise(x: np.ndarray, mean: np.ndarray, scale: np.ndarray
                 ) -> np.ndarray:
  return (np.asarray(x, np.float64).reshape(len(x), -1) - mean) / scale


def ridge_classifier(train_x: np.ndarray, train_y: np.ndarray,
                     test_x: np.ndarray, *, l2s: tuple[float, ...] = tuple(
                         10.0 ** k for k in range(-1, 9)),
                     held_out: float = 0.1, num_classes: int | None = None
                     ) -> tuple[np.ndarray, dict]:
  """Predicted labels of ``test_x`` by a linear least-squares classifier.

  Rows of ``*_x`` are flattened to feature vectors and standardised with
  the train rows' per-feature mean and standard deviation. The weights
  minimise ``|X W + b - Y|^2 + l2 |W|^2`` with ``Y`` the one-hot train
  labels (the intercept ``b`` is not penalised), solved in closed form; the
  prediction is the arg-max column (ties: the lower class). ``l2`` is the
  one of ``l2s`` with the best accuracy on the last ``held_out`` fraction
  of the train rows when fitted on the others (the lower ``l2`` on ties);
  the final weights are fitted on all train rows with it. Returns the
  predictions and ``{'l2': l2, 'held_out_accuracy': {'<l2>': accuracy}}``.
  """
  train_y = np.asarray(train_y)
  if num_classes is None:
    num_classes = int(train_y.max()) + 1
  flat = np.asarray(train_x).reshape(len(train_x), -1)
  if not 0 < held_out < 1 or int(len(flat) * held_out) < 1:
    raise ValueError(f"held_out={held_out} must be a fraction in (0, 1) "
                     f"leaving at least one of the {len(flat)} train rows.")

  def fit(x, y):
    """``l2 -> predict``: one eigendecomposition of the smaller Gram matrix
    (``Z^T Z``, or ``Z Z^T`` with fewer rows than features) serves every
    l2, each then a matrix product."""
    mean, sd = x.mean(0), x.std(0)
    scale = np.where(sd > 0, sd, 1.0)
    z = _standardise(x, mean, scale)
    # Centred features and targets: the intercept is the targets' mean.
    targets = np.eye(num_classes)[y]
    offset = targets.mean(0)
    centred = targets - offset
    if len(z) < z.shape[1]:
      # W = Z^T (Z Z^T + l2 I)^-1 T, with Z Z^T = U S U^T.
      s, u = np.linalg.eigh(z @ z.T)
      left, right = z.T @ u, u.T @ centred
    else:
      # W = (Z^T Z + l2 I)^-1 Z^T T, with Z^T Z = U S U^T.
      s, u = np.linalg.eigh(z.T @ z)
      left, right = u, u.T @ (z.T @ centred)
    s = np.maximum(s, 0.0)  # a PSD matrix's round-off below zero

    def with_l2(l2):
      w = left @ (right / (s + l2)[:, None])
      return lambda q: np.argmax(_standardise(q, mean, scale) @ w + offset,
                                 axis=-1)
    return with_l2

  cut = len(flat) - int(len(flat) * held_out)
  on_part = fit(flat[:cut], train_y[:cut])
  scores = {l2: float(np.mean(on_part(l2)(flat[cut:]) == train_y[cut:]))
            for l2 in l2s}
  l2 = max(l2s, key=lambda v: (scores[v], -v))
  return fit(flat, train_y)(l2)(test_x), {
      "l2": l2, "held_out_accuracy": {f"{v:g}": a for v, a in scores.items()}}


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


# Every this-many-th train row is held out to choose the bigram's k.
K_HOLDOUT_EVERY = 10


def choose_bigram_k(train_rows: np.ndarray, *, vocab_size: int,
                    ks: tuple[float, ...]) -> float:
  """The k of ``ks`` whose add-k bigram has the lowest perplexity on every
  ``K_HOLDOUT_EVERY``-th row of ``train_rows`` ([rows, length]; each token
  given the one before it, pairs with padding left out), counted on the
  other rows: chosen on training data, never on the positions a baseline is
  reported on. Ties (or no pair to score) go to the first k."""
  rows = np.asarray(train_rows)
  held = np.arange(len(rows)) % K_HOLDOUT_EVERY == 0
  prev, tgt = rows[held][:, :-1], rows[held][:, 1:]
  pairs = (prev != PAD) & (tgt != PAD)
  if not pairs.any():
    return ks[0]
  table = {k: bigram_perplexity(rows[~held], prev[pairs], tgt[pairs],
                                vocab_size=vocab_size, k=k) for k in ks}
  return min(table, key=table.get)


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
  masked (a choice that favours the baseline). k: the best of ``ks`` on
  held-out train rows (``choose_bigram_k``). Returns ``unigram``, ``bigram``, ``bigram_k``,
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
  k = choose_bigram_k(train_tokens, vocab_size=vocab_size, ks=ks)
  out = {"unigram": uni, "bigram": bigram(k), "bigram_k": k,
         "scored_tokens": int(scored.sum())}
  if causal:
    out["row_starts"] = int(first.sum())
  return out
