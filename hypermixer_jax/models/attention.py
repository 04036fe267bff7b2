"""Attention baselines: softmax self-attention and linear attention.

Softmax attention (Vaswani et al., 2017), per head h:
  q = x Wq_h, k = x Wk_h, v = x Wv_h              # [B, N, Dh] each
  A = softmax(q k^T / sqrt(Dh) + M)                # [B, N, N], M = -inf where masked
  y = concat_h(A v) Wo                             # [B, N, d]

Linear attention (Katharopoulos et al., 2020) with phi(x) = elu(x) + 1:
  y_i = phi(q_i)^T S / (phi(q_i)^T s + eps)        # [Dv] per head
  S = sum_j phi(k_j) v_j^T,  s = sum_j phi(k_j)    # [Dh, Dv], [Dh]
The sums run over the real keys of i's own segment (and j <= i when causal,
as prefix sums that restart at each segment start). Padded keys contribute
nothing: the public JAX reference ignores the padding mask, this one does not.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from hypermixer_jax.models import common

Array = common.Array


IMPLEMENTATIONS = ("xla", "cudnn", "blockwise")


def attention_weights(q: Array, k: Array, allowed: Array | None) -> Array:
  """Softmax attention probabilities in float32 (the explicit path).

  Args:
    q: ``[B, N, H, D]`` queries, already scaled.
    k: ``[B, M, H, D]`` keys.
    allowed: ``[B or 1, N, M]`` bool (may query i read key j) or None.

  Returns:
    ``[B, H, N, M]`` float32; rows with no allowed key are all zero (no NaN).
  """
  logits = jnp.einsum("bnhd,bmhd->bhnm", q, k).astype(jnp.float32)
  if allowed is None:
    return jax.nn.softmax(logits, axis=-1)
  allowed = allowed[:, None]                                  # [B, 1, N, M]
  # A finite fill keeps fully masked rows (and their gradients) NaN-free.
  logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.where(allowed, probs, 0.0)


def dot_product_attention(q: Array, k: Array, v: Array, *,
                          mask: Array | None = None,
                          segment_ids: Array | None = None,
                          causal: bool = False,
                          implementation: str | None = None,
                          block_size: int = 256,
                          dropout=None) -> Array:
  """softmax(q k^T / sqrt(D) + M) v per head, M masking disallowed pairs.

  Query i may read key j when j is a real token (``mask``), of i's segment
  (``segment_ids``, packed rows: a block-diagonal mask) and, if ``causal``,
  j <= i. A query with no allowed key gets a zero output.

  Args:
    q, k, v: ``[B, N, H, D]`` (unscaled queries).
    mask: ``[B, N]`` bool, True for real tokens (keys), or None.
    segment_ids: ``[B, N]`` int, or None.
    causal: only keys j <= i.
    implementation: None picks ``blockwise`` for CPU when N > block_size and
      the library's ``jax.nn.dot_product_attention`` otherwise; ``xla`` /
      ``cudnn`` are that function's implementations (cuDNN flash attention
      on GPU); ``blockwise`` is ``blockwise_attention``.
    block_size: query and key block of ``blockwise``.
    dropout: a function applied to the ``[B, H, N, N]`` probabilities
      (training-time attention dropout); it needs them materialised, so it
      takes the explicit path whatever ``implementation`` says.

  Returns:
    ``[B, N, H, D]`` in the dtype of ``v``.
  """
  if implementation not in (None,) + IMPLEMENTATIONS:
    raise ValueError(f"attention implementation={implementation!r}; expected "
                     f"None (automatic) or one of {IMPLEMENTATIONS}.")
  n, dh = q.shape[1], q.shape[-1]
  if dropout is not None:
    q = q * jnp.asarray(dh ** -0.5, q.dtype)
    allowed = common.pair_mask(mask, segment_ids, causal, n, n)
    probs = dropout(attention_weights(q, k, allowed))         # [B, H, N, N]
    return jnp.einsum("bhnm,bmhd->bnhd", probs.astype(v.dtype), v)
  if implementation is None:
    long = n > block_size and common.target_platform() == "cpu"
    implementation = "blockwise" if long else "xla"
  if implementation == "blockwise":
    return blockwise_attention(q, k, v, mask=mask, segment_ids=segment_ids,
                               causal=causal, block_size=block_size)
  if mask is None and segment_ids is None:
    # Causality alone is the library's is_causal (cuDNN skips the blocks).
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                        implementation=implementation)
  allowed = common.pair_mask(mask, segment_ids, causal, n, n)  # [B, N, N]
  y = jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None],
                                   implementation=implementation)
  # The library spreads a row with no allowed key evenly over all keys.
  return jnp.where(allowed.any(-1)[:, :, None, None], y, 0).astype(v.dtype)


def blockwise_attention(q: Array, k: Array, v: Array, *,
                        mask: Array | None = None,
                        segment_ids: Array | None = None,
                        causal: bool = False, block_size: int = 256
                        ) -> Array:
  """Softmax attention over [C, C] blocks with an online softmax.

  The [N, N] probabilities never exist: for each block of C queries a scan
  over key blocks carries the running maximum m, normaliser l and output
  (Milakov & Gimelshein 2018; Dao et al. 2022):
      m' = max(m, max_j s_j),  l' = l e^{m-m'} + sum_j e^{s_j-m'},
      o' = o e^{m-m'} + sum_j e^{s_j-m'} v_j,  y = o / l.
  On a CPU a block's logits stay in cache, where the library's XLA path
  writes and rereads [B, H, N, N] float32 several times
  (benchmarks/bench_attention.py measures both). Each scan step is
  rematerialised, so the backward pass stores only the carries. Causal key
  blocks past the query block are skipped. Logits, m, l and o are float32
  whatever the compute dtype. Same arguments as ``dot_product_attention``.
  """
  b, n, h, dh = q.shape
  c = max(1, min(block_size, n))
  pad = -n % c
  ok = jnp.ones((b, n), bool) if mask is None else mask
  if pad:  # padded keys are masked, padded queries dropped
    zeros = lambda t: jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0)))  # noqa: E731
    q, k, v = zeros(q), zeros(k), zeros(v)
    ok = jnp.pad(ok, ((0, 0), (0, pad)))
    if segment_ids is not None:
      segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
  nb = (n + pad) // c
  # [nb, B, H, C, D]: each block's matmuls read contiguous tiles.
  blocks = lambda t: t.reshape(b, nb, c, h, dh).transpose(1, 0, 3, 2, 4)  # noqa: E731
  q = q * jnp.asarray(dh ** -0.5, q.dtype)
  qb, kb, vb = blocks(q), blocks(k), blocks(v)
  okb = ok.reshape(b, nb, c).swapaxes(0, 1)                   # [nb, B, C]
  segb = None if segment_ids is None else \
      segment_ids.reshape(b, nb, c).swapaxes(0, 1)
  pos = jnp.arange(c)
  masked = mask is not None or segment_ids is not None or causal or pad > 0
  low = jnp.finfo(jnp.float32).min

  def query_block(xs):
    qi, i, seg_i = xs                                         # [B, H, C, D]

    def step(carry, ys):
      kj, vj, ok_j, seg_j, j = ys
      m, l, o = carry
      s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj,
                     preferred_element_type=jnp.float32)     # [B, H, C, C]
      if masked:
        allowed = ok_j[:, None, None, :]
        if seg_i is not None:
          allowed = allowed & (seg_i[:, None, :, None] ==
                               seg_j[:, None, None, :])
        if causal:
          allowed = allowed & (i * c + pos[:, None] >= j * c + pos[None, :])
        s = jnp.where(allowed, s, low)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      if masked:  # exact zeros, also where a row has seen no key yet
        p = jnp.where(allowed, p, 0.0)
      corr = jnp.exp(m - m_new)
      o = o * corr[..., None] + jnp.einsum(
          "bhqk,bhkd->bhqd", p.astype(vj.dtype), vj,
          preferred_element_type=jnp.float32)
      return (m_new, l * corr + p.sum(-1), o), None

    def maybe(carry, ys):
      if not causal:
        return step(carry, ys)
      # Key blocks after the query block hold no allowed key.
      return jax.lax.cond(ys[-1] > i, lambda: (carry, None),
                          lambda: step(carry, ys))

    init = (jnp.full((b, h, c), low), jnp.zeros((b, h, c)),
            jnp.zeros((b, h, c, dh)))
    (_, l, o), _ = jax.lax.scan(
        jax.checkpoint(maybe), init,
        (kb, vb, okb, segb, jnp.arange(nb)))
    return o / jnp.where(l > 0, l, 1.0)[..., None]           # [B, H, C, D]

  y = jax.lax.map(query_block, (qb, jnp.arange(nb), segb))   # [nb, B, H, C, D]
  y = y.transpose(1, 0, 3, 2, 4).reshape(b, nb * c, h, dh)
  return y[:, :n].astype(v.dtype)


def _head_dim(module: str, d: int, num_heads: int, head_dim: int | None) -> int:
  if head_dim is not None:
    return head_dim
  if d % num_heads:
    raise ValueError(
        f"{module}: num_heads={num_heads} does not divide the model width "
        f"d={d}; choose num_heads dividing d or set head_dim explicitly.")
  return d // num_heads


def _qkv(x: Array, num_heads: int, head_dim: int, dtype, param_dtype
         ) -> list[Array]:
  """Three ``[B, N, H, Dh]`` projections named query, key, value."""
  outs = []
  for name in ("query", "key", "value"):
    y = common.DenseGeneral(
        features=(num_heads, head_dim), in_axes=1,
        axes=(common.EMBED, common.HEADS, common.KV), dtype=dtype,
        param_dtype=param_dtype, name=name)(x)
    outs.append(common.constrain(
        y, (common.BATCH, common.LENGTH, common.HEADS, common.KV)))
  return outs


def _out_proj(y: Array, d: int, dtype, param_dtype) -> Array:
  y = common.DenseGeneral(
      features=(d,), in_axes=2, axes=(common.HEADS, common.KV, common.EMBED),
      dtype=dtype, param_dtype=param_dtype, name="out")(y)
  return common.constrain(y, (common.BATCH, common.LENGTH, common.EMBED))


class SelfAttention(nn.Module):
  """Multi-head softmax self-attention token mixer (``positions`` unused).

  ``implementation`` and ``block_size`` choose the attention computation
  (``dot_product_attention``: by default block-wise on CPU for rows longer
  than ``block_size``, ``jax.nn.dot_product_attention`` elsewhere; on CPU
  XLA's cost analysis then counts the block scan's body once, so a logged
  MFU under-counts long rows). ``dropout_rate`` drops attention
  probabilities in training, which materialises them (explicit path).
  """
  num_heads: int
  head_dim: int | None = None
  causal: bool = False
  dropout_rate: float = 0.0
  implementation: str | None = None
  block_size: int = 256
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @classmethod
  def model_defaults(cls, model) -> dict:
    """In a model (``models.registry``): heads of width 64."""
    return {"num_heads": max(1, model["d_model"] // 64)}

  @nn.compact
  def __call__(self, x, *, mask=None, segment_ids=None, positions=None,
               deterministic=True):
    common.check_width(x, None, "SelfAttention")
    b, n, d = x.shape
    dh = _head_dim("SelfAttention", d, self.num_heads, self.head_dim)
    mask = common.resolve_mask(x, mask, segment_ids)
    x = common.constrain(x, (common.BATCH, common.LENGTH, common.EMBED))
    q, k, v = _qkv(x, self.num_heads, dh, self.dtype, self.param_dtype)
    y = dot_product_attention(
        q, k, v, mask=mask, segment_ids=segment_ids, causal=self.causal,
        implementation=self.implementation, block_size=self.block_size,
        dropout=probability_dropout(self.dropout_rate, deterministic))
    return _out_proj(y, d, self.dtype, self.param_dtype)        # y: [B, N, H, Dh]


def probability_dropout(rate: float, deterministic: bool):
  """Dropout on attention probabilities, or None when it does nothing.

  Call it inside a module's compact method: the Dropout binds to that module.
  """
  if deterministic or not rate:
    return None
  return functools.partial(nn.Dropout(rate), deterministic=False)


def _segmented_cumsum(x: Array, starts: Array) -> Array:
  """Inclusive prefix sum over axis 1 that restarts where ``starts`` is True.

  ``x``: ``[B, N, ...]``; ``starts``: ``[B, N]`` bool.
  """
  flags = starts.reshape(starts.shape + (1,) * (x.ndim - 2))

  def combine(a, b):
    fa, va = a
    fb, vb = b
    return jnp.logical_or(fa, fb), jnp.where(fb, vb, va + vb)

  _, out = jax.lax.associative_scan(
      combine, (jnp.broadcast_to(flags, x.shape), x), axis=1)
  return out


LINEAR_IMPLEMENTATIONS = ("chunked", "outer")


def linear_attention(q: Array, k: Array, v: Array, *,
                     mask: Array | None = None,
                     segment_ids: Array | None = None,
                     causal: bool = False, packed: bool = True,
                     chunk_size: int | None = None,
                     implementation: str | None = None,
                     eps: float = 1e-6) -> Array:
  """y_i = q_i^T S_i / (q_i^T s_i + eps), S_i = sum_j k_j v_j^T, s_i = sum_j k_j.

  Key j counts for query i when j is real (``mask``), of i's segment
  (non-causal: an equal id; causal: the same run of equal ids, the prefix
  sums restarting at each change of id) and, if ``causal``, j <= i.

  Implementations (the same function up to summation order):

  * ``outer`` (the definition, kept as the reference): every position's
    outer product k_j v_j^T, ``[B, N, H, Dh, Dv]``, summed per segment
    (``jax.ops.segment_sum`` into B (N+1) buckets; ids must be at most N)
    or by (segmented) prefix sums, and read back at each query.
  * ``chunked`` (None): no per-position ``[Dh, Dv]`` buffer. Without segments
    (or ``packed=False``) and not causal, S = K^T V is one einsum,
    2 N Dh Dv multiply-adds per head. Otherwise the row is cut into chunks of
    C tokens: within a chunk the quadratic form
    ``((q k^T) * same_run [* j <= i]) v`` (N C (Dh + Dv) per head), and
    across chunks only the state [Dh, Dv] of the run that crosses each chunk
    boundary, carried forward (and, not causal, backward) by a scan over
    the chunks (about 4 N Dh Dv non-causal, 2 N Dh Dv causal). Non-causal
    rows with several chunks are first sorted by segment id (stable), so
    every segment is one run. The largest buffers are the chunks' scores
    ``[B, N/C, H, C, C]`` and states ``[B, N/C, H, Dh, Dv]``. The chunk
    length is ``chunk_size``, by default ``auto_chunk_size``.

  Args:
    q, k: ``[B, N, H, Dh]`` features (phi already applied; non-negative).
    v: ``[B, N, H, Dv]``.
    mask: ``[B, N]`` bool, True for real tokens (keys), or None.
    segment_ids: ``[B, N]`` int (0: padding), or None.
    causal: only keys j <= i.
    packed: False declares one example per row (segment ids only mark
      padding, id 0): the non-causal sums then run over the whole row in
      one einsum. A token whose id exceeds 1 gets NaN, so packed rows cannot
      pass silently.
    chunk_size: C, tokens per chunk of ``chunked`` (at most N); None:
      ``auto_chunk_size``.
    implementation: None (``chunked``) or one of ``LINEAR_IMPLEMENTATIONS``.
    eps: added to the denominator.

  Returns:
    ``[B, N, H, Dv]`` float32.
  """
  if implementation not in (None,) + LINEAR_IMPLEMENTATIONS:
    raise ValueError(
        f"linear attention implementation={implementation!r}; expected None "
        f"(chunked) or one of {LINEAR_IMPLEMENTATIONS}.")
  if chunk_size is not None and chunk_size < 1:
    raise ValueError(f"linear attention chunk_size={chunk_size} must be >= 1.")
  q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
  overflow = None
  if segment_ids is not None:
    real = segment_ids > 0
    mask = real if mask is None else mask & real
    if not packed:
      overflow = segment_ids > 1
  if mask is not None:
    k = jnp.where(mask[:, :, None, None], k, 0.0)
  if implementation == "outer":
    num, den = _outer_sums(q, k, v, segment_ids, causal)
  elif not causal and (segment_ids is None or not packed):
    state = jnp.einsum("bnhd,bnhe->bhde", k, v)               # [B, H, Dh, Dv]
    num = jnp.einsum("bnhd,bhde->bnhe", q, state)
    den = jnp.einsum("bnhd,bhd->bnh", q, k.sum(1))
    if segment_ids is not None:  # padding queries read no key (id 0's)
      num = jnp.where(real[..., None, None], num, 0.0)
      den = jnp.where(real[..., None], den, 0.0)
  else:
    num, den = _chunked_sums(q, k, v, segment_ids, causal, chunk_size)
  y = num / (den[..., None] + eps)
  if overflow is not None:
    y = jnp.where(overflow[..., None, None], jnp.nan, y)
  return y


def auto_chunk_size(n: int, dh: int, dv: int, causal: bool,
                    chunk: int = 64) -> int:
  """N (one chunk: the quadratic form) or ``chunk``, whichever needs fewer
  multiply-adds per token and head.

  One chunk costs N (Dh + Dv); chunks of C cost C (Dh + Dv) for the
  quadratic form inside each chunk plus m Dh Dv for the carried states
  (m = 2 causal: one state per chunk and its read; m = 4 non-causal: the
  same forward and backward). So one chunk while N < C + m Dh Dv / (Dh + Dv)
  (Dh = Dv = 64, C = 64: N < 192 non-causal, N < 128 causal). A smaller C
  needs fewer multiply-adds but runs smaller matmuls; on a CPU core C = 64
  was the fastest of 32 / 64 / 128 / 256 at N = 512 in a one-off sweep (not
  recorded: a default to measure again on other hardware).
  """
  m = 2 if causal else 4
  return n if n < chunk + m * dh * dv / (dh + dv) else chunk


def _outer_sums(q, k, v, segment_ids, causal):
  """``linear_attention``'s numerator and denominator, ``outer`` form."""
  b, n = q.shape[:2]
  kv = jnp.einsum("bnhd,bnhe->bnhde", k, v)                   # [B, N, H, Dh, Dv]
  if causal:
    if segment_ids is None:
      kv, ks = jnp.cumsum(kv, axis=1), jnp.cumsum(k, axis=1)
    else:
      starts = _run_starts(segment_ids)
      kv = _segmented_cumsum(kv, starts)
      ks = _segmented_cumsum(k, starts)
  elif segment_ids is None:
    kv, ks = kv.sum(1, keepdims=True), k.sum(1, keepdims=True)
  else:
    # One bucket per (row, segment id): ids are unique across rows.
    ids = (segment_ids + (n + 1) * jnp.arange(b)[:, None]).reshape(-1)
    sums = [jax.ops.segment_sum(t.reshape((b * n,) + t.shape[2:]), ids,
                                num_segments=b * (n + 1))[ids]
            for t in (kv, k)]
    kv, ks = [t.reshape((b, n) + t.shape[1:]) for t in sums]
  num = jnp.einsum("bnhd,bnhde->bnhe", q, kv)                 # [B, N, H, Dv]
  den = jnp.einsum("bnhd,bnhd->bnh", q, jnp.broadcast_to(ks, q.shape))
  return num, den


def _run_starts(segment_ids: Array) -> Array:
  """``[B, N]`` bool: True where a run of equal ids begins."""
  return jnp.concatenate(
      [jnp.ones_like(segment_ids[:, :1], bool),
       segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def _chunked_sums(q, k, v, segment_ids, causal, chunk_size):
  """``linear_attention``'s numerator and denominator, ``chunked`` form."""
  b, n, h, dh = q.shape
  dv = v.shape[-1]
  if segment_ids is None:
    runs = jnp.zeros((b, n), jnp.int32)
  elif causal:
    runs = jnp.cumsum(_run_starts(segment_ids), axis=1)
  else:
    runs = segment_ids
  c = min(n, chunk_size or auto_chunk_size(n, dh, dv, causal))
  unsort = None
  if c < n and not causal and segment_ids is not None:
    # Each segment one contiguous run, so that only the runs crossing a
    # chunk boundary need carried states.
    order = jnp.argsort(runs, axis=1, stable=True)
    unsort = jnp.argsort(order, axis=1)
    take = lambda t: jnp.take_along_axis(  # noqa: E731
        t, order.reshape(order.shape + (1,) * (t.ndim - 2)), axis=1)
    q, k, v, runs = take(q), take(k), take(v), take(runs)
  pad = -n % c
  if pad:  # padded keys are zero, padded queries dropped
    zeros = lambda t: jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0)))  # noqa: E731
    q, k, v = zeros(q), zeros(k), zeros(v)
    runs = jnp.pad(runs, ((0, 0), (0, pad)), mode="edge")
  nc = (n + pad) // c
  qc, kc, vc = (t.reshape(b, nc, c, h, t.shape[-1]) for t in (q, k, v))
  rc = runs.reshape(b, nc, c)                                 # [B, nc, C]
  allowed = rc[..., :, None] == rc[..., None, :]              # [B, nc, C, C]
  if causal:
    allowed = allowed & jnp.tril(jnp.ones((c, c), bool))
  a = jnp.einsum("bcihd,bcjhd->bchij", qc, kc)                # [B, nc, H, C, C]
  a = jnp.where(allowed[:, :, None], a, 0.0)
  num = jnp.einsum("bchij,bcjhe->bcihe", a, vc)               # [B, nc, C, H, Dv]
  den = a.sum(-1).transpose(0, 1, 3, 2)                       # [B, nc, C, H]
  if nc > 1:
    first, last = rc[..., 0], rc[..., -1]                     # [B, nc]

    def run_state(which):
      """State [B, nc, H, Dh, Dv] and sum [B, nc, H, Dh] of each chunk's
      tokens in run ``which`` (its first or last)."""
      kw = jnp.where((rc == which[..., None])[..., None, None], kc, 0.0)
      return (jnp.einsum("bcjhd,bcjhe->bchde", kw, vc), kw.sum(2))

    def read(states, run, valid):
      """Adds a neighbour's carried run state to the queries of that run."""
      use = (rc == run[..., None]) & valid[None, :, None]     # [B, nc, C]
      qu = jnp.where(use[..., None, None], qc, 0.0)
      return (jnp.einsum("bcihd,bchde->bcihe", qu, states[0]),
              jnp.einsum("bcihd,bchd->bcih", qu, states[1]))

    shift = lambda t, s: jnp.roll(t, s, axis=1)  # noqa: E731
    idx = jnp.arange(nc)
    # fwd[c]: the state of run last[c] over its tokens up to chunk c's end.
    restart = jnp.concatenate([jnp.ones((b, 1), bool),
                               last[:, 1:] != last[:, :-1]], axis=1)
    fwd = _carry(run_state(last), restart)
    n1, d1 = read([shift(t, 1) for t in fwd], shift(last, 1), idx > 0)
    num, den = num + n1, den + d1
    if not causal:
      # bwd[c]: the state of run first[c] over its tokens from chunk c on.
      restart = jnp.concatenate([first[:, :-1] != first[:, 1:],
                                 jnp.ones((b, 1), bool)], axis=1)
      bwd = _carry(run_state(first), restart, reverse=True)
      n2, d2 = read([shift(t, -1) for t in bwd], shift(first, -1),
                    idx < nc - 1)
      num, den = num + n2, den + d2
  num = num.reshape(b, nc * c, h, dv)[:, :n]
  den = den.reshape(b, nc * c, h)[:, :n]
  if unsort is not None:
    num = jnp.take_along_axis(num, unsort[..., None, None], axis=1)
    den = jnp.take_along_axis(den, unsort[..., None], axis=1)
  return num, den


def _carry(states, restart, reverse=False):
  """Sums of ``states`` (arrays ``[B, nc, ...]``) over chunks, restarting
  where ``restart [B, nc]`` is True: chunk by chunk, forward or (``reverse``)
  backward; a ``lax.scan``, so one step's arrays at a time."""
  def step(acc, xs):
    *x, r = xs
    acc = [jnp.where(r.reshape(r.shape + (1,) * (t.ndim - 1)), t, a + t)
           for a, t in zip(acc, x)]
    return acc, acc

  xs = [jnp.moveaxis(t, 1, 0) for t in (*states, restart)]
  _, out = jax.lax.scan(step, [jnp.zeros_like(t[0]) for t in xs[:-1]], xs,
                        reverse=reverse)
  return [jnp.moveaxis(t, 0, 1) for t in out]


class LinearAttention(nn.Module):
  """Linear (kernelised) attention token mixer, phi(x) = elu(x) + 1.

  The sums are accumulated in float32 whatever ``dtype`` is.
  ``linear_attention`` computes them: ``implementation`` None (the chunked
  form, no per-position ``[Dh, Dv]`` buffer) or ``outer`` (the reference,
  which materialises ``[B, N, H, Dh, Dv]`` and needs segment ids at most N),
  ``chunk_size`` its chunk length (None: ``auto_chunk_size``);
  ``packed=False`` declares rows of one
  example each (segment ids only mark padding), so that the non-causal sums
  are one einsum over each row (a segment id above 1 gives NaN outputs).
  """
  num_heads: int
  head_dim: int | None = None
  causal: bool = False
  eps: float = 1e-6
  packed: bool = True
  chunk_size: int | None = None
  implementation: str | None = None
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32
  # On rows of one example each the non-causal sums are one einsum a row.
  unpacked_kwargs = {"packed": False}

  model_defaults = SelfAttention.model_defaults

  @nn.compact
  def __call__(self, x, *, mask=None, segment_ids=None, positions=None,
               deterministic=True):
    common.check_width(x, None, "LinearAttention")
    b, n, d = x.shape
    dh = _head_dim("LinearAttention", d, self.num_heads, self.head_dim)
    mask = common.resolve_mask(x, mask, segment_ids)
    x = common.constrain(x, (common.BATCH, common.LENGTH, common.EMBED))
    q, k, v = _qkv(x, self.num_heads, dh, self.dtype, self.param_dtype)
    q = jax.nn.elu(q.astype(jnp.float32)) + 1.0               # [B, N, H, Dh]
    k = jax.nn.elu(k.astype(jnp.float32)) + 1.0
    y = linear_attention(
        q, k, v, mask=mask, segment_ids=segment_ids, causal=self.causal,
        packed=self.packed, chunk_size=self.chunk_size,
        implementation=self.implementation, eps=self.eps)
    return _out_proj(y.astype(self.dtype), d, self.dtype, self.param_dtype)
