"""The fused decoding step (model/decode_pallas.py) against the plain step
(`mamba2.mixer_step` with decode_impl 'xla'): on CPU in Pallas' interpreter, the
output and both states in float32, 1 and 3 groups, batch > 1, d_conv 4, a dt clamp;
generation with the kernel against the full forward's logits and against today's
greedy tokens; and the kernel compiled for TPU v6e and v5p through libtpu (no TPU
needed), so Mosaic's tiling rules are checked here."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mamba_train.model.config import Mamba2Config
from mamba_train.model.mamba2 import _block_uniform_shapes, init_block_params, mixer_step, zero_state
from mamba_train.model.runtime import Runtime

from helpers import libtpu_compiles, rel


@pytest.mark.parametrize("g,b,limit", [(1, 3, (0.0, math.inf)), (3, 2, (0.0, 0.02))],
                         ids=["1-group", "3-groups-clamped"])
def test_fused_step_matches_plain_step(g, b, limit):
  """Random states (not zeros, so the conv shift and the decay both show), weights
  drawn as the model initialises them with the norm and D perturbed; 6 heads of 8,
  so with 3 groups each group's B and C reach two heads."""
  cfg = Mamba2Config(d_model=24, n_layer=1, d_state=16, headdim=8, ngroups=g, d_conv=4,
                     vocab_size=64, dt_limit=limit)
  rng = np.random.default_rng(g)
  n = sum(math.prod(s) for s in _block_uniform_shapes(cfg).values())
  p = init_block_params(cfg, jax.random.uniform(jax.random.key(g), (n,)))
  p = {k: v * jnp.asarray(1 + 0.2 * rng.standard_normal(v.shape), jnp.float32)
       if k in ("gate_norm", "D") else v for k, v in p.items()}
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


def test_runtime_chooses_the_fused_step_on_tpu_only():
  from mamba_train.model.mamba2 import fused_decode
  cfg = Mamba2Config(d_model=24, n_layer=1, d_state=16, headdim=8, vocab_size=64)
  assert Runtime().resolve("tpu").decode_impl == "pallas"
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
from mamba_train.model.decode_pallas import mixer_step_fused
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
  print("compiled", topo)
"""


def test_fused_step_compiles_for_tpu_v6e_and_v5p():
  libtpu_compiles(_AOT, ("v6e:1x1", "v5p:2x2x1"))
