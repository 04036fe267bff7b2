"""tMoE / sMoE layers: expert-parallel (8 fake devices) == dense == loops."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hypermixer_jax.models.moe import (MoeFeedForward, SparseGatingUnit,
                                       SparseSpatialMixing, routers)

B, N, D, F, E = 8, 12, 5, 7, 4          # N % E == 0 for Base Layers
RULES = [("batch", ("data", "fsdp")), ("expert", "expert"),
         ("embed", None), ("mlp", None), ("seq_in", None), ("seq_out", None),
         ("norm", None), ("length", None)]
COLLECTIONS = ["aux_loss", "moe_metrics"]


def _mesh():
  # 4-way data x 2-way expert: two experts per device; the batch rule does not
  # name 'expert', the layer adds it to the group axes itself.
  return jax.make_mesh((4, 1, 1, 2), ("data", "fsdp", "tensor", "expert"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)


def _inputs():
  x = jax.random.normal(jax.random.key(0), (B, N, D))
  ids = jax.random.randint(jax.random.key(1), (B, N), 0, 37)
  seg = np.ones((B, N), np.int32)
  seg[1, 9:] = 0                                          # some padding
  seg[2, 5:] = 2                                          # a packed row
  return x, ids, jnp.asarray(seg)


def _gelu(x):
  return np.asarray(jax.nn.gelu(jnp.asarray(x), approximate=False))


def _tmoe_reference(params, x, combine):
  """y[b,t] = sum_e g[b,t,e] FFN_e(x[b,t]) by plain per-expert matmuls."""
  p = jax.tree.map(np.asarray, params)
  gate = np.asarray(combine).sum(-1)                       # [B, N, E]
  y = np.zeros(x.shape)
  for e in range(E):
    h = _gelu(np.asarray(x) @ p["wi"][e] + p["bi"][e])
    y += gate[..., e:e + 1] * (h @ p["wo"][e] + p["bo"][e])
  return y


def _switch_gates_numpy(params, x, seg, cf):
  """Switch routing written out: per row, each real token in order takes
  its argmax expert's next slot (``ceil(N cf / E)`` of them), gate = that
  expert's softmax probability; padding and overflow get nothing."""
  x, w = np.asarray(x, np.float64), np.asarray(
      params["router"]["dense"]["kernel"], np.float64)
  cap = max(1, int(np.ceil(N * cf / E)))
  gates = np.zeros((B, N, E))
  for b in range(B):
    logits = x[b] @ w
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    used = np.zeros(E, int)
    for t in range(N):
      e = int(np.argmax(probs[t]))
      if seg[b, t] > 0 and used[e] < cap:
        gates[b, t, e] = probs[t, e]
        used[e] += 1
  return gates


def _route_combine(layer, params, x, ids, seg, deterministic):
  """The combine tensor the layer uses, recomputed from the router."""
  mask = seg > 0
  if layer.router == "hash":
    logits = None
  else:
    logits = x @ params["router"]["dense"]["kernel"]
  routes, _, cap = layer._route(x, logits, mask, ids, deterministic)
  return jax.vmap(lambda r: routers.dense(r, E, cap)[1])(routes)


@pytest.mark.parametrize("router", ["switch", "gshard", "base", "hash"])
@pytest.mark.parametrize("cf", [0.5, 4.0], ids=["dropping", "no_drop"])
def test_tmoe_expert_parallel_equals_dense_reference(router, cf):
  x, ids, seg = _inputs()
  layer = MoeFeedForward(E, F, router=router, capacity_factor=cf,
                         vocab_size=37)
  params = nn.unbox(layer.init(jax.random.key(2), x, token_ids=ids)["params"])
  fwd = jax.jit(lambda p, x: layer.apply(
      {"params": p}, x, segment_ids=seg, token_ids=ids, deterministic=False,
      mutable=COLLECTIONS))
  y_dense, aux_dense = fwd(params, x)
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES):
    y_ep, aux_ep = fwd(params, x)
    if cf == 0.5 and router == "switch":
      hlo = fwd.lower(params, x).compile().as_text()
      assert "all-to-all" in hlo
  combine = _route_combine(layer, params, x, ids, seg, False)
  want = _tmoe_reference(params, x, combine)
  np.testing.assert_allclose(y_dense, want, rtol=1e-5, atol=1e-5)
  if router == "switch":   # the routing itself, written out in NumPy
    gates = _switch_gates_numpy(params, x, np.asarray(seg), cf)
    np.testing.assert_allclose(np.asarray(combine).sum(-1), gates,
                               rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(y_ep, y_dense, rtol=1e-6, atol=1e-6)
  jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
      aux_dense, aux_ep)
  dropped = float(aux_dense["moe_metrics"]["dropped_fraction"][0])
  assert (dropped > 0) == (cf == 0.5 and router != "base")
  # Padding tokens produce nothing, dropped tokens produce nothing.
  np.testing.assert_allclose(y_dense[1, 9:], 0.0, atol=1e-7)


def test_gshard_random_routing_in_training_only():
  x, _, seg = _inputs()
  kw = dict(router="gshard", capacity_factor=4.0)
  rand = MoeFeedForward(E, F, second_expert_policy="random", **kw)
  every = MoeFeedForward(E, F, **kw)
  params = nn.unbox(rand.init(jax.random.key(2), x)["params"])

  def fwd(layer, key, deterministic):
    return jax.jit(lambda p, x: layer.apply(
        {"params": p}, x, segment_ids=seg, deterministic=deterministic,
        rngs={"dropout": key}, mutable=COLLECTIONS))(params, x)
  # At inference every second choice asks: the same outputs as 'all'.
  np.testing.assert_allclose(fwd(rand, jax.random.key(0), True)[0],
                             fwd(every, jax.random.key(0), True)[0],
                             rtol=1e-6, atol=1e-7)
  y0, aux0 = fwd(rand, jax.random.key(0), False)
  y1, _ = fwd(rand, jax.random.key(1), False)
  y_all, _ = fwd(every, jax.random.key(0), False)
  # In training the draws change which second experts run (no slot is
  # short at cf = 4, so nothing else differs).
  assert not np.allclose(y0, y1) and not np.allclose(y0, y_all)
  assert float(aux0["moe_metrics"]["dropped_fraction"][0]) == 0.0
  # Expert parallelism draws the same routes.
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES):
    y_ep, _ = fwd(rand, jax.random.key(0), False)
  np.testing.assert_allclose(y_ep, y0, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="second_expert_policy='sample'"):
    MoeFeedForward(E, F, router="gshard", second_expert_policy="sample").init(
        jax.random.key(0), x)
  with pytest.raises(ValueError, match="router='switch' has one expert a "
                     "token: leave it at 'all'"):
    MoeFeedForward(E, F, router="switch", second_expert_policy="random").init(
        jax.random.key(0), x)


def test_tmoe_gradients_expert_parallel_equal_dense():
  x, ids, seg = _inputs()
  layer = MoeFeedForward(E, F, router="switch", capacity_factor=1.0)
  params = nn.unbox(layer.init(jax.random.key(2), x)["params"])

  def loss(p, x):
    y, aux = layer.apply({"params": p}, x, segment_ids=seg,
                         deterministic=False, mutable=COLLECTIONS)
    return jnp.sum(y ** 2) + sum(jax.tree.leaves(aux["aux_loss"]))
  grad = jax.jit(jax.grad(loss))
  g_dense = grad(params, x)
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES):
    g_ep = grad(params, x)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6), g_dense, g_ep)
  assert float(jnp.abs(g_dense["router"]["dense"]["kernel"]).sum()) > 0


def test_tmoe_sharded_init_puts_experts_on_expert_axis():
  x, _, _ = _inputs()
  layer = MoeFeedForward(E, F, router="switch")
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES):
    abstract = jax.eval_shape(lambda k: layer.init(k, x), jax.random.key(0))
    specs = nn.get_partition_spec(abstract)
    shardings = nn.logical_to_mesh_sharding(specs, _mesh(), RULES)
    v = jax.jit(lambda k: layer.init(k, x), out_shardings=shardings)(
        jax.random.key(0))
  params = nn.unbox(v)["params"]
  for name in ("wi", "wo", "bi", "bo"):
    spec = tuple(params[name].sharding.spec)
    assert spec[0] == "expert" and all(a is None for a in spec[1:]), spec
    assert params[name].addressable_shards[0].data.shape[0] == E // 2
  assert all(a is None for a in params["router"]["dense"]["kernel"]
             .sharding.spec)


def test_tmoe_metrics_and_losses_are_sown():
  x, ids, seg = _inputs()
  layer = MoeFeedForward(E, F, router="switch", capacity_factor=1.0,
                         jitter_noise=0.1)
  params = nn.unbox(layer.init(jax.random.key(2), x)["params"])
  _, aux = layer.apply({"params": params}, x, segment_ids=seg,
                       deterministic=False, mutable=COLLECTIONS,
                       rngs={"dropout": jax.random.key(3)})
  m = aux["moe_metrics"]
  assert set(m) == {"expert_usage", "dropped_fraction", "load_balancing_loss",
                    "z_loss", "router_confidence", "router_entropy"}
  assert m["expert_usage"][0].shape == (E,)
  np.testing.assert_allclose(np.sum(m["expert_usage"][0]),
                             1 - m["dropped_fraction"][0], rtol=1e-5)
  np.testing.assert_allclose(aux["aux_loss"]["load_balancing_loss"][0],
                             1e-2 * m["load_balancing_loss"][0], rtol=1e-6)


def test_tmoe_router_statistics_written_out():
  """Each row (a routing group) over its real tokens, then the mean over
  rows: softmax probabilities p = softmax(x W_r); confidence = mean max p,
  entropy = mean -sum p log p, z-loss = mean logsumexp^2, Switch's load
  balancing E sum_e f_e P_e (f: share of first choices, P: mean p); the
  sown losses are the statistics times their weights."""
  x, ids, seg = _inputs()
  layer = MoeFeedForward(E, F, router="switch", capacity_factor=1.0,
                         load_balancing_weight=1e-2, z_loss_weight=1e-3)
  params = nn.unbox(layer.init(jax.random.key(2), x)["params"])
  _, aux = layer.apply({"params": params}, x, segment_ids=seg,
                       deterministic=False, mutable=COLLECTIONS)
  m = {k: np.asarray(v[0]) for k, v in aux["moe_metrics"].items()}
  w = np.asarray(params["router"]["dense"]["kernel"], np.float64)
  rows = {k: [] for k in ("router_confidence", "router_entropy", "z_loss",
                          "load_balancing_loss")}
  for b in range(B):
    real = np.asarray(seg[b]) > 0
    logits = np.asarray(x[b], np.float64)[real] @ w
    z = np.log(np.exp(logits).sum(-1))
    p = np.exp(logits - z[:, None])
    rows["router_confidence"].append(p.max(-1).mean())
    rows["router_entropy"].append((-(p * np.log(p)).sum(-1)).mean())
    rows["z_loss"].append((z ** 2).mean())
    f = np.bincount(p.argmax(-1), minlength=E) / len(p)
    rows["load_balancing_loss"].append(E * np.sum(f * p.mean(0)))
  for k, v in rows.items():
    np.testing.assert_allclose(m[k], np.mean(v), rtol=1e-4, err_msg=k)
  np.testing.assert_allclose(aux["aux_loss"]["load_balancing_loss"][0],
                             1e-2 * np.mean(rows["load_balancing_loss"]),
                             rtol=1e-4)
  np.testing.assert_allclose(aux["aux_loss"]["z_loss"][0],
                             1e-3 * np.mean(rows["z_loss"]), rtol=1e-4)


def _smoe_reference(params, v, routing, seg=None, pos=None, cap=None,
                    fraction=0.2):
  """f(V) by loops over rows, columns and output positions.

  Deterministic: W_e [T, T] over the whole column (packed rows: W[pos, pos],
  zero across segments). Partial prediction, the paper's definition (Yu et
  al. 2022, Sec. 3.2) written independently of the layer: per row of actual
  length n, X1 = the first s = max(1, floor(0.2 n)) tokens decide the expert
  by softmax(V1^T W_r[:s]); the expert's SGU mixes X2 = the other n - s
  tokens as a sequence of its own (W_e[:n-s, :n-s], lower triangular);
  f = 1 on X1. Only the real positions of each row are defined.
  """
  w = np.tril(np.asarray(params["kernel"], np.float64))
  bias = np.asarray(params["bias"], np.float64)
  v = np.asarray(v, np.float64)
  b, n, h = v.shape
  seg = np.ones((b, n), int) if seg is None else np.asarray(seg)
  pos = np.tile(np.arange(n), (b, 1)) if pos is None else np.asarray(pos)
  v = np.where(seg[..., None] > 0, v, 0.0)
  out = np.full((b, n, h), np.nan)
  if routing == "deterministic":
    for r in range(b):
      for j in range(h):
        e = j // (h // E)
        for t in range(n):
          acc = bias[e, pos[r, t]]
          for u in range(n):
            if seg[r, u] == seg[r, t]:
              acc += w[e, pos[r, t], pos[r, u]] * v[r, u, j]
          out[r, t, j] = acc
    return out
  w_r = np.asarray(params["router"], np.float64)
  for r in range(b):
    length = int(np.sum(seg[r] > 0))
    s = max(1, int(np.floor(fraction * length + 1e-9)))
    v1, v2 = v[r, :s], v[r, s:length]                     # X1, X2
    logits = v1.T @ w_r[:s]                               # [H, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expert, gate = probs.argmax(-1), probs.max(-1)
    count = np.zeros(E, int)
    for j in range(h):                                    # capacity
      if count[expert[j]] >= cap:
        gate[j] = 0.0
      count[expert[j]] += 1
    m = length - s
    for j in range(h):
      e = expert[j]
      out[r, :s, j] = 1.0
      out[r, s:length, j] = gate[j] * (w[e, :m, :m] @ v2[:, j] + bias[e, :m])
  return out


@pytest.mark.parametrize("routing, rows", [
    ("deterministic", "plain"), ("deterministic", "packed"),
    ("partial", "plain"), ("partial", "padded")])
def test_smoe_expert_parallel_equals_dense_and_loops(routing, rows):
  b, n, h, L = B, 11, 12, 13
  v = jax.random.normal(jax.random.key(4), (b, n, h))
  layer = SparseSpatialMixing(E, L, routing=routing, init_scale=3.0,
                              capacity_factor=1.0)
  params = nn.unbox(layer.init(jax.random.key(5), v)["params"])
  kw = {}
  if rows == "packed":
    seg = np.ones((b, n), np.int32)
    seg[:, 7:] = 2
    seg[3, 10:] = 0
    pos = np.where(seg == 2, np.arange(n) - 7, np.arange(n))
    pos[3, 10:] = 0
    kw = dict(segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos))
  if rows == "padded":                 # actual lengths 11, 10, ..., 4
    seg = (np.arange(n)[None, :] < (n - np.arange(b))[:, None]).astype(
        np.int32)
    kw = dict(segment_ids=jnp.asarray(seg))
  fwd = jax.jit(lambda p, v: layer.apply({"params": p}, v,
                                         deterministic=False, **kw))
  f_dense = fwd(params, v)
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES):
    f_ep = fwd(params, v)
    if rows != "plain":
      assert "all-to-all" in fwd.lower(params, v).compile().as_text()
  np.testing.assert_allclose(f_ep, f_dense, rtol=1e-5, atol=1e-6)
  cap = routers.expert_capacity(h, E, 1.0)
  want = _smoe_reference(params, v, routing, kw.get("segment_ids"),
                         kw.get("positions"), cap)
  real = ~np.isnan(want)
  np.testing.assert_allclose(np.asarray(f_dense)[real], want[real],
                             rtol=1e-4, atol=1e-5)
  if routing == "partial" and rows == "plain":
    # Some columns are dropped by the capacity: they produce 0 after s.
    s = layer.prefix_len
    assert np.any(np.all(np.asarray(f_dense)[:, s:] == 0, axis=1))


def test_smoe_partial_experts_are_sized_for_the_predicted_part():
  layer = SparseSpatialMixing(E, 20, routing="partial")
  v = jnp.ones((1, 20, 8))
  p = nn.unbox(layer.init(jax.random.key(0), v)["params"])
  # T = 20: the router reads 0.2 T = 4 tokens, experts mix the other 16.
  assert p["router"].shape == (4, E)
  assert p["kernel"].shape == (E, 16, 16) and p["bias"].shape == (E, 16)
  det = SparseSpatialMixing(E, 20, routing="deterministic")
  assert nn.unbox(det.init(jax.random.key(0), v)["params"])[
      "kernel"].shape == (E, 20, 20)


def test_smoe_partial_padded_rows_equal_unpadded_rows():
  # The prefix is 20% of the ACTUAL length: a row of 10 real tokens padded to
  # max_len = 20 routes by its first 2 tokens, exactly as the unpadded row.
  h, L = 8, 20
  layer = SparseSpatialMixing(E, L, routing="partial", init_scale=3.0)
  v = jax.random.normal(jax.random.key(1), (3, L, h))
  params = nn.unbox(layer.init(jax.random.key(2), v)["params"])
  # Jitted: one program for the padded rows, one per unpadded length (op by
  # op, each new shape compiles every op again).
  fwd = jax.jit(lambda v, kw: layer.apply({"params": params}, v, **kw))
  for length in (10, 14, 19):
    seg = (jnp.arange(L) < length).astype(jnp.int32)[None].repeat(3, 0)
    padded = fwd(v, dict(segment_ids=seg))[:, :length]
    alone = fwd(v[:, :length], {})
    np.testing.assert_allclose(padded, alone, rtol=1e-6, atol=1e-6,
                               err_msg=f"length {length}")
    # ... and the first floor(0.2 n) positions are X1 (f = 1), not 0.2 T.
    s = length // 5
    np.testing.assert_array_equal(np.asarray(alone)[:, :s], 1.0)
    assert np.all(np.asarray(alone)[:, s] != 1.0)


def test_smoe_partial_prefix_is_exact_integer_arithmetic():
  from hypermixer_jax.models.moe import partial_prefix_len
  lengths = np.arange(1, 400)
  for frac in (0.2, 0.3, 0.7, 0.29):
    dyn = np.asarray(partial_prefix_len(jnp.asarray(lengths), frac))
    want = [max(1, int(np.floor(frac * n + 1e-9))) for n in lengths]
    np.testing.assert_array_equal(dyn, want, err_msg=str(frac))
    assert [partial_prefix_len(int(n), frac) for n in lengths] == want
  with pytest.raises(ValueError, match="partial_fraction=1.5"):
    partial_prefix_len(10, 1.5)


@pytest.mark.parametrize("padded", [False, True])
def test_smoe_partial_is_causal_by_jacobian(padded):
  h, n = 6, 12
  layer = SparseSpatialMixing(E, n, routing="partial", init_scale=3.0,
                              capacity_factor=4.0)
  v = jax.random.normal(jax.random.key(3), (1, n, h))
  params = nn.unbox(layer.init(jax.random.key(4), v)["params"])
  kw = {}
  if padded:
    kw = dict(segment_ids=(jnp.arange(n) < 9).astype(jnp.int32)[None])
  jac = jax.jit(jax.jacfwd(lambda x: layer.apply({"params": params}, x,
                                                  **kw)))(v)
  jac = np.abs(np.asarray(jac)[0, :, :, 0]).max(axis=(1, 3))   # [t, u]
  length = 9 if padded else n
  jac = jac[:length, :length]
  assert np.all(np.triu(jac, 1) == 0), np.triu(jac, 1)
  # X2 positions read their own past in X2 and the routing prefix X1.
  s = length // 5
  assert np.all(np.diag(jac)[s:] > 0)
  assert np.all(jac[s:, :s] > 0)
  assert np.all(jac[:s] == 0)                              # X1: f = 1


def test_sparse_gating_unit_expert_parallel_equals_dense():
  x = jax.random.normal(jax.random.key(6), (B, 10, 6))
  sgu = SparseGatingUnit(d_ffn=16, max_len=10, num_experts=E,
                         routing="partial")
  params = nn.unbox(sgu.init(jax.random.key(7), x)["params"])
  fwd = jax.jit(lambda p, x: sgu.apply({"params": p}, x, mutable=COLLECTIONS))
  y0, m0 = fwd(params, x)
  with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES):
    y1, m1 = fwd(params, x)
  np.testing.assert_allclose(y0, y1, rtol=1e-5, atol=1e-6)
  assert "router_confidence" in m0["moe_metrics"]["spatial"]
  # Written out: (GELU(x U) -> Z1 * f(LN(Z2))) V, f the loop reference of
  # partial-prediction routing (inference: capacity ceil(8 x 2.0 / E)).
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  z = _gelu(np.asarray(x, np.float64) @ p["proj_in"]["dense"]["kernel"]
            + p["proj_in"]["dense"]["bias"])
  z1, z2 = z[..., :8], z[..., 8:]
  mu, var = z2.mean(-1, keepdims=True), z2.var(-1, keepdims=True)
  z2 = ((z2 - mu) / np.sqrt(var + 1e-6) * p["norm"]["ln"]["scale"]
        + p["norm"]["ln"]["bias"])
  f = _smoe_reference(p["spatial"], z2, "partial",
                      cap=int(np.ceil(8 * 2.0 / E)))
  want = (z1 * f) @ p["proj_out"]["dense"]["kernel"] + p["proj_out"][
      "dense"]["bias"]
  np.testing.assert_allclose(y0, want, rtol=1e-4, atol=1e-5)


def test_experts_that_do_not_divide_over_the_mesh_name_the_fix():
  # 8 devices on the expert axis for E experts: a configuration error that
  # main.py stops with in one line (not a traceback), naming a mesh that fits.
  from hypermixer_jax.models.moe import tmoe  # pylint: disable=g-import-not-at-top
  from hypermixer_jax.train import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  x, _, seg = _inputs()
  layer = MoeFeedForward(E, F, router="switch")
  params = nn.unbox(layer.init(jax.random.key(2), x)["params"])
  mesh = jax.make_mesh((1, 1, 1, 8), ("data", "fsdp", "tensor", "expert"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    with pytest.raises(tmoe.ExpertMeshError, match=(
        f"^expert parallelism: {E} experts must divide by the mesh's 'expert' "
        rf"size 8; pass --config.mesh.expert={E} \(it divides the experts "
        r"and the devices\) and let one axis take the other devices "
        r"\(its size -1\)\.")) as e:
      jax.jit(lambda p, x: layer.apply({"params": p}, x, segment_ids=seg,
                                       mutable=COLLECTIONS))(params, x)
  assert isinstance(e.value, workdir_lib.user_errors())
  # The one line main.py prints (JAX's note on the traceback is a PEP 678
  # note, which pytest's match reads but str() does not).
  assert "\n" not in str(e.value)
