"""Packed batches from the pipeline through every token mixer: the outputs of
each packed segment equal those of its example alone (nothing mixes across
segments, and positions restart in each segment)."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax import data
from hypermixer_jax.data import testing

N, D = 48, 6  # sequence length and width


def _mixer(module, cls, **kw):
  try:
    mod = importlib.import_module(f"hypermixer_jax.models.{module}")
  except ImportError:
    pytest.skip(f"hypermixer_jax.models.{module} does not exist yet")
  return getattr(mod, cls)(**kw)


MIXERS = {
    "hypermixer": lambda k: _mixer("hypermixer", "HyperMixing", hyper_dim=5,
                                   max_len=N, max_segments=k),
    "mlp_mixer": lambda k: _mixer("mlp_mixer", "MlpMixerTokenMixing",
                                  max_len=N, token_mlp_dim=7, max_segments=k),
    "gmlp": lambda k: _mixer("gmlp", "SpatialGatingUnit", d_ffn=10, max_len=N),
    "gmlp_causal": lambda k: _mixer("gmlp", "SpatialGatingUnit", d_ffn=10,
                                    max_len=N, causal=True),
    "attention": lambda k: _mixer("attention", "SelfAttention", num_heads=2),
    "linear_attention": lambda k: _mixer("attention", "LinearAttention",
                                         num_heads=2),
    "fnet": lambda k: _mixer("fnet", "FourierMixing"),
}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
  root = tmp_path_factory.mktemp("packing")
  cfg = data.default_data_config()
  cfg.update(task="c4_mlm", vocab_path=testing.tiny_vocab(str(root / "v")),
             seq_len=N, packing=True)
  # Short documents, so that rows hold several of them and some padding.
  cfg.local_files = {"train": testing.write_corpus(str(root / "c4"),
                                                   num_files=1,
                                                   docs_per_file=24,
                                                   max_words=12)}
  batch = next(iter(data.build_pipeline(cfg, "train", batch_size=3, seed=0,
                                        repeat=False, shuffle=False)))
  assert batch["segment_ids"].max() >= 2, "the test needs packed rows"
  table = np.random.default_rng(0).normal(size=(300, D)).astype(np.float32)
  return table[batch["inputs"]], batch["segment_ids"], batch["positions"]


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_segments_do_not_mix(packed, name):
  x, seg, pos = packed
  mixer = MIXERS[name](int(seg.max()))
  params = mixer.init(jax.random.key(0), jnp.asarray(x),
                      segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos))
  apply = jax.jit(lambda x, s, p: mixer.apply(params, x, segment_ids=s,
                                              positions=p))
  y = np.asarray(apply(x, seg, pos))
  alone_x, alone_seg, where = [], [], []
  for row in range(x.shape[0]):
    for s in range(1, seg[row].max() + 1):
      idx = np.flatnonzero(seg[row] == s)
      xa = np.zeros_like(x[row])
      xa[:len(idx)] = x[row, idx]
      alone_x.append(xa)
      alone_seg.append((np.arange(N) < len(idx)).astype(np.int32))
      where.append((row, idx))
  alone_seg = np.stack(alone_seg)
  y_alone = np.asarray(apply(np.stack(alone_x), alone_seg,
                             np.arange(N)[None] * alone_seg))
  for i, (row, idx) in enumerate(where):
    np.testing.assert_allclose(y[row, idx], y_alone[i, :len(idx)],
                               rtol=2e-4, atol=2e-5, err_msg=name)
