"""sMLP: the sparse all-MLP causal language model (Yu et al. 2022, Fig. 2).

  h_0 = Embed(tokens)                                          # [B, N, d]
  N1 dense blocks:   h = h + SGU(LN(h))                         (causal gMLP)
  N2 sparse blocks:  h = h + sMoE-SGU(LN(h));  h = h + tMoE(LN(h))
  logits = LN(h) Embed^T / sqrt(d)                             # [B, N, vocab]

The sparse blocks are spread evenly among the dense ones (N1 = N2 alternates
dense, sparse). sMoE (``moe.smoe``) routes the gate's hidden dimensions to
spatial experts (deterministic slices or partial prediction); tMoE
(``moe.tmoe``) routes tokens to feed-forward experts (Base Layers by default,
as in the paper; Switch, GShard or Hash on request).

Causality: every position's logits depend on earlier tokens only, in
inference (``deterministic=True``) with every router and in training with
Switch, GShard (slots filled token by token here), Hash and both sMoE
routings. Base Layers' balanced assignment in training reads the whole
sequence, as in its paper. With partial-prediction routing each row's first
max(1, floor(partial_fraction n)) positions (n its unpadded length) only
decide the routing and the loss must skip them (``SmlpLM.loss_position_weights``, given to training
by ``facts``; ``moe.smoe`` explains why the split point depends on the row's
length, not on later token values).

The family ``smlp`` of ``models.build_model``: ``default_config`` /
``smlp_config`` hold exactly the fields this builder reads, the MoE options
in one group, ``moe`` (``MoeOptions``).

With N2 = 0 the model is a dense causal gMLP language model (the benchmark's
baseline).

The paper's Transformer baselines are the same family with
``token_mixer='attention'``: every block mixes tokens by causal multi-head
self-attention (``attention.SelfAttention``) instead of an SGU, and fixed
sinusoidal positions are added to the embeddings (as fairseq's
``transformer_lm``, which the paper trained its baselines with):

  h_0 = Embed(tokens) + P[positions]                           # [B, N, d]
  N1 dense blocks:   h = h + Attn(LN(h));  h = h + FFN(LN(h))  (causal Transformer)
  N2 sparse blocks:  h = h + Attn(LN(h));  h = h + tMoE(LN(h)) (Switch, GShard,
                                                                Base or Hash MoE)

so a token-routed MoE Transformer shares the tMoE layer, the routers, the
head, the sharding rules and the training facts with sMLP, and differs only
in the token mixer. The token mixers are the registry's (``token_mixer``):
any one with a causal mode ('hypermixer', 'linear_attention', ...) builds
the same way as 'attention', positions added unless the mixer handles them. ``smoe_routing`` is unused there (no sMoE, no routing
prefix: the loss counts every position).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from hypermixer_jax.models import common
from hypermixer_jax.models import gmlp as gmlp_lib
from hypermixer_jax.models import registry
from hypermixer_jax.models.moe.smoe import (SparseGatingUnit,
                                            partial_loss_weights,
                                            partial_prefix_len)
from hypermixer_jax.models.moe.tmoe import MoeFeedForward

Array = common.Array


@dataclasses.dataclass(frozen=True)
class TokenMixer:
  """How the family uses a token mixer of the registry (``token_mixer``).

  Attributes:
    mixer: its name in ``registry.MIXERS`` (class and defaults come from
      there).
    block: the registry block (``registry.BLOCKS``) of the dense layers:
      gMLP's own block around a spatial gating unit, else pre-LN.
    smoe: sparse layers mix tokens with the unit's sMoE form (``moe.smoe``:
      spatial experts; partial routing); otherwise with the mixer itself,
      a submodule named after it, and only the feed-forward is sparse.
    positions: sinusoidal positions added to the embeddings, unless the
      mixer tells positions apart itself (``position_aware``, e.g. the
      unit's N x N weights) or adds them (``adds_positions``).
  """
  mixer: str
  block: str
  smoe: bool = False
  positions: bool = False


# The spelling earlier configs (and checkpoints' config.json) used for the
# spatial gating unit; read as 'gmlp'.
LEGACY_NAMES = {"sgu": "gmlp"}


def token_mixer(name: str) -> TokenMixer:
  """``model.token_mixer`` (a registry mixer with a causal mode) as the
  family uses it; a ValueError naming the field and the valid names."""
  name = LEGACY_NAMES.get(name, name)
  causal = [m for m in registry.MIXERS
            if registry.can_be_causal(registry.mixer_class(m))]
  if name not in causal:
    why = ("has no causal mode" if name in registry.MIXERS
           else "is not a registered token mixer")
    raise ValueError(
        f"smlp: model.token_mixer={name!r} {why}; the family is a causal "
        f"language model: use one of {', '.join(causal)}.")
  cls = registry.mixer_class(name)
  unit = issubclass(cls, gmlp_lib.SpatialGatingUnit)
  if unit and registry.MIXERS[name].preset:
    raise ValueError(
        f"smlp: model.token_mixer={name!r} presets the spatial gating unit "
        f"({dict(registry.MIXERS[name].preset)}), which the sparse blocks' "
        "spatial experts (moe.smoe) do not implement; use 'gmlp'.")
  positions = not (registry.adds_positions(name)
                   or getattr(cls, "position_aware", False))
  return TokenMixer(name, block="gmlp" if unit else "pre_ln", smoe=unit,
                    positions=positions)


@dataclasses.dataclass(frozen=True)
class MoeOptions:
  """The MoE settings shared by every sparse block.

  Attributes:
    num_experts: E, for both sMoE and tMoE.
    expert_d_ffn: hidden width of each tMoE expert (default: ``d_ffn``).
    tmoe_router: 'base' (the paper's), 'switch', 'gshard' or 'hash'.
    smoe_routing: 'deterministic' or 'partial' (partial prediction).
    partial_fraction: share of the tokens read by the partial router.
    capacity_factor, eval_capacity_factor: expert slots in training / at
      inference.
    jitter_noise: Switch's router-input noise in training.
    second_expert_policy: GShard's second expert, 'all' or 'random' (the
      paper's random routing; ``moe.tmoe.MoeFeedForward``).
    load_balancing_weight, z_loss_weight: the routers' sown losses.
    dispatch: how tokens (tMoE) and columns (partial sMoE) reach the expert
      slots: 'index' (gather / scatter) or 'einsum' (one-hot tensors).
  """
  num_experts: int = 4
  expert_d_ffn: int | None = None
  tmoe_router: str = "base"
  smoe_routing: str = "deterministic"
  partial_fraction: float = 0.2
  capacity_factor: float = 1.25
  eval_capacity_factor: float = 2.0
  jitter_noise: float = 0.0
  second_expert_policy: str = "all"
  load_balancing_weight: float = 1e-2
  z_loss_weight: float = 1e-3
  dispatch: str = "index"


def mixer_kwargs(token_mixer_name: str, *, d_model: int, d_ffn: int, max_len: int,
                 num_heads: int, dropout_rate: float, **dtypes) -> dict:
  """The causal registry mixer's keyword arguments: its defaults from the
  family's sizes, and the family's ``num_heads`` / ``dropout_rate`` where
  the mixer has them."""
  name = token_mixer(token_mixer_name).mixer
  kwargs = registry.mixer_defaults(name, dict(
      d_model=d_model, d_ffn=d_ffn, max_len=max_len, approximate_gelu=False))
  fields = registry.fields(registry.mixer_class(name))
  kwargs.update({k: v for k, v in dict(
      num_heads=num_heads, dropout_rate=dropout_rate).items() if k in fields})
  return dict(kwargs, causal=True, **dtypes)


def sparse_layer_indices(num_dense: int, num_sparse: int) -> tuple[int, ...]:
  """Depths of the sparse blocks, spread evenly, the last block sparse."""
  total = num_dense + num_sparse
  return tuple(round((j + 1) * total / num_sparse) - 1
               for j in range(num_sparse)) if num_sparse else ()


class SparseBlock(nn.Module):
  """``h + sMoE-SGU(LN(h))`` then ``+ tMoE(LN(.))``, both pre-LN.

  With ``token_mixer='attention'`` the first module is causal multi-head
  self-attention (``num_heads``), submodule ``attention``: the sparse block
  of a token-routed MoE Transformer.
  """
  d_ffn: int
  max_len: int
  moe: MoeOptions = MoeOptions()
  vocab_size: int | None = None
  token_mixer: str = "gmlp"
  num_heads: int = 1
  dropout_rate: float = 0.0
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, *, mask=None, segment_ids=None, positions=None,
               token_ids=None, deterministic=True):
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    o = self.moe
    h = common.LayerNorm(name="mixing_norm", **kw)(x)
    spec = token_mixer(self.token_mixer)
    if not spec.smoe:
      mixer = registry.mixer_class(spec.mixer)
      h = mixer(**mixer_kwargs(
          spec.mixer, d_model=x.shape[-1], d_ffn=self.d_ffn,
          max_len=self.max_len, num_heads=self.num_heads,
          dropout_rate=self.dropout_rate, **kw), name=spec.mixer)(
              h, mask=mask, segment_ids=segment_ids, positions=positions,
              deterministic=deterministic)
    else:
      h = SparseGatingUnit(
          self.d_ffn, self.max_len, num_experts=o.num_experts,
          routing=o.smoe_routing, causal=True,
          partial_fraction=o.partial_fraction,
          capacity_factor=o.capacity_factor,
          eval_capacity_factor=o.eval_capacity_factor,
          load_balancing_weight=o.load_balancing_weight,
          z_loss_weight=o.z_loss_weight, dispatch=o.dispatch,
          dropout_rate=self.dropout_rate, name="smoe", **kw)(
              h, mask=mask, segment_ids=segment_ids, positions=positions,
              deterministic=deterministic)
    h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
    x = x + h.astype(x.dtype)
    h = common.LayerNorm(name="ffn_norm", **kw)(x)
    h = MoeFeedForward(
        o.num_experts, o.expert_d_ffn or self.d_ffn, router=o.tmoe_router,
        capacity_factor=o.capacity_factor,
        eval_capacity_factor=o.eval_capacity_factor,
        jitter_noise=o.jitter_noise,
        second_expert_policy=o.second_expert_policy,
        load_balancing_weight=o.load_balancing_weight,
        z_loss_weight=o.z_loss_weight, token_priority=True,
        dispatch=o.dispatch,
        vocab_size=self.vocab_size, dropout_rate=self.dropout_rate,
        name="tmoe", **kw)(
            h, mask=mask, segment_ids=segment_ids, token_ids=token_ids,
            deterministic=deterministic)
    return x + h.astype(x.dtype)


class SmlpLM(nn.Module):
  """The sMLP causal LM, ``tokens [B, N] -> logits [B, N, vocab]``.

  Attributes mirror ``smlp_config``'s fields (see there).
  """
  vocab_size: int
  d_model: int
  d_ffn: int
  max_len: int
  num_dense_layers: int
  num_sparse_layers: int
  moe: MoeOptions = MoeOptions()
  token_mixer: str = "gmlp"
  num_heads: int = 1
  dropout_rate: float = 0.0
  dtype: common.Dtype = jnp.float32
  param_dtype: common.Dtype = jnp.float32

  @property
  def loss_start(self) -> int:
    """First counted position of an unpadded ``max_len`` row (0 unless partial
    routing). Nonzero means: weight the loss with ``loss_position_weights``,
    which starts each row at max(1, floor(partial_fraction n)) of its own
    length n."""
    if (self.moe.smoe_routing == "partial" and self.num_sparse_layers
        and token_mixer(self.token_mixer).smoe):
      return partial_prefix_len(self.max_len, self.moe.partial_fraction)
    return 0

  def loss_position_weights(self, weights: Array,
                            segment_ids: Array | None = None) -> Array:
    """``weights [B, N]`` zeroed on each row's routing prefix (partial)."""
    if not self.loss_start:
      return weights
    return partial_loss_weights(weights, segment_ids,
                                self.moe.partial_fraction)

  @nn.compact
  def __call__(self, inputs: Array, *, segment_ids: Array | None = None,
               token_type_ids: Array | None = None,
               positions: Array | None = None,
               deterministic: bool = True) -> Array:
    del token_type_ids  # one-sentence language model
    spec = token_mixer(self.token_mixer)
    kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
    embed = nn.Embed(
        self.vocab_size, self.d_model, param_dtype=self.param_dtype,
        dtype=self.dtype,
        embedding_init=common.partitioned(nn.initializers.normal(1.0),
                                          (common.VOCAB, common.EMBED)),
        name="embed")
    x = embed(inputs)                                               # [B, N, d]
    if spec.positions:
      # Attention is permutation-equivariant: it needs positions, the SGU's
      # N x N weights are positional already. Packed rows restart at 0.
      n = inputs.shape[1]
      pos = (jnp.broadcast_to(jnp.arange(n), inputs.shape)
             if positions is None else positions)
      table = common.sinusoidal_positions(max(n, self.max_len), self.d_model)
      x = x + jnp.take(table, pos, axis=0).astype(x.dtype)
    # Zero unless a 'perturbations' collection is given: d logits / d input
    # vectors for the causality tests (Flax's ``Module.perturb``).
    x = self.perturb("embedded", x)
    x = common.constrain(x, (common.BATCH, common.LENGTH, common.EMBED))
    mask = None if segment_ids is None else segment_ids > 0
    sparse = sparse_layer_indices(self.num_dense_layers,
                                  self.num_sparse_layers)
    dense_block = registry.BLOCKS[spec.block](
        spec.mixer, mixer_kwargs(
            spec.mixer, d_model=self.d_model, d_ffn=self.d_ffn,
            max_len=self.max_len, num_heads=self.num_heads,
            dropout_rate=self.dropout_rate, **kw),
        dict(d_ffn=self.d_ffn, block=spec.block,
             dropout_rate=self.dropout_rate, approximate_gelu=False),
        self.dtype, self.param_dtype)
    for i in range(self.num_dense_layers + self.num_sparse_layers):
      if i in sparse:
        x = SparseBlock(
            self.d_ffn, self.max_len, self.moe, vocab_size=self.vocab_size,
            token_mixer=self.token_mixer, num_heads=self.num_heads,
            dropout_rate=self.dropout_rate, name=f"layer_{i}", **kw)(
                x, mask=mask, segment_ids=segment_ids, positions=positions,
                token_ids=inputs, deterministic=deterministic)
      else:
        x = dense_block(name=f"layer_{i}")(
            x, mask=mask, segment_ids=segment_ids, positions=positions,
            deterministic=deterministic)
      x = common.constrain(x, (common.BATCH, common.LENGTH, common.EMBED))
    x = common.LayerNorm(name="final_norm", **kw)(x)
    logits = embed.attend(x) * jnp.asarray(self.d_model ** -0.5, x.dtype)
    return common.constrain(logits.astype(jnp.float32),
                            (common.BATCH, common.LENGTH, common.VOCAB))


# The data pipeline's vocabulary (T5 SentencePiece + 100 extra ids, padded to
# a multiple of 128); ``train.config.TEXT_VOCAB_SIZE`` is the same number
# (the models do not import the training package; a test checks they agree).
PIPELINE_VOCAB_SIZE = 32_128


def smlp_config(size: str = "tiny") -> ml_collections.ConfigDict:
  """Model config of the sMLP LM: ``family='smlp'``, the sizes, ``moe``.

  ``base``: the paper's main setting (Sec. 4.3, ~0.8 TFLOPs): d=1024,
  d_ffn=4096, Base Layers tMoE, deterministic sMoE. The depths (N1=12,
  N2=4), 16 experts and T=1024 are our choice: the paper text at hand does
  not give them. Its vocabulary is the one the data pipeline emits, the T5
  SentencePiece model's 32,000 pieces + 100 extra ids padded to 32,128
  (``train.config.TEXT_VOCAB_SIZE``; the paper's GPT-2 BPE is not available
  to the pipeline). ``tiny``: the same structure scaled down for model tests
  on synthetic ids (vocab 64, d=16, d_ffn=32, T=20, 4 experts, one dense and
  one sparse block); ``configs/smlp_lm.py:tiny`` gives it the pipeline's
  vocabulary for runs on real text.

  ``token_mixer``: a registry mixer with a causal mode (``token_mixer``):
  'gmlp' (sMLP; gMLP when N2 = 0; 'sgu' in earlier configs), 'attention' (a
  causal Transformer; with N2 > 0 a token-routed MoE Transformer, router
  ``moe.tmoe_router``), or another one ('hypermixer', 'linear_attention',
  ...) in pre-LN blocks with tMoE feed-forwards in the sparse ones;
  ``num_heads``: attention heads (head width 64 in ``base``), used by the
  mixers that have heads.
  """
  if size == "base":
    d, f, n, vocab, n1, n2, e, h = (1024, 4096, 1024, PIPELINE_VOCAB_SIZE,
                                    12, 4, 16, 16)
  elif size == "tiny":
    d, f, n, vocab, n1, n2, e, h = 16, 32, 20, 64, 1, 1, 4, 2
  else:
    raise ValueError(f"smlp_config: size={size!r}, expected 'tiny' or 'base'.")
  moe = dataclasses.asdict(MoeOptions(num_experts=e, expert_d_ffn=f))
  return ml_collections.ConfigDict(dict(
      family="smlp", vocab_size=vocab, d_model=d, d_ffn=f, max_len=n,
      num_dense_layers=n1, num_sparse_layers=n2, token_mixer="gmlp",
      num_heads=h, dropout_rate=0.0, dtype="auto", param_dtype="float32",
      moe=moe))


def default_config() -> ml_collections.ConfigDict:
  """The family's fields, with the ``base`` sizes."""
  return smlp_config("base")


def _options(cfg: Mapping[str, Any]) -> MoeOptions:
  given = dict(cfg.get("moe") or {})
  fields = {f.name for f in dataclasses.fields(MoeOptions)}
  unknown = sorted(set(given) - fields)
  if unknown:
    raise ValueError(f"smlp: unknown model.moe fields {unknown}; valid: "
                     f"{', '.join(sorted(fields))}.")
  return MoeOptions(**given)


def build(cfg: Mapping[str, Any]) -> SmlpLM:
  """``SmlpLM`` from the family's fields (``smlp_config``)."""
  token_mixer(cfg["token_mixer"])
  return SmlpLM(
      vocab_size=cfg["vocab_size"], d_model=cfg["d_model"],
      d_ffn=cfg["d_ffn"], max_len=cfg["max_len"],
      num_dense_layers=cfg["num_dense_layers"],
      num_sparse_layers=cfg["num_sparse_layers"], moe=_options(cfg),
      token_mixer=cfg["token_mixer"], num_heads=cfg["num_heads"],
      dropout_rate=cfg["dropout_rate"], dtype=common.dtype(cfg["dtype"]),
      param_dtype=common.dtype(cfg["param_dtype"]))


def facts(cfg: Mapping[str, Any]) -> common.ModelFacts:
  """A causal LM; with partial routing each row's loss starts after its
  routing prefix (``loss_position_weights``) and it cannot pack (the router
  reads the first tokens of the row)."""
  model = build(cfg)
  if not model.loss_start:
    return common.ModelFacts(head="causal_lm")
  return common.ModelFacts(
      head="causal_lm", loss_start=model.loss_start,
      loss_weights=model.loss_position_weights,
      packing_error=(
          "model.moe.smoe_routing='partial' routes each row by its first "
          f"{model.moe.partial_fraction:.0%} of tokens, which packed rows "
          "(several examples) do not have; "
          "set --config.data.packing=False or use "
          "--config.model.moe.smoe_routing=deterministic."))
