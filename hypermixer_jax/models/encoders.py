"""Encoders (text, continuous/vision) and task heads around a layer stack.

    text:        h_0 = sqrt(d) E[ids] + P[pos] + T[type]    E: [vocab, d], E ~ N(0, 1/d)
                 (``scale_embeddings``, as in Vaswani et al.: the token term
                 has unit variance per feature, like the sinusoids, and the
                 tied output head h E^T starts with unit-scale logits; off:
                 E ~ N(0, 0.02^2) unscaled, BERT's recipe for learned positions)
    continuous:  h_0 = X W_stem + b (+ P[pos])               X: [B, N, F] patches
                 (= a conv with kernel P and stride P on raw [B, H, W, 3] images)
                 optional conv stem (``conv_stem`` = kernel sizes k_i):
                 h_0 <- GELU(conv1d_{k_i}(h_0 * m)) for each i, over the
                 sequence axis, 'SAME' padding, m zeroing padded tokens
    stack:       h_l = layer_l(h_{l-1}),  l = 1..L;  LN at the end (pre-LN layouts)

Heads (``Model.head``):
    mlm           logits = LN(GELU(h W_t + b_t)) E^T + b_v    (BERT, tied to E)
    causal_lm     logits = h E^T                               (GPT-2, tied to E)
    classify,
    pair_classify logits = pool(h) W_c + b_c, pool = mean over real tokens
                  (default; valid for every mixer, none needs a [CLS] token) or
                  the first token (``pooling='first'``, BERT's [CLS] position)
    image         logits = mean_n(h) W_c + b_c (the LN before the global average
                  pool is the encoder's final LN, as in MLP-Mixer / gMLP)
    regression    y = h W_r + b_r per token                    (synthetic task)
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from hypermixer_jax import heads
from hypermixer_jax.models import common

Array = common.Array
POSITION_EMBEDDINGS = ("learned", "sinusoidal", "none")
POOLINGS = ("mean", "first")
_ACT_AXES = (common.BATCH, common.LENGTH, common.EMBED)


class _ScannedLayer(nn.Module):
  """One layer as the body of ``nn.scan``: ``(x, broadcast inputs) -> (x,
  None)``; ``deterministic`` is an attribute (static under the scan)."""
  layer: Callable[..., nn.Module]
  deterministic: bool

  @nn.compact
  def __call__(self, x: Array, mask: Array | None, segment_ids: Array | None,
               positions: Array | None) -> tuple[Array, None]:
    x = self.layer(name="layer")(
        x, mask=mask, segment_ids=segment_ids, positions=positions,
        deterministic=self.deterministic)
    return common.constrain(x, _ACT_AXES), None


class _Layer(nn.Module):
  """One layer behind a wrapper that shares its scope (the layer's
  parameters stay where the bare layer puts them), so that ``nn.remat`` can
  wrap it with ``deterministic`` static."""
  layer: Callable[..., nn.Module]
  deterministic: bool

  def setup(self):
    self.inner = self.layer()
    nn.share_scope(self, self.inner)

  def __call__(self, x: Array, mask: Array | None, segment_ids: Array | None,
               positions: Array | None) -> Array:
    return self.inner(x, mask=mask, segment_ids=segment_ids,
                      positions=positions, deterministic=self.deterministic)


# model.remat: what a layer's backward keeps from its forward
# (jax.checkpoint_policies); the rest is recomputed.
REMAT_POLICIES = {
    "none": None,                 # no rematerialisation: keep everything
    "full": "nothing_saveable",   # keep the layer's input only
    "save_dots": "dots_saveable",  # keep every matmul output
    "save_dots_no_batch": "dots_with_no_batch_dims_saveable",  # weights' dots
}


def _remat(cls, policy: str, in_scan: bool):
  if policy not in REMAT_POLICIES:
    raise ValueError(f"unknown remat policy {policy!r}; valid: "
                     f"{', '.join(REMAT_POLICIES)}.")
  if policy == "none":
    return cls
  return nn.remat(cls, policy=getattr(jax.checkpoint_policies,
                                      REMAT_POLICIES[policy]),
                  prevent_cse=not in_scan)


class LayerStack(nn.Module):
  """``num_layers`` layers ``layer_0 ... layer_{L-1}``, then an optional LN.

  With ``scan_layers`` the layers run as one ``nn.scan`` over a single layer
  whose parameters carry a leading ``[L]`` axis (logical name
  ``common.LAYERS``, replicated by every preset), under the name
  ``layers/layer``: XLA compiles one layer body instead of ``L`` copies (the
  compile time of deep models on pods, as MaxText's and t5x's
  ``scan_layers``). The function is the same; each layer draws its own
  initialisation and dropout keys. ``stack_layers`` / ``unstack_layers``
  convert parameters between the two layouts.

  Attributes:
    layer: factory called as ``layer(name=...)``; each layer follows the mixer
      call contract and returns ``[B, N, d]``.
    final_norm: apply a LayerNorm (``final_norm``) after the last layer, which
      pre-LN layouts need because their residual stream is never normalised.
    scan_layers: run the layers as one scan (see above).
    remat: rematerialise each layer in the backward pass under one of
      ``REMAT_POLICIES`` (``none``: off; ``full``: keep only each layer's
      input; ``save_dots`` / ``save_dots_no_batch``: keep matmul outputs, all
      or those without batch dimensions), trading recomputation for
      activation memory. Parameters and results are the same.
  """
  layer: Callable[..., nn.Module]
  num_layers: int
  final_norm: bool = True
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32
  scan_layers: bool = False
  remat: str = "none"

  @nn.compact
  def __call__(self, x: Array, *, mask: Array | None = None,
               segment_ids: Array | None = None,
               positions: Array | None = None,
               deterministic: bool = True) -> Array:
    if self.scan_layers:
      scanned = nn.scan(
          _remat(_ScannedLayer, self.remat, True),
          variable_axes={"params": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
          length=self.num_layers,
          metadata_params={nn.PARTITION_NAME: common.LAYERS})
      x, _ = scanned(self.layer, deterministic, name="layers")(
          x, mask, segment_ids, positions)
    elif self.remat != "none":
      layer = _remat(_Layer, self.remat, False)
      for i in range(self.num_layers):
        x = layer(self.layer, deterministic, name=f"layer_{i}")(
            x, mask, segment_ids, positions)
    else:
      for i in range(self.num_layers):
        x = self.layer(name=f"layer_{i}")(
            x, mask=mask, segment_ids=segment_ids, positions=positions,
            deterministic=deterministic)
    if self.final_norm:
      x = common.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype,
                           name="final_norm")(x)
    return common.constrain(x, _ACT_AXES)


SCANNED = "layers"   # the scanned stack's child: ``stack/layers/layer/...``
_UNROLLED = re.compile(r"layer_(\d+)$")


def stack_layers(stack: Mapping[str, Any]) -> dict[str, Any]:
  """A ``LayerStack``'s parameters from the unrolled layout
  (``layer_0 ... layer_{L-1}``) to the scanned one (``layers/layer`` with a
  leading ``[L]`` axis on every leaf); other children are kept."""
  layers = sorted((int(m.group(1)), k) for k in stack
                  if (m := _UNROLLED.match(k)))
  if not layers or [i for i, _ in layers] != list(range(len(layers))):
    raise ValueError("stack_layers: expected children layer_0 ... "
                     f"layer_(L-1), got {sorted(stack)}.")
  out = {k: v for k, v in stack.items() if not _UNROLLED.match(k)}
  out[SCANNED] = {"layer": jax.tree.map(
      lambda *xs: jnp.stack(xs), *[stack[k] for _, k in layers])}
  return out


def unstack_layers(stack: Mapping[str, Any]) -> dict[str, Any]:
  """The inverse of ``stack_layers``: ``layers/layer`` (leading ``[L]``) to
  ``layer_0 ... layer_{L-1}``."""
  if SCANNED not in stack or "layer" not in stack[SCANNED]:
    raise ValueError(f"unstack_layers: expected a child {SCANNED}/layer, got "
                     f"{sorted(stack)}.")
  body = stack[SCANNED]["layer"]
  num = {x.shape[0] for x in jax.tree.leaves(body)}
  if len(num) != 1:
    raise ValueError(f"unstack_layers: leaves disagree on the layer count "
                     f"{sorted(num)}.")
  out = {k: v for k, v in stack.items() if k != SCANNED}
  for i in range(num.pop()):
    out[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], body)
  return out


def _learned_positions(module: nn.Module, max_len: int, d: int,
                       param_dtype: common.Dtype) -> Array:
  return module.param(
      "pos_embedding",
      common.partitioned(nn.initializers.normal(0.02), (None, common.EMBED)),
      (max_len, d), param_dtype)


def _add_positions(x: Array, kind: str, positions: Array, max_len: int,
                   learned: Array | None) -> Array:
  """``x + P[positions]`` for the position embedding ``kind``."""
  if kind not in POSITION_EMBEDDINGS:
    raise ValueError(f"unknown position_embeddings {kind!r}; valid: "
                     f"{', '.join(POSITION_EMBEDDINGS)}.")
  n, d = x.shape[1], x.shape[2]
  if kind == "none":
    return x
  if kind == "sinusoidal":
    table = common.sinusoidal_positions(max(n, max_len), d)
  else:
    if n > max_len:
      raise ValueError(f"sequence length {n} exceeds max_len={max_len} of "
                       "the learned position embeddings; raise max_len.")
    table = learned
  return x + jnp.take(table, positions, axis=0).astype(x.dtype)


def _default_positions(x: Array, positions: Array | None) -> Array:
  if positions is None:
    return jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
  return positions


def _few_rows_lookup(embed: nn.Embed, ids: Array) -> Array:
  """``embed(ids)`` as a one-hot product, for tables of a few rows (token
  types). A gather's gradient is a scatter-add of every token into those
  rows, which a GPU serialises on the rows' atomics: it took 78-89% of the
  BERT-width MLM train step of MLP-Mixer and FNet on an H200 (the
  accelerator kit's profile). The product's gradient is a matmul; the
  values are the same (one non-zero term per output)."""
  table = jnp.asarray(embed.embedding, embed.dtype or embed.param_dtype)
  one_hot = jax.nn.one_hot(ids, table.shape[0], dtype=table.dtype)
  return jnp.einsum("...t,td->...d", one_hot, table)


class TextEncoder(nn.Module):
  """Token (+ position, + token type) embeddings, dropout, layer stack.

  ``__call__`` returns the final hidden states ``[B, N, d]``; ``attend(h)``
  multiplies by the token embedding matrix (``E^T``) for tied output heads.
  Parameters: ``token_embed`` (``('vocab', 'embed')``), ``pos_embedding``
  (learned only), ``type_embed`` (if ``type_vocab_size``), ``embed_ln``
  (post-LN layouts, as in BERT), ``stack``.
  """
  layer: Callable[..., nn.Module]
  num_layers: int
  d_model: int
  vocab_size: int
  max_len: int
  position_embeddings: str = "learned"
  type_vocab_size: int = 2
  embed_norm: bool = False
  final_norm: bool = True
  dropout_rate: float = 0.0
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32
  scale_embeddings: bool = True
  scan_layers: bool = False
  remat: str = "none"

  def setup(self):
    std = self.d_model ** -0.5 if self.scale_embeddings else 0.02
    self.token_embed = nn.Embed(
        self.vocab_size, self.d_model, dtype=self.dtype,
        param_dtype=self.param_dtype,
        embedding_init=common.partitioned(nn.initializers.normal(std),
                                          (common.VOCAB, common.EMBED)))
    if self.type_vocab_size:
      self.type_embed = nn.Embed(
          self.type_vocab_size, self.d_model, dtype=self.dtype,
          param_dtype=self.param_dtype,
          embedding_init=common.partitioned(nn.initializers.normal(0.02),
                                            (None, common.EMBED)))
    if self.position_embeddings == "learned":
      self.pos_embedding = _learned_positions(self, self.max_len, self.d_model,
                                              self.param_dtype)
    if self.embed_norm:
      self.embed_ln = common.LayerNorm(dtype=self.dtype,
                                       param_dtype=self.param_dtype)
    self.dropout = nn.Dropout(self.dropout_rate)
    self.stack = LayerStack(self.layer, self.num_layers, self.final_norm,
                            dtype=self.dtype, param_dtype=self.param_dtype,
                            scan_layers=self.scan_layers, remat=self.remat)

  def __call__(self, ids: Array, *, segment_ids: Array | None = None,
               token_type_ids: Array | None = None,
               positions: Array | None = None,
               deterministic: bool = True) -> Array:
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"TextEncoder: inputs must be int token ids [B, N], "
                       f"got {ids.dtype} {ids.shape}.")
    x = self.token_embed(ids)                                  # [B, N, d]
    if self.scale_embeddings:
      # Without it, unit-amplitude sinusoids drown N(0, 0.02) token vectors
      # (~97% of the input variance is position at init) and the GLUE
      # models did not learn from scratch.
      x = x * jnp.asarray(self.d_model ** 0.5, x.dtype)
    # The embeddings need positions; the layers get the caller's (None when
    # none were given: mixers default to 0..N-1 themselves, and some take a
    # faster path then, e.g. gMLP's FFT Toeplitz product).
    x = _add_positions(x, self.position_embeddings,
                       _default_positions(ids, positions), self.max_len,
                       self.pos_embedding
                       if self.position_embeddings == "learned" else None)
    if self.type_vocab_size:
      if token_type_ids is None:
        token_type_ids = jnp.zeros_like(ids)
      x = x + _few_rows_lookup(self.type_embed, token_type_ids)
    if self.embed_norm:
      x = self.embed_ln(x)
    x = self.dropout(x.astype(self.dtype), deterministic=deterministic)
    x = common.constrain(x, _ACT_AXES)
    mask = None if segment_ids is None else segment_ids > 0
    return self.stack(x, mask=mask, segment_ids=segment_ids,
                      positions=positions, deterministic=deterministic)

  def attend(self, h: Array) -> Array:
    """``h E^T``: logits over the vocabulary, ``[B, N, vocab]``."""
    return self.token_embed.attend(h)


def patchify(images: Array, patch_size: int) -> Array:
  """``[B, H, W, C]`` -> ``[B, (H/P)(W/P), P*P*C]``, row-major patches.

  Each patch is flattened in (row, column, channel) order, the order of a
  conv kernel ``[P, P, C, d]``, so the stem Dense equals that conv.
  """
  b, h, w, c = images.shape
  p = patch_size
  if not p or h % p or w % p:
    raise ValueError(f"image size {h}x{w} is not divisible by patch_size={p}.")
  x = images.reshape(b, h // p, p, w // p, p, c)
  x = x.transpose(0, 1, 3, 2, 4, 5)                      # [B, H/P, W/P, P, P, C]
  return x.reshape(b, (h // p) * (w // p), p * p * c)


class ContinuousEncoder(nn.Module):
  """Linear stem over continuous inputs (patches), positions, layer stack.

  Inputs are ``[B, N, input_dim]`` (flattened patches, or the synthetic
  task's ``[B, N, 1]``) or raw images ``[B, H, W, C]``, cut into
  ``patch_size`` x ``patch_size`` patches first.
  """
  layer: Callable[..., nn.Module]
  num_layers: int
  d_model: int
  max_len: int
  input_dim: int | None = None
  patch_size: int | None = None
  position_embeddings: str = "none"
  final_norm: bool = True
  dropout_rate: float = 0.0
  conv_stem: tuple[int, ...] = ()
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32
  scan_layers: bool = False
  remat: str = "none"

  @nn.compact
  def __call__(self, inputs: Array, *, segment_ids: Array | None = None,
               positions: Array | None = None,
               deterministic: bool = True) -> Array:
    if inputs.ndim == 4 and self.conv_stem:
      raise ValueError("ContinuousEncoder: conv_stem is a 1-d convolution "
                       "over a sequence; it is not available for images.")
    if inputs.ndim == 4:
      inputs = patchify(inputs, self.patch_size)
    if inputs.ndim != 3:
      raise ValueError("ContinuousEncoder: inputs must be [B, N, F] or raw "
                       f"images [B, H, W, C], got shape {inputs.shape}.")
    if self.input_dim and inputs.shape[-1] != self.input_dim:
      raise ValueError(f"ContinuousEncoder: inputs have {inputs.shape[-1]} "
                       f"features but input_dim={self.input_dim}.")
    x = common.Dense(self.d_model, (common.PATCH, common.EMBED),
                     dtype=self.dtype, param_dtype=self.param_dtype,
                     name="stem")(inputs)                      # [B, N, d]
    if self.conv_stem:
      # Local feature extraction before token mixing (Fleuret's toy model);
      # padded tokens are zeroed before each conv so they never leak in.
      keep = (None if segment_ids is None
              else (segment_ids > 0)[..., None].astype(x.dtype))
      for i, k in enumerate(self.conv_stem):
        if keep is not None:
          x = x * keep
        x = nn.Conv(self.d_model, (int(k),), padding="SAME",
                    dtype=self.dtype, param_dtype=self.param_dtype,
                    kernel_init=common.partitioned(
                        common.default_kernel_init,
                        (None, None, common.EMBED)),
                    bias_init=common.partitioned(nn.initializers.zeros_init(),
                                                 (common.EMBED,)),
                    name=f"conv_stem_{i}")(x)
        x = common.gelu(x)
    learned = None
    if self.position_embeddings == "learned":
      learned = _learned_positions(self, self.max_len, self.d_model,
                                   self.param_dtype)
    # As in TextEncoder: the layers get the caller's positions (or None).
    x = _add_positions(x, self.position_embeddings,
                       _default_positions(x, positions), self.max_len, learned)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    x = common.constrain(x, _ACT_AXES)
    mask = None if segment_ids is None else segment_ids > 0
    return LayerStack(self.layer, self.num_layers, self.final_norm,
                      dtype=self.dtype, param_dtype=self.param_dtype,
                      scan_layers=self.scan_layers, remat=self.remat,
                      name="stack")(
                          x, mask=mask, segment_ids=segment_ids,
                          positions=positions, deterministic=deterministic)


def masked_mean(h: Array, mask: Array | None) -> Array:
  """Mean of ``h [B, N, d]`` over the real tokens (all when mask is None)."""
  if mask is None:
    return jnp.mean(h, axis=1)
  m = mask.astype(h.dtype)[..., None]
  return jnp.sum(h * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1)


class MlmHead(nn.Module):
  """BERT's MLM head: transform, then logits tied to the input embedding."""
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, h: Array, attend: Callable[[Array], Array]) -> Array:
    d = h.shape[-1]
    # The transform's output axis is left unnamed: one tensor cannot carry
    # the logical name 'embed' twice.
    h = common.Dense(d, (common.EMBED, None), dtype=self.dtype,
                     param_dtype=self.param_dtype, name="transform")(h)
    h = common.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype,
                         name="transform_norm")(common.gelu(h))
    logits = attend(h)                                         # [B, N, V]
    bias = self.param(
        "output_bias",
        common.partitioned(nn.initializers.zeros_init(), (common.VOCAB,)),
        (logits.shape[-1],), self.param_dtype)
    return logits + bias.astype(logits.dtype)


class Model(nn.Module):
  """Encoder + head; the module ``build_model`` returns.

  Called as ``model.apply(variables, inputs, *, segment_ids=None,
  token_type_ids=None, positions=None, masked_positions=None,
  deterministic=True, rngs=...)``; outputs (float32) as in the table of
  ``hypermixer_jax.heads``: ``mlm`` ``[B, P, vocab]`` at
  ``masked_positions [B, P]`` (``[B, N, vocab]`` without them),
  ``causal_lm`` ``[B, N, vocab]``, ``classify``/``pair_classify``/``image``
  ``[B, classes]``, ``regression`` ``[B, N, out_dim]``.
  """
  family: str
  head: str
  layer: Callable[..., nn.Module]
  num_layers: int
  d_model: int
  max_len: int
  vocab_size: int = 0
  num_classes: int = 2
  out_dim: int = 1
  input_dim: int | None = None
  patch_size: int | None = None
  position_embeddings: str = "learned"
  type_vocab_size: int = 2
  pooling: str = "mean"
  final_norm: bool = True
  embed_norm: bool = False
  dropout_rate: float = 0.0
  conv_stem: tuple[int, ...] = ()
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32
  scale_embeddings: bool = True
  scan_layers: bool = False
  remat: str = "none"

  @nn.compact
  def __call__(self, inputs: Array, *, segment_ids: Array | None = None,
               token_type_ids: Array | None = None,
               positions: Array | None = None,
               masked_positions: Array | None = None,
               deterministic: bool = True) -> Array:
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    scan = dict(scan_layers=self.scan_layers, remat=self.remat)
    if self.family == "text":
      encoder = TextEncoder(
          self.layer, self.num_layers, self.d_model, self.vocab_size,
          self.max_len, self.position_embeddings, self.type_vocab_size,
          self.embed_norm, self.final_norm, self.dropout_rate, **kw, **scan,
          scale_embeddings=self.scale_embeddings, name="encoder")
      h = encoder(inputs, segment_ids=segment_ids,
                  token_type_ids=token_type_ids, positions=positions,
                  deterministic=deterministic)
    elif self.family == "continuous":
      h = ContinuousEncoder(
          self.layer, self.num_layers, self.d_model, self.max_len,
          self.input_dim, self.patch_size, self.position_embeddings,
          self.final_norm, self.dropout_rate, tuple(self.conv_stem), **kw,
          **scan, name="encoder")(
              inputs, segment_ids=segment_ids, positions=positions,
              deterministic=deterministic)
    else:
      raise ValueError(f"unknown family {self.family!r}; valid: text, "
                       "continuous.")
    valid = heads.names_for(self.family)
    if self.head not in valid:
      raise ValueError(f"head {self.head!r} is not available for the "
                       f"{self.family} family; valid: {', '.join(valid)}.")

    if self.head == "mlm":
      length_axis = common.LENGTH
      if masked_positions is not None:
        # Only the selected positions: [B, P, d], P = max_predictions_per_seq.
        h = jnp.take_along_axis(h, masked_positions[..., None], axis=1)
        length_axis = None
      out = MlmHead(**kw, name=heads.get("mlm").module)(h, encoder.attend)
      return common.constrain(out, (common.BATCH, length_axis,
                                    common.VOCAB)).astype(jnp.float32)
    if self.head == "causal_lm":
      out = encoder.attend(h)
      return common.constrain(out, (common.BATCH, common.LENGTH,
                                    common.VOCAB)).astype(jnp.float32)
    if self.head == "regression":
      out = common.Dense(self.out_dim, (common.EMBED, None), **kw,
                         name=heads.get("regression").module)(h)
      return out.astype(jnp.float32)
    # classify / pair_classify / image
    if self.pooling not in POOLINGS:
      raise ValueError(f"unknown pooling {self.pooling!r}; valid: "
                       f"{', '.join(POOLINGS)}.")
    if self.pooling == "first" and self.head != "image":
      pooled = h[:, 0]
    else:
      mask = None if segment_ids is None else segment_ids > 0
      pooled = masked_mean(h, mask)                            # [B, d]
    out = common.Dense(self.num_classes, (common.EMBED, common.CLASSES), **kw,
                       name=heads.get(self.head).module)(pooled)
    return out.astype(jnp.float32)
