"""HyperMixing (Mai et al., ACL 2023, Algorithm 1).

An MLP-Mixer token-mixing MLP whose weights are generated per token by
hypernetworks, so it takes any length, is position invariant up to the added
position embeddings p, and costs O(N d d'):

    W1 = MLP_in(keys + p)            # [B, N, d']  MLP([d, hidden, d']), GELU
    W2 = MLP_out(queries + p)        # [B, M, d']
    out_i = W2 · GELU(W1^T · v_i)    # per feature i: v_i [N] -> [d'] -> [M]
    y = LayerNorm(out)               # [B, M, d]  (optional)

p only enters the hypernetworks, never the values. Tied: W2 = W1 (one
hypernetwork; the paper's main model, §2.3, untied its ablation; with
self-mixing it runs once). The class defaults to untied (``tied=False``);
the zoo's ``glue_hypermixer`` and the causal LM study set ``tied=True``.
Multi-head: d is split into H heads of width d/H, each with its own TM-MLP;
the hypernetworks read the whole token and emit H * d' per token
(``head_slices``: head h's own hypernetwork reads only its slice).

Differences from the paper and its official (PyTorch) implementation, each
but the LayerNorm epsilon a flag so the official behaviour is one setting
away:
* hypernetwork biases: ours have them (``hyper_bias``); the official code has
  none and the paper does not say. With ``hyper_bias=False``,
  ``input_scale=True`` and ``position_offset=1`` a single-head layer
  computes the official function up to the LayerNorm epsilon.
* input scale: the official code multiplies the hypernetworks' input by
  sqrt(d) before adding sinusoids (``input_scale``). Ours is off: in our
  pre-LN blocks that input is LayerNorm-ed (unit variance per feature, like
  the sinusoids), and a factor sqrt(d) would shrink the position signal to
  1/sqrt(d) of the token signal.
* positions: counted from 0 here, from 1 in the official code
  (``position_offset``); only the hypernetworks see them, as in Algorithm 1,
  so the zoo's HyperMixer models add no positions to the residual stream.
* LayerNorm eps: 1e-6 (the codebase's, not configurable), 1e-5 in the
  official code.
* causal mixing and packed segments go beyond the paper (below).

Padding: rows of W1 (keys) and W2 (queries) of padded tokens are zero, so a
padded batch gives exactly the unpadded outputs; padded output rows are zero.
Packed rows (``segment_ids``): each segment has its own TM-MLP hidden layer
(``max_segments`` slots) and its own ``positions``.
Causal (beyond the paper, which lists it as open): the hidden layer of query m
is the prefix sum over keys n <= m of the same segment run,
    out_m = W2_m · GELU(S_m),   S_m = sum_{n<=m} W1_n v_n^T   # S_m: [d, d']
computed by a scan over chunks of C tokens (``causal_chunk_size``): a chunk's
states are the carried state plus a masked in-chunk prefix sum (one
[C, C] x [C, d d'] product), so memory holds one chunk's [B, C, d, d'] states
instead of all N of them, and training keeps only the chunk-boundary states,
[B, N/C, d, d'] = O(B N d d'/C): its backward pass is written by hand (a
reverse scan that recomputes each chunk's states from its boundary state),
so the causal mixing has reverse-mode derivatives only (``jax.grad``,
``jax.jacrev``; ``jax.jvp`` / ``jax.jacfwd`` raise).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from hypermixer_jax.models import common
from hypermixer_jax.models.mlp_mixer import segment_one_hot, token_mixing_mlp

Array = jax.Array
POSITIONS = ("sinusoidal", "learned", "none")


def _rows(t: Array) -> Array:
  """``[..., w] -> [tokens, w]``."""
  return t.reshape(-1, t.shape[-1])


def _weight_grad(x: Array, g: Array) -> Array:
  """``sum_tokens x^T g``: ``[..., i], [..., o] -> [i, o]``.

  One 2-D product over the flattened tokens: contracted over (B, N) in 3-D,
  XLA:CPU wrote a transposed copy of ``x`` to feed its YNNPACK dot; in 2-D
  it runs its own transposed-operand GEMM, as fast, without the copy.
  """
  return jax.lax.dot_general(_rows(x), _rows(g), (((0,), (0,)), ((), ())))


@jax.custom_vjp
def hyper_mlp(x: Array, k1: Array, b1: Array | None, k2: Array,
              b2: Array | None) -> Array:
  """``GELU(x k1 + b1) k2 + b2`` per token, with a hand-written backward.

  ``x [..., d]``, ``k1 [d, hidden]``, ``k2 [hidden, F]``, biases optional
  (None). The same function and derivatives as autodiff of the formula; the
  backward keeps the hidden layer's pre-activation and activation from the
  forward, evaluates GELU's derivative in one pass (``jax.jvp`` of
  ``common.gelu``) and computes the weight gradients as 2-D products over
  the flattened tokens (``_weight_grad``). Autodiff's version made XLA:CPU
  write transposed copies of the token-major activations and store
  GELU's intermediate values (docs/performance.md, Attention and HyperMixing
  against PyTorch, and its record experiments/results/hypermixing_official).
  """
  return _hyper_mlp_fwd(x, k1, b1, k2, b2)[0]


def _hyper_mlp_fwd(x, k1, b1, k2, b2):
  h = x @ k1                                      # [..., hidden]
  if b1 is not None:
    h = h + b1
  g = common.gelu(h)
  w = g @ k2                                      # [..., F]
  if b2 is not None:
    w = w + b2
  return w, (x, h, g, k1, b1, k2, b2)


def _hyper_mlp_bwd(residuals, dw):
  x, h, g, k1, b1, k2, b2 = residuals
  dg = dw @ k2.T
  # GELU'(h) from h alone, in the pass that applies it: without the barrier
  # XLA shares erf(h / sqrt 2) with the forward and stores it, one more
  # [..., hidden] array written and read.
  h = jax.lax.optimization_barrier(h)
  _, dh = jax.jvp(common.gelu, (h,), (dg,))       # dg * GELU'(h)
  bias_grad = lambda b, t: None if b is None else jnp.sum(  # noqa: E731
      _rows(t), axis=0)
  return (dh @ k1.T, _weight_grad(x, dh), bias_grad(b1, dh),
          _weight_grad(g, dw), bias_grad(b2, dw))


hyper_mlp.defvjp(_hyper_mlp_fwd, _hyper_mlp_bwd)


class _DenseVars(nn.Module):
  """``common.Dense``'s variables (names, shapes, initialisers, logical
  axes), returned instead of applied: ``in_features -> (kernel, bias)``."""
  features: int
  axes: tuple[str | None, str | None]
  use_bias: bool = True
  param_dtype: common.Dtype = jnp.float32
  leaf: bool = False

  @nn.compact
  def __call__(self, in_features: int) -> tuple[Array, Array | None]:
    if not self.leaf:  # common.Dense keeps them in its nn.Dense "dense"
      return _DenseVars(self.features, self.axes, self.use_bias,
                        self.param_dtype, leaf=True, name="dense")(in_features)
    kernel = self.param(
        "kernel", common.partitioned(common.default_kernel_init, self.axes),
        (in_features, self.features), self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param("bias", common.partitioned(
          nn.initializers.zeros_init(), (self.axes[1],)), (self.features,),
                        self.param_dtype)
    return kernel, bias


class HyperNetwork(nn.Module):
  """Per-token MLP([d, hidden, features]), GELU: one weight row per token.

  ``custom_backward``: the same function through ``hyper_mlp`` (its own
  backward pass, faster on CPU) instead of two ``common.Dense`` layers;
  the same parameters either way.
  """
  hidden_dim: int
  features: int
  use_bias: bool = True
  custom_backward: bool = False
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    axes = ((common.EMBED, common.MLP), (common.MLP, common.HYPER))
    if self.custom_backward:
      k1, b1 = _DenseVars(self.hidden_dim, axes[0], self.use_bias,
                          self.param_dtype, name="hidden")(x.shape[-1])
      k2, b2 = _DenseVars(self.features, axes[1], self.use_bias,
                          self.param_dtype, name="out")(self.hidden_dim)
      k1, b1, k2, b2 = jax.tree.map(lambda t: t.astype(self.dtype),
                                    (k1, b1, k2, b2))
      w = hyper_mlp(x.astype(self.dtype), k1, b1, k2, b2)
    else:
      kw = dict(dtype=self.dtype, param_dtype=self.param_dtype,
                use_bias=self.use_bias)
      h = common.Dense(self.hidden_dim, axes=axes[0], name="hidden",
                       **kw)(x)
      # Its input is the hidden layer (``mlp``), not the model width.
      w = common.Dense(self.features, axes=axes[1], name="out",
                       **kw)(common.gelu(h))
    return common.constrain(w, (common.BATCH, common.LENGTH, common.HYPER))


class HeadHyperNetworks(nn.Module):
  """H per-token MLPs, head h reading only its slice ``x[..., h, :]``.

  ``[B, N, H, d/H] -> [B, N, H, features]`` with per-head weights
  (``MLP([d/H, hidden, features])`` each), the official implementation's
  multi-head layout.
  """
  hidden_dim: int
  features: int
  use_bias: bool = True
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    heads, width = x.shape[-2:]
    # LeCun normal per head (axis 0 is a batch of kernels, not fan-in); only
    # the head axis is named, since 'heads' and the widths share a mesh axis.
    init = common.partitioned(nn.initializers.lecun_normal(batch_axis=(0,)),
                              (common.HEADS, None, None))
    k1 = self.param("hidden_kernel", init, (heads, width, self.hidden_dim),
                    self.param_dtype)
    k2 = self.param("out_kernel", init, (heads, self.hidden_dim,
                                         self.features), self.param_dtype)
    h = jnp.einsum("bnhi,hio->bnho", x, k1.astype(self.dtype))
    if self.use_bias:
      h = h + self.param("hidden_bias", common.partitioned(
          nn.initializers.zeros_init(), (common.HEADS, None)),
                         (heads, self.hidden_dim), self.param_dtype
                         ).astype(self.dtype)
    w = jnp.einsum("bnhi,hio->bnho", common.gelu(h), k2.astype(self.dtype))
    if self.use_bias:
      w = w + self.param("out_bias", common.partitioned(
          nn.initializers.zeros_init(), (common.HEADS, None)),
                         (heads, self.features), self.param_dtype
                         ).astype(self.dtype)
    return w


def causal_token_mixing(w_in: Array, w_out: Array, values: Array,
                        segment_ids: Array | None, chunk_size: int = 64
                        ) -> Array:
  """Causal TM-MLP: prefix sums instead of one hidden layer per segment.

  out[b,m,h,f] = w_out[b,m,h] · GELU(sum_{n<=m, same run}
                                     w_in[b,n,h] v[b,n,h,f])

  A run is a maximal stretch of equal segment ids, so tokens of different
  segments never mix (a non-contiguous segment is split into runs). The
  prefix sums are accumulated in float32 whatever the compute dtype (a
  bfloat16 sum over thousands of tokens would lose the early ones).

  Args:
    w_in: ``[B, N, H, d']``; w_out: ``[B, N, H, d']``; values:
      ``[B, N, H, f]``; segment_ids: ``[B, N]`` or None.
    chunk_size: tokens per scan step C; memory per step is
      ``B C H f d'`` states, and training stores ``N / C`` boundary states.
  Returns:
    ``[B, N, H, f]`` in the dtype of ``w_out``.
  """
  b, n = values.shape[:2]
  c = max(1, min(chunk_size, n))
  pad = -n % c
  run = jnp.zeros((b, n), jnp.int32)  # run index of every token
  if segment_ids is not None:
    run = jnp.cumsum(jnp.concatenate(
        [jnp.zeros((b, 1), jnp.int32),
         (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)],
        axis=1), axis=1)
  if pad:  # padded keys have zero weights rows, padded queries are dropped
    zeros = lambda t: jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0)))  # noqa: E731
    w_in, w_out, values = zeros(w_in), zeros(w_out), zeros(values)
    run = jnp.pad(run, ((0, 0), (0, pad)), mode="edge")
  return _causal_scan(w_in, w_out, values, run, c)[:, :n]


# The chunk scan with its own backward pass. Autodiff of the scan (the
# chunk body rematerialised, or not) ran the backward at 7-8x the forward
# on CPU; the hand-written one below is one reverse scan over the same
# chunks: it recomputes a chunk's states from the stored boundary state,
# and carries the gradient of the state that the next chunk read.
def _chunked(t: Array, c: int) -> Array:
  """``[B, N, ...] -> [N/C, B, C, ...]``."""
  return jnp.swapaxes(t.reshape((t.shape[0], -1, c) + t.shape[2:]), 0, 1)


def _unchunked(t: Array) -> Array:
  """``[N/C, B, C, ...] -> [B, N, ...]``."""
  t = jnp.swapaxes(t, 0, 1)
  return t.reshape((t.shape[0], -1) + t.shape[3:])


def _chunk_states(wi, v, r, state, prev_run):
  """One chunk's float32 states ``[B, C, H, f, d']`` (the carried state
  counts while a token is still in the run it ended in), with the masks
  that built them: ``inside [B, C, C]`` (keys j <= t of t's run in the
  chunk) and ``carried [B, C]``."""
  c = r.shape[1]
  tri = jnp.tril(jnp.ones((c, c), bool))
  inside = (tri[None] & (r[:, :, None] == r[:, None, :])).astype(jnp.float32)
  carried = (r == prev_run[:, None]).astype(jnp.float32)
  outer = (v.astype(jnp.float32)[..., :, None]
           * wi.astype(jnp.float32)[..., None, :])          # [B, C, H, f, d']
  states = (jnp.einsum("btj,bjhfk->bthfk", inside, outer)
            + carried[:, :, None, None, None] * state[:, None])
  return states, inside, carried


def _scan_forward(w_in, w_out, values, run, c, keep_states: bool):
  b, _, h, f = values.shape
  init = (jnp.zeros((b, h, f, w_in.shape[-1]), jnp.float32),
          jnp.full((b,), -1, jnp.int32))

  def step(carry, xs):
    state, prev_run = carry
    wi, wo, v, r = xs
    states, _, _ = _chunk_states(wi, v, r, state, prev_run)
    y = jnp.einsum("bthk,bthfk->bthf", wo,
                   common.gelu(states).astype(wo.dtype))
    return (states[:, -1], r[:, -1]), (y, carry) if keep_states else y
  _, out = jax.lax.scan(step, init, (_chunked(w_in, c), _chunked(w_out, c),
                                     _chunked(values, c), _chunked(run, c)))
  if keep_states:
    y, (states, prev_runs) = out
    return _unchunked(y), (states, prev_runs)
  return _unchunked(out), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _causal_scan(w_in, w_out, values, run, c):
  """Padded inputs (N a multiple of ``c``), ``run [B, N]`` ids -> ``y``."""
  return _scan_forward(w_in, w_out, values, run, c, False)[0]


def _causal_scan_fwd(w_in, w_out, values, run, c):
  y, boundaries = _scan_forward(w_in, w_out, values, run, c, True)
  return y, (w_in, w_out, values, run, boundaries)


def _causal_scan_bwd(c, residuals, dy):
  w_in, w_out, values, run, (states, prev_runs) = residuals

  def step(g_next, xs):
    wi, wo, v, r, state, prev_run, g = xs
    hidden, inside, carried = _chunk_states(wi, v, r, state, prev_run)
    act, gelu_vjp = jax.vjp(common.gelu, hidden)
    g = g.astype(jnp.float32)
    d_wo = jnp.einsum("bthf,bthfk->bthk", g, act)
    d_hidden = gelu_vjp(g[..., :, None]
                        * wo.astype(jnp.float32)[..., None, :])[0]
    d_hidden = d_hidden.at[:, -1].add(g_next)   # the next chunk's state
    d_outer = jnp.einsum("btj,bthfk->bjhfk", inside, d_hidden)
    d_wi = jnp.einsum("bjhfk,bjhf->bjhk", d_outer, v.astype(jnp.float32))
    d_v = jnp.einsum("bjhfk,bjhk->bjhf", d_outer, wi.astype(jnp.float32))
    g_prev = jnp.einsum("bt,bthfk->bhfk", carried, d_hidden)
    return g_prev, (d_wi.astype(wi.dtype), d_wo.astype(wo.dtype),
                    d_v.astype(v.dtype))
  b, _, h, f = values.shape
  init = jnp.zeros((b, h, f, w_in.shape[-1]), jnp.float32)
  _, (d_wi, d_wo, d_v) = jax.lax.scan(
      step, init, (_chunked(w_in, c), _chunked(w_out, c),
                   _chunked(values, c), _chunked(run, c), states, prev_runs,
                   _chunked(dy, c)), reverse=True)
  return _unchunked(d_wi), _unchunked(d_wo), _unchunked(d_v), None


_causal_scan.defvjp(_causal_scan_fwd, _causal_scan_bwd)


def single_head_token_mixing(w_in: Array, w_out: Array, values: Array,
                             key_segments: Array, query_segments: Array
                             ) -> Array:
  """One head, one hidden layer: ``token_mixing_mlp`` in 3-D products.

  out[b,m,f] = q[b,m] sum_k w_out[b,m,k] GELU(sum_n k[b,n] w_in[b,n,k]
                                             v[b,n,f])

  Every product keeps the token-major layouts of its operands: the two that
  contract over tokens (the hidden layer and its gradient) run as XLA:CPU's
  transposed-operand GEMM, about as fast as its YNNPACK one on these shapes
  (~15% faster with the hidden layer as [B, f, d'] than as [B, d', f]); the
  head axis of ``token_mixing_mlp`` made XLA write transposed copies of the
  [B, N, d'] weight rows and of the values instead.

  Args:
    w_in: ``[B, N, d']``; w_out: ``[B, M, d']``; values: ``[B, N, f]``;
      key_segments ``[B, N, 1]``, query_segments ``[B, M, 1]`` (0/1).
  Returns:
    ``[B, M, f]``.
  """
  hidden = jnp.einsum("bnf,bnk->bfk", values, w_in * key_segments)
  return jnp.einsum("bmk,bfk->bmf", w_out * query_segments,
                    common.gelu(hidden))                  # [B, f, d'] hidden


def _slices(length: int, pieces: int) -> list[slice]:
  """``pieces`` contiguous slices covering ``range(length)``, sizes +-1."""
  bounds = [length * i // pieces for i in range(pieces + 1)]
  return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]


def two_pass_token_mixing(net_in, net_out, hyp_in: Array, hyp_out: Array,
                          values: Array, key_segments: Array,
                          query_segments: Array, pieces: int,
                          same: bool) -> Array:
  """Unpacked TM-MLP with per-token weights, in token chunks.

  out[b,m,h,f] = q[b,m] sum_k W2[b,m,h,k] GELU(sum_n k[b,n] W1[b,n,h,k]
                                                v[b,n,h,f])
  with W1 = ``net_in(hyp_in)`` and W2 = ``net_out(hyp_out)`` evaluated
  chunk by chunk: pass 1 accumulates the [B, H, d', f] hidden layer over
  key chunks, pass 2 produces the output chunk by chunk. The chunks are an
  unrolled Python loop (XLA counts every FLOP; no loop carries state across
  a while loop). With ``same`` (tied self-mixing) W2 = W1 and pass 2 reuses
  pass 1's chunks.

  Args:
    net_in, net_out: ``[B, c, d] -> [B, c, H, d']`` hypernetworks.
    hyp_in: ``[B, N, d]``; hyp_out: ``[B, M, d]`` their inputs.
    values: ``[B, N, H, f]``; key_segments ``[B, N, 1]``;
      query_segments ``[B, M, 1]`` (0/1: which tokens count).
    pieces: number of chunks of each side.
  Returns:
    ``[B, M, H, f]``.
  """
  hidden, rows = None, []
  for sl in _slices(hyp_in.shape[1], pieces):
    w1 = net_in(hyp_in[:, sl])
    if same:
      rows.append(w1)
    part = jnp.einsum("bnhk,bnhf->bhkf", w1 * key_segments[:, sl, :, None],
                      values[:, sl])
    hidden = part if hidden is None else hidden + part
  gelu = common.gelu(hidden)                     # [B, H, d', f]
  out = []
  for i, sl in enumerate(_slices(hyp_out.shape[1], pieces)):
    w2 = rows[i] if same else net_out(hyp_out[:, sl])
    y = jax.lax.dot_general(w2 * query_segments[:, sl, :, None], gelu,
                            (((3,), (2,)), ((0, 2), (0, 1))))  # [B, H, c, f]
    out.append(jnp.swapaxes(y, 1, 2))
  return jnp.concatenate(out, axis=1)


class HyperMixing(nn.Module):
  """HyperMixing token mixer (self- or cross-mixing).

  Attributes:
    hyper_dim: TM-MLP hidden width d' per head.
    num_heads: heads H; must divide d.
    tied: one hypernetwork for W1 and W2.
    position: 'sinusoidal' | 'learned' | 'none' position embeddings added to
      the hypernetwork inputs.
    max_len: the learned position table holds ``max_len + position_offset``
      rows; the sinusoidal one ``max(max_len, N, M) + position_offset``.
    layer_norm: LayerNorm on the output.
    hidden_dim: hypernetwork hidden width (default d; d / H with
      ``head_slices``).
    causal: query m only reads keys n <= m (self-mixing only).
    causal_chunk_size: tokens per step of the causal scan (memory per layer
      grows with it, the number of sequential steps shrinks).
    max_segments: most packed examples per row when ``segment_ids`` is given
      (non-causal); each costs one TM-MLP hidden layer. Tokens of a segment
      id above it get NaN outputs, so an overflow cannot pass silently.
    hyper_bias: biases in the hypernetworks' two layers (the official
      implementation has none; the paper does not say).
    input_scale: multiply the hypernetworks' input by sqrt(d) before adding
      the positions (the official implementation's choice).
    position_offset: the first position's index in the position table (the
      official implementation counts from 1).
    head_slices: with several heads, head h's hypernetwork reads only its
      slice of each token (per-head weights, the official implementation's
      layout) instead of the whole token.
    chunk_tokens: non-causal, unpacked mixing in two passes over token
      chunks of about this many tokens (B x chunk length; the automatic
      choice, None, keeps chunks of at least 128 tokens of each row): pass 1 runs the key-side hypernetwork and
      accumulates W1^T x chunk by chunk, pass 2 the query side and
      W2 GELU(.) (``two_pass_token_mixing``). Same function (summation
      order aside). On a CPU the chunks' working sets stay in cache, which
      made the forward faster from a few thousand tokens per call, but its
      backward pass is slower than the one-pass form's (one-off runs on one
      CPU core, not recorded; docs/performance.md, HyperMixing forward,
      has the commands), so the default uses it only
      for deterministic calls (evaluation, prediction), not for training.
      None: that default (1024 tokens when traced for CPU,
      ``common.target_platform``; one pass elsewhere); 0: always one pass;
      > 0: always chunked.
    cpu_path: forms tuned for XLA:CPU's gradient step: the (shared-weight)
      hypernetworks through ``hyper_mlp`` (its own backward pass) instead of
      autodiff of two Dense layers, and in the one-pass mixing with one head
      and one slot the TM-MLP as ``single_head_token_mixing``. Same
      parameters, function and gradients (float32 rounding aside); together
      they made the gradient step 1.3-1.8x faster on one core at B = 8,
      d = 256, d' = 512 (one-off runs; docs/performance.md, Attention and
      HyperMixing against PyTorch, has the command). The forward compiles as
      before. None: on CPU (``common.target_platform``), the generic forms
      elsewhere.
  """
  hyper_dim: int
  num_heads: int = 1
  tied: bool = False
  position: str = "sinusoidal"
  max_len: int = 512
  layer_norm: bool = True
  hidden_dim: int | None = None
  causal: bool = False
  causal_chunk_size: int = 64
  max_segments: int = 1
  hyper_bias: bool = True
  input_scale: bool = False
  position_offset: int = 0
  head_slices: bool = False
  chunk_tokens: int | None = None
  cpu_path: bool | None = None
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  # Positions enter the hypernetworks' inputs only (Algorithm 1; the
  # position-invariance argument rests on the values never seeing them), so
  # the zoo's GLUE configs and the smlp family add none to the residual
  # stream of a model on HyperMixing (``build_model`` itself follows
  # ``position_embeddings``).
  adds_positions = True
  # What a causal config exposes to the command line (``models.registry``).
  causal_options = ("causal_chunk_size",)

  @classmethod
  def model_defaults(cls, model) -> dict:
    """In a model (``models.registry``): d' = d, the paper's default."""
    return {"hyper_dim": model["d_model"]}

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None,
               segment_ids: Array | None = None,
               positions: Array | None = None, deterministic: bool = True,
               context: Array | None = None,
               context_mask: Array | None = None,
               context_segment_ids: Array | None = None,
               context_positions: Array | None = None) -> Array:
    """Mixes ``x`` (queries [B, M, d]) with ``context`` (keys/values, or x).

    Algorithm 1's steps: the hypernetworks' inputs and networks
    (``hypernetworks``), then the TM-MLP with the generated weights, in one
    pass (``token_mixing``), in two passes over token chunks
    (``two_pass_token_mixing``) or causally (``causal_token_mixing``), then
    LayerNorm (``_finish``). No dropout inside the token mixer;
    ``deterministic`` (not training) only picks the automatic chunking.
    """
    self_mixing = context is None
    if self_mixing:
      context, context_mask = x, mask
      context_segment_ids, context_positions = segment_ids, positions
    self._check(x, context, self_mixing, segment_ids, context_segment_ids)
    b, m, d = x.shape
    n = context.shape[1]
    q_mask = common.resolve_mask(x, mask, segment_ids)
    k_mask = common.resolve_mask(context, context_mask, context_segment_ids)
    x, context = x.astype(self.dtype), context.astype(self.dtype)
    net_in, net_out, hyp_in, hyp_out = self.hypernetworks(
        x, context, positions, context_positions)
    # Self-mixing with one hypernetwork: the same tokens and positions feed
    # both sides, so W2 = W1.
    same = self.tied and self_mixing
    one_slot = (segment_ids is None and context_segment_ids is None) or \
        self.max_segments == 1
    pieces = self._chunks(b, n, m, deterministic)
    if self.causal:
      w1 = net_in(hyp_in)                                 # [B, N, H, d']
      if k_mask is not None:
        w1 = w1 * k_mask[..., None, None].astype(self.dtype)
      y = causal_token_mixing(w1, w1 if same else net_out(hyp_out),
                              self._heads(context), segment_ids,
                              self.causal_chunk_size)
      return self._finish(y.reshape(b, m, d), q_mask, None)
    slots = 1 if one_slot else self.max_segments
    k_seg, _ = segment_one_hot(context, k_mask, context_segment_ids, slots,
                               self.dtype)               # [B, N, S]
    q_seg, overflow = segment_one_hot(x, q_mask, segment_ids, slots,
                                      self.dtype)        # [B, M, S]
    if one_slot and pieces > 1:
      y = two_pass_token_mixing(net_in, net_out, hyp_in, hyp_out,
                                self._heads(context), k_seg, q_seg, pieces,
                                same)
    else:
      w1 = net_in(hyp_in)                                 # [B, N, H, d']
      w2 = w1 if same else net_out(hyp_out)               # [B, M, H, d']
      if one_slot and self.num_heads == 1 and self._cpu_path():
        y = single_head_token_mixing(w1[:, :, 0], w2[:, :, 0], context,
                                     k_seg, q_seg)
      else:
        y = token_mixing_mlp(w1, w2, self._heads(context), k_seg, q_seg)
    return self._finish(y.reshape(b, m, d), q_mask, overflow)

  def _cpu_path(self) -> bool:
    if self.cpu_path is None:
      return common.target_platform() == "cpu"
    return self.cpu_path

  def _check(self, x: Array, context: Array, self_mixing: bool,
             segment_ids: Array | None, context_segment_ids: Array | None
             ) -> None:
    """One-line errors naming the argument or field and the fix."""
    common.check_width(x, None, "HyperMixing")
    b, m, d = x.shape
    if not self_mixing:
      if context.ndim != 3 or context.shape[::2] != (b, d):
        raise ValueError(
            f"HyperMixing: context has shape {tuple(context.shape)} but x is "
            f"[B, M, d] = {tuple(x.shape)}; keys/values must be [B, N, d] "
            "with the queries' batch and feature width.")
      if self.causal:
        raise ValueError("HyperMixing: causal=True needs self-mixing; do not "
                         "pass context.")
      if (segment_ids is None) != (context_segment_ids is None):
        raise ValueError("HyperMixing: pass both segment_ids and "
                         "context_segment_ids for packed cross-mixing, or "
                         "neither.")
    n = context.shape[1]
    if d % self.num_heads:
      raise ValueError(f"HyperMixing: num_heads={self.num_heads} must divide "
                       f"the feature width d={d}.")
    if self.position not in POSITIONS:
      raise ValueError(f"HyperMixing: position={self.position!r}, expected "
                       f"one of {POSITIONS}.")
    if self.position == "learned" and max(n, m) > self.max_len:
      raise ValueError(f"HyperMixing: sequence length {max(n, m)} exceeds "
                       f"max_len={self.max_len} of the learned positions; "
                       "raise max_len or truncate the inputs.")

  def _heads(self, t: Array) -> Array:
    """``[B, N, H * w] -> [B, N, H, w]``."""
    return t.reshape(t.shape[:2] + (self.num_heads, -1))

  def hypernetworks(self, x: Array, context: Array,
                    positions: Array | None, context_positions: Array | None):
    """Algorithm 1's hypernetworks and their inputs (token + position).

    Returns ``(net_in, net_out, hyp_in, hyp_out)``: ``net_in(hyp_in)`` is
    W1 ``[B, N, H, d']`` and ``net_out(hyp_out)`` is W2 ``[B, M, H, d']``
    (the same network when tied). The networks map any chunk of tokens of
    their input, so the two-pass mixing can call them chunk by chunk.
    """
    d = x.shape[-1]
    table = None  # [max_len + position_offset, d]
    rows = max(self.max_len, context.shape[1], x.shape[1]) + \
        self.position_offset
    if self.position == "learned":
      table = self.param(
          "position_embedding",
          common.partitioned(nn.initializers.normal(0.02),
                             (common.SEQ_IN, common.EMBED)),
          (self.max_len + self.position_offset, d), self.param_dtype)
    elif self.position == "sinusoidal":
      table = common.sinusoidal_positions(rows, d)

    def hyper_input(t, pos):
      if self.input_scale:
        t = t * jnp.asarray(d ** 0.5, self.dtype)
      if table is not None:
        if pos is None:
          pos = jnp.arange(t.shape[1])[None]
        t = t + jnp.take(table, pos + self.position_offset,
                         axis=0).astype(self.dtype)
      # Head h's own network reads [B, *, H, d/H]; the shared one [B, *, d].
      return self._heads(t) if self.head_slices else t

    if self.head_slices:
      make = lambda name: HeadHyperNetworks(  # noqa: E731
          self.hidden_dim or d // self.num_heads, self.hyper_dim,
          self.hyper_bias, dtype=self.dtype, param_dtype=self.param_dtype,
          name=name)
    else:
      make = lambda name: HyperNetwork(  # noqa: E731
          self.hidden_dim or d, self.num_heads * self.hyper_dim,
          self.hyper_bias, self._cpu_path(), dtype=self.dtype,
          param_dtype=self.param_dtype, name=name)
    if self.tied:
      net_in = net_out = make("hypernetwork")
    else:
      net_in, net_out = make("hypernetwork_in"), make("hypernetwork_out")
    return (lambda t: self._heads(net_in(t)),
            lambda t: self._heads(net_out(t)),
            hyper_input(context, context_positions),
            hyper_input(x, positions))

  def _chunks(self, b: int, n: int, m: int, deterministic: bool = True
              ) -> int:
    """Token chunks of the two-pass mixing (1: one pass)."""
    size = self.chunk_tokens
    if size is None:
      auto = deterministic and common.target_platform() == "cpu"
      size = 1024 if auto else 0
    if size < 0:
      raise ValueError(f"HyperMixing: chunk_tokens={size} must be >= 0 "
                       "(0: one pass; None: automatic).")
    if not size:
      return 1
    longest = min(n, m) // 128 if self.chunk_tokens is None else min(n, m)
    return max(1, min(longest, -(-b * max(n, m) // size)))

  def _finish(self, y: Array, q_mask: Array | None,
              overflow: Array | None) -> Array:
    if self.layer_norm:
      y = common.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype,
                           name="layer_norm")(y)
    if q_mask is not None:
      y = jnp.where(q_mask[..., None], y, 0)  # LayerNorm's bias would leak
    if overflow is not None:
      y = jnp.where(overflow[..., None], jnp.nan, y)
    return common.constrain(y, (common.BATCH, common.LENGTH, common.EMBED))
