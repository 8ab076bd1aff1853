"""The Mamba-3 layer (model/mamba3.py) against a sequential float64 reference of the
whole mixer written here from mamba_ssm's `modules/mamba3.py` and its step references
(one position at a time: mamba_ssm's in_proj layout, A, dt, the trapezoid, B/C norms and
biases, the cumulative angle and the rotation of each layout, D, the gate or output norm,
MIMO's projections); packed documents against each document alone; cached decoding
against the full forward; a few training steps; 8 simulated devices against one.

Tiny shapes (d_model 16, 8 heads of 4, d_state 8) and few compiles: each case is one
float64 value-and-gradient compile of the layer and one of the reference.
"""

import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mamba_train.model import mamba3, params as params_lib
from mamba_train.model.config import Mamba2Config
from mamba_train.model.runtime import Runtime

from helpers import rel

L, Q = 11, 4  # ragged: two whole chunks and a tail, so the look-ahead crosses chunk edges
RT = Runtime(ssd_form="parallel", ssd_impl="xla", parallel_chunk_size=Q).resolve("cpu")


def _cfg(**kw):
  base = dict(d_model=16, n_layer=2, d_state=8, headdim=4, chunk_size=Q, vocab_size=64, layer_pattern="33")
  return Mamba2Config(**{**base, **kw})


def _params(cfg, seed, dtype=np.float64):
  """Random weights of one layer, scaled so every piece matters: dd_A on both sides of
  0 (both branches of the heavy tail), dt around 0.1-1, norms and biases off 1."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in params_lib.mamba3_shapes(cfg).items():
    if name == "dt_bias":
      v = rng.uniform(-2.0, 0.5, shape)
    elif name in ("norm", "B_norm", "C_norm", "gate_norm", "B_bias", "C_bias", "D"):
      v = 1.0 + 0.3 * rng.standard_normal(shape)
    elif name.startswith("mimo"):
      v = 1.0 + 0.5 * rng.standard_normal(shape)
    else:
      v = rng.standard_normal(shape) / math.sqrt(shape[0])
    out[name] = jnp.asarray(v, dtype)
  del out["norm"]  # the block's pre-norm: not the mixer's
  return out


def _state(cfg, b, seed, dtype=np.float64):
  rng = np.random.default_rng(seed)
  shapes = {k: v.shape for k, v in mamba3.zero_state(cfg, b).items()}
  st = {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}
  st["m3_angle"] = jnp.asarray(rng.uniform(0, 2 * np.pi, shapes["m3_angle"]), dtype)
  return st


# ----------------------------------------------------------------------------
# The reference: mamba_ssm's Mamba3 one position at a time, float64.

def _ref_rotate(t, theta, mimo):
  """mamba_ssm's rotation: SISO views n as (n/2, 2) pairs, MIMO as halves (j, j + n/2);
  cos/sin padded with 1/0 past the angles."""
  n, a = t.shape[-1], theta.shape[-1]
  cos = jnp.concatenate([jnp.cos(theta), jnp.ones(theta.shape[:-1] + (n // 2 - a,))], -1)
  sin = jnp.concatenate([jnp.sin(theta), jnp.zeros(theta.shape[:-1] + (n // 2 - a,))], -1)
  if mimo:
    t0, t1 = t[..., :n // 2], t[..., n // 2:]
    return jnp.concatenate([t0 * cos - t1 * sin, t0 * sin + t1 * cos], -1)
  t0, t1 = t[..., 0::2], t[..., 1::2]
  return jnp.stack([t0 * cos - t1 * sin, t0 * sin + t1 * cos], -1).reshape(t.shape)


def reference(p, u, cfg, state):
  """The mixer on u (b, l, d) from `state`; returns (b, l, d) and the final state."""
  b, l, d = u.shape
  h, hp, n, g, R = cfg.nheads, cfg.headdim, cfg.d_state, cfg.ngroups, cfg.mamba3_rank
  a = cfg.num_rope_angles
  # mamba_ssm's one in_proj (out, d), rows [z, x, B, C, dd_dt, dd_A, trap, angles].
  W = jnp.concatenate([p["in_proj_zx"][:, 0], p["in_proj_zx"][:, 1], p["in_proj_bc"][:, 0],
                       p["in_proj_bc"][:, 1], p["in_proj_heads"][:, 0], p["in_proj_heads"][:, 1],
                       p["in_proj_heads"][:, 2], p["in_proj_angles"]], 1).T
  sizes = [h * hp, h * hp, R * g * n, R * g * n, h, h, h, a]
  z, x, B, C, dd_dt, dd_A, trap, ang = jnp.split(u @ W.T, np.cumsum(sizes)[:-1], -1)
  if cfg.A_activation == "heavy_tail":
    f = jnp.where(dd_A >= 0, 1 + dd_A, 1 / (1 - jnp.minimum(dd_A, 0)))
  else:
    f = jnp.log1p(jnp.exp(dd_A))
  A = -jnp.maximum(f, cfg.A_floor)
  DT = jnp.log1p(jnp.exp(dd_dt + p["dt_bias"]))
  lam = 1 / (1 + jnp.exp(-trap))

  def norm(t, w):
    return t / jnp.sqrt(jnp.mean(t * t, -1, keepdims=True) + 1e-5) * w

  B = norm(B.reshape(b, l, R, g, n), p["B_norm"])
  C = norm(C.reshape(b, l, R, g, n), p["C_norm"])
  B = jnp.repeat(B, h // g, axis=3) + jnp.transpose(p["B_bias"], (1, 0, 2))  # (b, l, R, h, n)
  C = jnp.repeat(C, h // g, axis=3) + jnp.transpose(p["C_bias"], (1, 0, 2))
  x = x.reshape(b, l, h, hp)
  z = z.reshape(b, l, h, hp)
  mx = p["mimo_x"] if cfg.is_mimo else jnp.ones((h, 1, hp))
  V = jnp.einsum("blhp,hrp->blrhp", x, mx)
  v_prev0 = jnp.einsum("bhp,hrp->brhp", state["m3_v"], mx)

  def step(carry, t):
    angle, S, k_prev, v_prev = carry
    angle = angle + jnp.pi * jnp.tanh(ang[:, t])[:, None, :] * DT[:, t, :, None]
    angle = angle - 2 * jnp.pi * jnp.floor(angle / (2 * jnp.pi))
    q = _ref_rotate(C[:, t], angle[:, None], cfg.is_mimo)
    k = _ref_rotate(B[:, t], angle[:, None], cfg.is_mimo)
    v = V[:, t]
    alpha = jnp.exp(A[:, t] * DT[:, t])[..., None, None]
    beta = (1 - lam[:, t]) * DT[:, t] * jnp.exp(A[:, t] * DT[:, t])
    gamma = lam[:, t] * DT[:, t]
    S = (alpha * S + beta[..., None, None] * jnp.einsum("brhp,brhn->bhpn", v_prev, k_prev)
         + gamma[..., None, None] * jnp.einsum("brhp,brhn->bhpn", v, k))
    y = jnp.einsum("bhpn,brhn->brhp", S, q) + p["D"][:, None] * v
    zt = z[:, t][:, None] * (jnp.transpose(p["mimo_z"], (1, 0, 2)) if cfg.is_mimo else 1.0)
    if cfg.is_outproj_norm:
      y = norm(y, 1.0) * p["gate_norm"].reshape(h, hp)
    y = y * zt / (1 + jnp.exp(-zt))
    y = jnp.einsum("brhp,hrp->bhp", y, p["mimo_o"]) if cfg.is_mimo else y[:, 0]
    return (angle, S, k, v), y.reshape(b, h * hp)

  carry = (state["m3_angle"], state["m3_ssm"], state["m3_k"], v_prev0)
  (angle, S, k, _), ys = jax.lax.scan(step, carry, jnp.arange(l))
  out = jnp.swapaxes(ys, 0, 1) @ p["out_proj"]
  return out, {"m3_angle": angle, "m3_ssm": S, "m3_k": k, "m3_v": x[:, -1]}


# ----------------------------------------------------------------------------

CASES = {  # one compile each: between them every option and both layouts
    "siso_rope05_g2_heavy": dict(ngroups=2),
    "siso_rope1_norm_softplus": dict(rope_fraction=1.0, is_outproj_norm=True, A_activation="softplus"),
    "mimo_r2_rope05_g2_norm": dict(is_mimo=True, mimo_rank=2, ngroups=2, is_outproj_norm=True),
    "mimo_r4_rope1": dict(is_mimo=True, mimo_rank=4, rope_fraction=1.0),
    # Rank 1 is still MIMO: the halves layout and the three projections, one rank.
    "mimo_r1_rope05": dict(is_mimo=True, mimo_rank=1),
}
RT_BF16 = Runtime(ssd_form="parallel", ssd_impl="xla", parallel_chunk_size=Q,
                  compute_dtype="bfloat16").resolve("cpu")


def _loss(fn, p, u, st, wy, ws):
  out, new = fn(p, u, st)
  return jnp.sum(out * wy) + sum(jnp.sum(new[k] * ws[k]) for k in ("m3_ssm", "m3_k", "m3_v")), (out, new)


@pytest.mark.parametrize("case", list(CASES))
def test_layer_against_reference(case):
  """float64: outputs, final states and the gradients of a weighted sum of both to every
  parameter, the input and the incoming state, within 1e-10; float32 within 1e-5;
  bfloat16 matmuls (as test_model.py holds Mamba-2's) within 2% of the largest output,
  a few bfloat16 ulps (2**-8), and far from float32's error (bfloat16 really used)."""
  cfg = _cfg(**CASES[case])
  with jax.enable_x64(True):
    p, st = _params(cfg, 0), _state(cfg, 2, 1)
    rng = np.random.default_rng(2)
    u = jnp.asarray(rng.standard_normal((2, L, cfg.d_model)))
    wy = jnp.asarray(rng.standard_normal((2, L, cfg.d_model)))
    ws = {k: jnp.asarray(rng.standard_normal(v.shape)) for k, v in st.items()}
    ours = lambda p, u, st: mamba3.mixer(p, u, cfg, RT, state=st)
    ref = lambda p, u, st: reference(p, u, cfg, st)
    vg = lambda fn: jax.jit(jax.value_and_grad(lambda *a: _loss(fn, *a, wy, ws), argnums=(0, 1, 2), has_aux=True))
    (_, (o1, s1)), g1 = vg(ours)(p, u, st)
    (_, (o2, s2)), g2 = vg(ref)(p, u, st)
    assert o1.dtype == jnp.float64
    assert rel(o1, o2) < 1e-10
    for k in s2:
      assert rel(s1[k], s2[k]) < 1e-10, k
    assert jax.tree.structure(g1) == jax.tree.structure(g2)
    for (path, a), b_ in zip(jax.tree_util.tree_leaves_with_path(g2), jax.tree.leaves(g1)):
      assert rel(b_, a) < 1e-10, jax.tree_util.keystr(path)
    ref_out = o2
  p32, u32, st32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (p, u, st))
  o32, _ = jax.jit(lambda p, u, st: mamba3.mixer(p, u, cfg, RT, state=st))(p32, u32, st32)
  assert o32.dtype == jnp.float32
  err32 = rel(o32, ref_out)
  assert err32 < 1e-5
  o16, s16 = jax.jit(lambda p, u, st: mamba3.mixer(p, u, cfg, RT_BF16, state=st))(p32, u32, st32)
  assert o16.dtype == jnp.float32 and s16["m3_ssm"].dtype == jnp.float32  # outputs and state stay float32
  err16 = rel(o16, ref_out)
  assert 30 * err32 < err16 < 2e-2, (err32, err16)


def test_packed_documents_equal_each_document_alone():
  """MIMO rank 2 (the half layout) with three documents in one row (one starting inside
  a chunk, one on a chunk edge): the packed forward equals each document run alone from
  a zero state (state, carried k/x and angle all restart), and the final state is the
  last document's."""
  cfg = _cfg(is_mimo=True, mimo_rank=2)
  with jax.enable_x64(True):
    p = _params(cfg, 3)
    u = jnp.asarray(np.random.default_rng(4).standard_normal((1, L, cfg.d_model)))
    starts = [0, 3, 8, L]
    seq = np.zeros((1, L), np.int32)
    for i, s in enumerate(starts[1:-1]):
      seq[:, s:] = i + 1
    out, final = jax.jit(lambda p, u, s: mamba3.mixer(p, u, cfg, RT, seq_idx=s))(p, u, jnp.asarray(seq))
    zero = jax.tree.map(lambda a: a.astype(jnp.float64), mamba3.zero_state(cfg, 1))
    for s, e in zip(starts[:-1], starts[1:]):
      want, last = reference(p, u[:, s:e], cfg, zero)
      assert rel(out[:, s:e], want) < 1e-10, (s, e)
    for k in last:
      assert rel(final[k], last[k]) < 1e-10, k


def test_step_continues_the_sequence():
  """The one-step mixer from the forward's final state equals the forward over the
  longer sequence, position after position (SISO with the output norm)."""
  cfg = _cfg(is_outproj_norm=True)
  with jax.enable_x64(True):
    p, st = _params(cfg, 5), _state(cfg, 2, 6)
    u = jnp.asarray(np.random.default_rng(7).standard_normal((2, L, cfg.d_model)))
    full, _ = jax.jit(lambda p, u, st: reference(p, u, cfg, st))(p, u, st)
    _, mid = jax.jit(lambda p, u, st: mamba3.mixer(p, u, cfg, RT, state=st))(p, u[:, :L - 3], st)
    step = jax.jit(lambda p, u, s: mamba3.mixer_step(p, u, cfg, RT, s))
    for t in range(L - 3, L):
      y, mid = step(p, u[:, t], mid)
      assert rel(y, full[:, t]) < 1e-10, t


# ----------------------------------------------------------------------------
# The language model: hybrid decoding, training.

def _lm_cfg(**kw):
  return _cfg(layer_pattern="3*3-", n_layer=4, attn_num_heads=2, attn_num_heads_kv=1, attn_head_dim=8,
              d_intermediate=32, **kw)


def test_cached_decoding_matches_the_full_forward():
  """A MIMO hybrid (Mamba-3, attention, Mamba-3, MLP): greedy tokens from `generate`
  (prefill, then the fused on-device loop over the O(1) Mamba-3 cache) equal the
  argmax of the full forward over the generated sequence, and its logits match."""
  from mamba_train.generation import generate
  from mamba_train.model.cache import Mamba2Cache

  from helpers import scaled_random_model

  cfg = _lm_cfg(is_mimo=True, mimo_rank=2, is_outproj_norm=True)
  model = scaled_random_model(cfg, seed=0)
  prompt = np.random.default_rng(8).integers(0, cfg.vocab_size, (2, 7))
  out = np.asarray(generate(model, prompt, 6))
  logits = np.asarray(jax.jit(lambda ids: model(ids))(out))
  np.testing.assert_array_equal(out[:, 7:], logits[:, 6:-1].argmax(-1))
  cache = Mamba2Cache.init(cfg, 2, 8)
  assert cache.m3_ssm.shape == (2, 2, cfg.nheads, cfg.headdim, cfg.d_state)
  assert cache.m3_k.shape == (2, 2, 2, cfg.nheads, cfg.d_state)
  assert cache.m3_angle.shape == (2, 2, cfg.nheads, cfg.num_rope_angles)
  # Step logits against the forward's, position by position after a prefill (each jitted
  # once, as `generate` runs them: eagerly every op of the model is its own compile).
  from flax import nnx

  from mamba_train import generation

  from helpers import step_through
  gd, params = nnx.split(model)
  lg, cache = jax.jit(lambda p, ids: generation.prefill(nnx.merge(gd, p), ids, capacity=13))(params, out[:, :7])
  assert rel(lg, logits[:, 6]) < 1e-5
  got = step_through(gd, params, cache, jnp.asarray(out), 7, 12)
  for i, t in enumerate(range(7, 12)):
    assert rel(got[:, i], logits[:, t]) < 1e-5, t


def test_training_lowers_the_loss():
  """A few Adam steps on one batch of a pure MIMO (rank 2) Mamba-3 model lower its loss."""
  import optax

  from mamba_train import Mamba2LM

  from helpers import scaled_random_model
  cfg = _cfg(layer_pattern="33", is_mimo=True, mimo_rank=2)
  model = scaled_random_model(cfg, seed=1)
  model = Mamba2LM.from_params(cfg, model.params(), Runtime(remat="full"))
  params = model.params()
  ids = jnp.asarray(np.random.default_rng(9).integers(0, cfg.vocab_size, (4, 16)))

  def loss(params):
    logits = Mamba2LM.from_params(cfg, params, model.runtime)(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

  opt = optax.adam(3e-2)

  @jax.jit
  def train(params):
    def body(carry, _):
      params, state = carry
      value, grads = jax.value_and_grad(loss)(params)
      updates, state = opt.update(grads, state, params)
      return (optax.apply_updates(params, updates), state), value
    return jax.lax.scan(body, (params, opt.init(params)), None, length=8)[1]

  losses = np.asarray(train(params))
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.7 * losses[0], losses


def test_lora_targets_cover_mamba3():
  from mamba_train.model import lora
  cfg = _lm_cfg()
  spec = lora.make_spec(2, 4.0, 0.0, "in_proj,out_proj", "", params_lib.weight_names(cfg))
  shapes = jax.eval_shape(lambda: params_lib.init_params(cfg, jax.random.PRNGKey(0)))
  ad = lora.adapter_shapes(shapes, spec)
  h, i, rgn, a = cfg.nheads, cfg.d_inner, cfg.d_state, cfg.num_rope_angles
  assert ad["mamba3"]["in_proj"]["b"].shape == (2, 2, 2 * i + 2 * rgn + 3 * h + a)
  assert ad["mamba3"]["out_proj"]["a"].shape == (2, i, 2)


def test_config_refuses_by_name():
  with pytest.raises(ValueError, match="ssd_window"):
    _cfg(ssd_window=8)
  with pytest.raises(ValueError, match="rope_fraction"):
    _cfg(rope_fraction=0.25)
  with pytest.raises(ValueError, match="A_activation"):
    _cfg(A_activation="exp")


# ----------------------------------------------------------------------------
# 8 simulated devices against one (one subprocess).

def _max_rel(got, ref):
  """The largest `rel` over the leaves; a leaf whose reference is all zero (a weight the
  loss does not reach) must be zero too."""
  errs = [rel(a, b) if np.abs(np.asarray(b)).max() > 0 else float(np.abs(np.asarray(a)).max())
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))]
  return max(errs)


def _worker(out_dir):
  from flax import nnx

  from mamba_train import Mamba2LM
  from mamba_train.parallel import sharding
  from mamba_train.parallel.mesh import make_mesh
  assert jax.device_count() == 8
  cfg = _lm_cfg(is_mimo=True, mimo_rank=2, ngroups=2, is_outproj_norm=True)
  rt = Runtime().resolve("cpu")
  params = Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt).params()
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, 64, (4, 24)), jnp.int32)
  seq = np.zeros((4, 24), np.int32)
  for row, start in enumerate((9, 12, 6, 30)):  # inside a slice of 6, on slice edges, none
    seq[row, start:] = 1
  w = jnp.asarray(rng.standard_normal((4, 24, 64)), jnp.float32)

  def f(params):
    m = Mamba2LM.from_params(cfg, params, rt)
    return jnp.sum(m(ids, seq_idx=jnp.asarray(seq)) * w)

  def on(mesh_cfg):
    mesh = make_mesh(mesh_cfg)

    def sharded(params):
      with sharding.use_rules(mesh):
        return jax.value_and_grad(f)(params)
    return jax.jit(sharded)

  ref = jax.jit(jax.value_and_grad(f))(params)
  res, runs = {}, {}
  for name, mesh_cfg in (("d2t4", {"data": 2, "tensor": 4}), ("s4d2", {"sequence": 4, "data": 2})):
    run = runs[name] = on(mesh_cfg)
    got = run(params)
    res[name] = {"loss": [float(ref[0]), float(got[0])],
                 "grads": _max_rel(got[1], ref[1])}
  # A pure Mamba-3 model continuing from random states, its final states in the loss: the
  # incoming (state, k, x, angle) and the carries across the slices.
  pcfg = cfg.replace(layer_pattern="33", n_layer=2)
  pparams = Mamba2LM(pcfg, rngs=nnx.Rngs(1), runtime=rt).params()
  states = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32),
                        jax.eval_shape(lambda: Mamba2LM.from_params(pcfg, pparams, rt).backbone(ids)[1]))
  wf = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), jnp.float32), states)

  def g(params, states):
    h, final = Mamba2LM.from_params(pcfg, params, rt).backbone(ids, seq_idx=jnp.asarray(seq), states=states)
    return jnp.sum(h * w[..., :h.shape[-1]]) + sum(jnp.sum(final[k] * wf[k]) for k in final)

  mesh = make_mesh({"sequence": 4, "data": 2})

  def g_sharded(params, states):
    with sharding.use_rules(mesh):
      return jax.value_and_grad(g, argnums=(0, 1))(params, states)

  ref = jax.jit(jax.value_and_grad(g, argnums=(0, 1)))(pparams, states)
  got = jax.jit(g_sharded)(pparams, states)
  res["s4d2_states"] = {"loss": [float(ref[0]), float(got[0])],
                        "grads": _max_rel(got[1], ref[1])}
  text = runs["d2t4"].lower(params).compile().as_text()  # the program that ran, from the caches
  res["sharded"] = "all-reduce" in text or "reduce-scatter" in text
  with open(os.path.join(out_dir, "results.json"), "w") as fh:
    json.dump(res, fh)


def test_eight_devices_equal_one(tmp_path, on_simulated_devices):
  """A MIMO hybrid with packed documents: data 2 x tensor 4 (heads of the Mamba-3 layers
  over tensor), and sequence 4 x data 2 (the length in slices of 6 positions, documents
  starting inside a slice and on its edges): loss and gradients equal one device's; and a
  pure Mamba-3 model continued from random states, with its final states, on sequence 4."""
  res = on_simulated_devices(__file__, tmp_path)
  for name in ("d2t4", "s4d2", "s4d2_states"):
    a, b = res[name]["loss"]
    assert abs(a - b) <= 1e-5 * abs(b), name
    assert res[name]["grads"] < 1e-5, (name, res[name]["grads"])
  assert res["sharded"]


if __name__ == "__main__":
  from mamba_train.xla_flags import apply_cpu_defaults
  # As every entry point does: YNNPACK's CPU fusions segfault running a MIMO layer's
  # float32 gradient (mamba_train/xla_flags.py).
  apply_cpu_defaults()
  _worker(sys.argv[1])
