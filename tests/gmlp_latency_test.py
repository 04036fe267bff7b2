"""experiments/gmlp_latency.py: the timing loop, the variants, the table."""

import jax
import numpy as np
import pytest


from hypermixer_jax.models import zoo

import script_modules

gmlp_latency = script_modules.load("experiments/gmlp_latency.py")

TOY = {"small": ((2, 16, 32), (1, 16, 32))}

# Each model config is traced once for this module: parameters are counted
# with and without the token table, at paper size too.
pytestmark = pytest.mark.usefixtures("models_traced_once")


class FakeClock:
  """perf_counter stand-in: call k of the forward takes ``durations[k]``."""

  def __init__(self, durations):
    self.durations = list(durations)
    self.now, self.started = 0.0, False

  def __call__(self):
    if self.started:                 # end of a call: advance by its duration
      self.now += self.durations.pop(0)
    self.started = not self.started
    return self.now


def test_measure_times_each_call_after_the_warm_up():
  c = gmlp_latency.model_config("gmlp_fft", 8, sizes=TOY)
  out = gmlp_latency.measure(c, repeats=3,
                             clock=FakeClock([5.0, 0.003, 0.001, 0.002]))
  assert out["compile_s"] == pytest.approx(5.0)
  np.testing.assert_allclose(out["times_ms"], [3.0, 1.0, 2.0])
  assert out["median_ms"] == pytest.approx(2.0)
  assert out["min_ms"] == pytest.approx(1.0)
  assert out["length"] == 8 and out["batch"] == 1
  # Parameters counted from the model, the token table apart.
  assert out["params"] == zoo.count_params(c)
  assert out["params"] - out["params_non_embedding"] == (
      gmlp_latency.VOCAB * 16)


def test_measure_keeps_timing_until_min_seconds():
  c = gmlp_latency.model_config("gmlp_dense", 8, sizes=TOY)
  out = gmlp_latency.measure(c, repeats=1, min_seconds=0.0035,
                             clock=FakeClock([1.0] + [0.001] * 10))
  assert len(out["times_ms"]) == 4
  with pytest.raises(ValueError, match="repeats=0"):
    gmlp_latency.measure(c, repeats=0)


def _forward(config, params=None):
  from hypermixer_jax import models  # pylint: disable=g-import-not-at-top
  model = models.build_model(config)
  x = jax.random.randint(jax.random.key(0), (2, config.max_len), 1, 100)
  if params is None:
    # Jitted: op by op, each of the model's operations compiles on its own.
    params = jax.jit(model.init)(jax.random.key(1), x)["params"]
  fn = lambda p: model.apply({"params": p}, x, deterministic=True)
  return params, jax.jit(fn)(params), str(jax.make_jaxpr(fn)(params))


def test_variants_compute_what_their_names_say():
  n = 12
  fft_cfg = gmlp_latency.model_config("gmlp_fft", n, sizes=TOY)
  params, y_fft, jaxpr_fft = _forward(fft_cfg)
  assert "fft" in jaxpr_fft                 # the FFT path is really taken
  # ... and it is the Toeplitz product: the same weights through the
  # gathered Toeplitz matrix give the same logits.
  toeplitz = gmlp_latency.model_config("gmlp_fft", n, sizes=TOY)
  toeplitz.mixer_kwargs.use_fft = False
  _, y_mat, jaxpr_mat = _forward(toeplitz, params)
  assert "fft" not in jaxpr_mat
  np.testing.assert_allclose(y_fft, y_mat, rtol=1e-4, atol=1e-5)
  dense = gmlp_latency.model_config("gmlp_dense", n, sizes=TOY)
  p_dense, _, jaxpr_dense = _forward(dense)
  assert "fft" not in jaxpr_dense
  kernels = [np.shape(x) for x in jax.tree.leaves(p_dense)]
  assert kernels.count((n, n)) == 2         # a dense N x N W per layer
  assert (2 * n - 1,) not in kernels
  tf = gmlp_latency.model_config("transformer", n)
  assert (tf.mixer, tf.num_layers, tf.mixer_kwargs.num_heads) == (
      "attention", 1, 6)
  with pytest.raises(ValueError, match="variant 'mlp'"):
    gmlp_latency.model_config("mlp", n)


def test_small_scale_keeps_the_papers_pairing():
  # Without token embeddings (and spatial weights), 3 gMLP layers hold about
  # the parameters of 1 Transformer layer, as 36 do of BERT-base's 12.
  for scale in ("small", "paper"):
    counts = {}
    for v in ("gmlp_fft", "transformer"):
      c = gmlp_latency.model_config(v, 32, scale)
      counts[v] = zoo.count_params(c) - zoo.count_params(c, "token_embed")
    assert counts["gmlp_fft"] / counts["transformer"] == pytest.approx(
        1.0, abs=0.06), (scale, counts)


def test_table_rows_put_the_paper_beside_ours():
  runs = {"gmlp_dense/n32": {"median_ms": 2.5, "min_ms": 2.0},
          "transformer/n32": {"median_ms": 4.0, "min_ms": 3.5}}
  rows = gmlp_latency.table_rows(runs, [32, 100])
  assert rows[0] == [32, "2.5 (2)", "-", "4 (3.5)", 13]
  assert rows[1] == [100, "-", "-", "-", "-"]


def test_measure_many_alternates_the_models():
  cfgs = {v: gmlp_latency.model_config(v, 8, sizes=TOY)
          for v in ("gmlp_dense", "gmlp_fft")}
  # Compiles first (dense 4 s, fft 2 s), then rounds: dense, fft, dense, fft.
  out = gmlp_latency.measure_many(
      cfgs, repeats=2, clock=FakeClock([4.0, 2.0, 0.010, 0.020, 0.011, 0.021]))
  assert out["gmlp_dense"]["compile_s"] == pytest.approx(4.0)
  assert out["gmlp_fft"]["compile_s"] == pytest.approx(2.0)
  np.testing.assert_allclose(out["gmlp_dense"]["times_ms"], [10.0, 11.0])
  np.testing.assert_allclose(out["gmlp_fft"]["times_ms"], [20.0, 21.0])
  assert out["gmlp_fft"]["median_ms"] == pytest.approx(20.5)
