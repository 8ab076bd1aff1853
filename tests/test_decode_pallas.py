"""The fused decoding step (ops/decode_tpu.py) against the plain step
(`mamba2.mixer_step` / `block_step` with decode_impl 'xla'): on CPU in Pallas'
interpreter, the output and every state in float32, 1 and 3 groups, batch 1 to 3,
d_conv 4, a dt clamp, the projections over several weight tiles with a ragged last
one; decoding with the kernels against the full forward's logits and greedy tokens,
and against the step kernel between XLA's matmuls (the form before the projection
kernels); and the kernels compiled for TPU v6e and v5p through libtpu (no TPU
needed), so Mosaic's tiling rules are checked here."""

import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mamba_train.model import mamba2, matmul as mm
from mamba_train.model.cache import Mamba2Cache
from mamba_train.model.config import Mamba2Config
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.mamba2 import block_step, mixer_step, zero_state
from mamba_train.model.params import _block_uniform_shapes, init_block_params
from mamba_train.model.runtime import Runtime
from mamba_train.model.select import ops_for
from mamba_train.ops import decode_tpu

from helpers import libtpu_compiles, rel


def _layer(cfg, seed):
  rng = np.random.default_rng(seed)
  n = sum(math.prod(s) for s in _block_uniform_shapes(cfg).values())
  p = init_block_params(cfg, jax.random.uniform(jax.random.key(seed), (n,)))
  return {k: v * jnp.asarray(1 + 0.2 * rng.standard_normal(v.shape), jnp.float32)
          if k in ("gate_norm", "D", "norm") else v for k, v in p.items()}, rng


@pytest.mark.parametrize("g,b,limit", [(1, 3, (0.0, math.inf)), (3, 2, (0.0, 0.02))],
                         ids=["1-group", "3-groups-clamped"])
def test_fused_step_matches_plain_step(g, b, limit):
  """Random states (not zeros, so the conv shift and the decay both show), weights
  drawn as the model initialises them with the norm and D perturbed; 6 heads of 8,
  so with 3 groups each group's B and C reach two heads."""
  cfg = Mamba2Config(d_model=24, n_layer=1, d_state=16, headdim=8, ngroups=g, d_conv=4,
                     vocab_size=64, dt_limit=limit)
  p, rng = _layer(cfg, g)
  state = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in zero_state(cfg, b).items()}
  u = jnp.asarray(rng.standard_normal((b, cfg.d_model)), jnp.float32)

  def both(p, u, state):
    return [mixer_step(p, u, cfg, Runtime(decode_impl=impl).resolve("cpu"), state)
            for impl in ("interpret", "xla")]
  (y1, s1), (y2, s2) = jax.jit(both)(p, u, state)
  assert y1.shape == (b, cfg.d_model) and y1.dtype == jnp.float32
  assert rel(y1, y2) < 1e-5
  for k in ("conv_x", "conv_bc", "ssm"):
    assert s1[k].shape == state[k].shape and rel(s1[k], s2[k]) < 1e-5, k
  # The states moved: the conv window shifted by one input, the SSM state decayed and took it.
  np.testing.assert_array_equal(np.asarray(s1["conv_x"])[:, :-1], np.asarray(state["conv_x"])[:, 1:])
  assert rel(s1["ssm"], state["ssm"]) > 1e-3


@pytest.mark.parametrize("g,b,limit,mult", [(1, 1, (0.0, math.inf), 1.0), (3, 2, (0.0, 0.02), 1.0),
                                            (3, 3, (0.0, math.inf), 0.5)],
                         ids=["1-group-b1", "3-groups-b2-clamped", "3-groups-b3-multiplier"])
def test_fused_block_step_matches_plain_block_step(g, b, limit, mult):
  """The whole block (pre-norm, in_proj, the step, out_proj, the residual add) as
  three kernels, against `block_step` plain: the residual stream out and every
  state, float32 1e-5. Weight tiles of 128 columns (the tile budget patched down),
  so in_proj's 690 columns are 6 tiles and out_proj's 144 two, each with a
  ragged last tile; with the weights as the decode loop makes them
  (`fused_decode_weights`) and as the raw layer (joined inside the step)."""
  cfg = Mamba2Config(d_model=144, n_layer=1, d_state=16, headdim=16, ngroups=g, d_conv=4,
                     vocab_size=64, dt_limit=limit, residual_multiplier=mult)
  p, rng = _layer(cfg, g + b)
  state = {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in zero_state(cfg, b).items()}
  h = jnp.asarray(3 * rng.standard_normal((b, cfg.d_model)), jnp.float32)
  fused_rt, plain_rt = (Runtime(decode_impl=impl).resolve("cpu") for impl in ("interpret", "xla"))

  def all_three(p, h, state):
    made = mamba2.fused_decode_weights(p, fused_rt, ops_for(cfg, fused_rt))
    return (block_step(made, h, cfg, fused_rt, state), block_step(p, h, cfg, fused_rt, state),
            block_step(p, h, cfg, plain_rt, state))
  with mock.patch.object(decode_tpu, "_TILE_BYTES", 1):
    (h1, s1), (h2, s2), (h0, s0) = jax.jit(all_three)(p, h, state)
  assert h1.shape == (b, cfg.d_model) and h1.dtype == jnp.float32
  for hx, sx in ((h1, s1), (h2, s2)):
    assert rel(hx - h, h0 - h) < 1e-5  # the layer's update, not swamped by the residual
    assert rel(hx, h0) < 1e-5
    for k in ("conv_x", "conv_bc", "ssm"):
      assert sx[k].shape == state[k].shape and rel(sx[k], s0[k]) < 1e-5, k
  assert rel(h1, h) > 1e-2 and rel(s1["ssm"], state["ssm"]) > 1e-3  # the layer did something


def _kernel_between_xla_matmuls(p, h, cfg, rt, state):
  """`block_step` with the step kernel alone (the fused form before its projection
  kernels): the pre-norm, in_proj, out_proj and the residual add by XLA."""
  y, cx, cbc, ssm = decode_tpu.mixer_step_fused(
      mm.linear(mamba2.rms_norm(h, p["norm"], cfg.norm_eps), p["in_proj"].T, rt.compute_dtype), state["conv_x"],
      state["conv_bc"], state["ssm"], p["small"], ngroups=cfg.ngroups, eps=cfg.norm_eps, dt_limit=cfg.dt_limit,
      compute_dtype=rt.compute_dtype, interpret=True)
  return mamba2.residual(h, mm.linear(y, p["out_proj"], rt.compute_dtype), cfg), {"conv_x": cx, "conv_bc": cbc,
                                                                                   "ssm": ssm}


def test_fused_decoding_tokens_match_full_forward_and_the_kernel_alone():
  """Two layers, 3 groups, a batch of 2, teacher-forced: every position decoded one
  token at a time with the decode loop's weights (`decode_layers`), by the three
  kernels, by the step kernel between XLA's matmuls (the form before) and by the
  plain step, against one full forward: logits within float32 1e-5, greedy tokens
  identical."""
  cfg = Mamba2Config(d_model=48, n_layer=2, d_state=16, headdim=16, ngroups=3, chunk_size=8, vocab_size=64)
  base = Mamba2LM(cfg, rngs=nnx.Rngs(0))
  ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
  graphdef, params = nnx.split(base)
  full = jax.jit(lambda p: nnx.merge(graphdef, p)(ids))(params)

  def stepped(impl, before=False):
    m = Mamba2LM.from_params(cfg, base.params(), runtime=Runtime(decode_impl=impl))
    gd, ps = nnx.split(m)

    def run(ps):
      m = nnx.merge(gd, ps)
      layers = m.decode_layers(unrolled=True)
      def body(states, tok):
        h, states = m.step_unrolled(tok, layers, states)
        return states, m.logits(h)
      return jnp.moveaxis(jax.lax.scan(body, m.unstack_states(Mamba2Cache.init(cfg, 2).states()), ids.T)[1], 0, 1)
    if not before:
      return jax.jit(run)(ps)
    with mock.patch.object(mamba2, "block_step", _kernel_between_xla_matmuls):
      return jax.jit(run)(ps)
  logits = {"kernels": stepped("interpret"), "before": stepped("interpret", before=True), "plain": stepped("xla")}
  greedy = np.asarray(jnp.argmax(full, -1))
  for name, lg in logits.items():
    assert rel(lg, full) < 1e-5, name
    np.testing.assert_array_equal(np.asarray(jnp.argmax(lg, -1)), greedy, err_msg=name)


def test_runtime_chooses_the_fused_step_on_tpu_only():
  from mamba_train.ops import table
  fused_decode = lambda cfg, rt: table.build(rt, cfg).decode is not None
  cfg = Mamba2Config(d_model=24, n_layer=1, d_state=16, headdim=8, vocab_size=64)
  assert Runtime().resolve("tpu").decode_impl == "mosaic"
  assert Runtime().resolve("cpu").decode_impl == Runtime().resolve("gpu").decode_impl == "xla"
  assert fused_decode(cfg, Runtime().resolve("tpu"))
  # A windowed layer keeps the plain step (its state is a window, not (h, p, n)).
  assert not fused_decode(cfg.replace(ssd_window=256), Runtime().resolve("tpu"))
  with pytest.raises(ValueError, match="decode_impl must be one of"):
    Runtime(decode_impl="triton")


_AOT = """
import sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mamba_train.parallel.topology import tpu_devices
from mamba_train.ops.decode_tpu import mixer_step_fused, norm_in_proj, out_proj_residual
for topo in sys.argv[1:]:
  rep = NamedSharding(Mesh(np.array(tpu_devices(topo)[2][:1]), ("d",)), P())
  S = lambda s, d=jnp.float32: jax.ShapeDtypeStruct(s, d, sharding=rep)
  # The released models' head dim, state and conv (p 64, n 128, k 4), few heads;
  # batch 1 (y in bfloat16, a static row) and 2 (float32 rows at the grid's index).
  for b in (1, 2):
    h, p, n, g, k = 4, 64, 128, 1, 4
    i, gn = h * p, g * n
    step = jax.jit(lambda *a: mixer_step_fused(*a, ngroups=g, eps=1e-5, compute_dtype=jnp.bfloat16),
                   donate_argnums=(1, 2, 3))
    hlo = step.lower(S((b, 2 * i + 2 * gn + h)), S((b, k - 1, i)), S((b, k - 1, 2, gn)), S((b, h, p, n)),
                     S((2 * k + 6, i))).compile().as_text()
    assert "mamba2_decode_step" in hlo, "kernel missing"
    # The projections at 130m's widths (in_proj's 3,352 columns: 3 tiles, the last
    # ragged) with the pre-norm and the residual, y as the step writes it.
    d, w, i = 768, 3352, 1536
    proj = jax.jit(lambda hh, nw, wi, wo, y: (norm_in_proj(hh, wi, nw, compute_dtype=jnp.bfloat16),
                                              out_proj_residual(y, wo, hh, compute_dtype=jnp.bfloat16)))
    hlo = proj.lower(S((b, d)), S((1, d)), S((w, d), jnp.bfloat16), S((i, d), jnp.bfloat16),
                     S((b, i), jnp.bfloat16 if b == 1 else jnp.float32)).compile().as_text()
    assert "mamba2_decode_in_proj" in hlo and "mamba2_decode_out_proj" in hlo, "projection kernels missing"
  print("compiled", topo)
"""


def test_fused_step_compiles_for_tpu_v6e_and_v5p():
  libtpu_compiles(_AOT, ("v6e:1x1", "v5p:2x2x1"))
