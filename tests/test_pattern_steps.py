"""An irregular layer pattern as one scan of steps (`pattern.Steps`), against the
same model run as the period's runs (`schedule='runs'`, one scan per run of one
kind, which the other hybrid tests hold against transformers): logits, router
statistics and every gradient, and cached decoding against the full forward."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mamba_train import Mamba2Config, Mamba2LM
from mamba_train.generation import prefill
from mamba_train.model import pattern as pattern_lib
from mamba_train.model.runtime import Runtime

from helpers import rel, step_through

# Every kind, no repeat: the runs would compile one body per change of kind.
IRREGULAR = Mamba2Config(d_model=32, n_layer=9, d_state=8, headdim=16, ngroups=2, chunk_size=8,
                         vocab_size=64, layer_pattern="MEM*E-MM*", attn_num_heads=4,
                         attn_num_heads_kv=2, attn_head_dim=8, d_intermediate=24, n_routed_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16,
                         moe_shared_expert_intermediate_size=8)
_plan = pattern_lib.plan


@contextlib.contextmanager
def schedule(name):
  with mock.patch.object(pattern_lib, "plan", functools.partial(_plan, schedule=name)):
    yield


def test_plan_steps():
  pl = _plan(IRREGULAR.layer_pattern)
  assert pl.steps is not None and len(pl.runs) == 8  # auto: steps, as 8 runs > 4 kinds
  st = pl.steps
  for k in "ME*-":  # each layer of a kind run once, in order, by the step its slot says
    assert [st.slot[k][i] for i in st.step_of[k]] == list(range(IRREGULAR.layer_pattern.count(k)))
    assert sum(st.taken[k]) == IRREGULAR.layer_pattern.count(k)
  # Replaying the steps in `order` gives the pattern back.
  replay = "".join(k for i in range(st.n_steps) for k in st.order if st.taken[k][i])
  assert replay == IRREGULAR.layer_pattern
  nano = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
  assert (_plan(nano).steps.order, _plan(nano).steps.n_steps) == ("M*E", 23)
  assert _plan("MMMM*MMM" * 6).steps is None and _plan("M" * 8).steps is None  # periodic: runs
  with pytest.raises(ValueError, match="schedule"):
    _plan("M*", schedule="scan")


@pytest.fixture(scope="module")
def model():
  return Mamba2LM(IRREGULAR, rngs=nnx.Rngs(0), runtime=Runtime(remat="full").resolve("cpu"))


@pytest.fixture(scope="module")
def loss_fn(model):
  """(loss(params) -> (loss, (logits, states)), params) of one batch."""
  gd, params = nnx.split(model)
  ids = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)

  def loss(p):
    m = nnx.merge(gd, p)
    h, states = m.backbone(ids)
    logits = m.logits(h)
    y = jax.nn.log_softmax(logits)
    return -jnp.mean(y[:, :-1].reshape(-1, 64)[jnp.arange(30), ids[:, 1:].reshape(-1)]) + \
        jnp.mean(states["moe_aux"]), (logits, states)

  return loss, params


@pytest.fixture(scope="module")
def both(loss_fn):
  """{schedule: (logits, router statistics, gradients)} of one batch."""
  loss, params = loss_fn
  out = {}
  for name in ("runs", "steps"):
    with schedule(name):
      (_, (logits, states)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    out[name] = logits, {k: v for k, v in states.items() if k.startswith("moe")}, grads
  return out


def test_steps_equal_runs(both):
  (l0, s0, g0), (l1, s1, g1) = jax.device_get((both["runs"], both["steps"]))  # numpy: no op dispatch
  assert np.abs(l0 - l1).max() <= 1e-6 * np.abs(l0).max()
  assert set(s0) == set(s1) and s0 and all(s0[k].shape == s1[k].shape for k in s0)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=0), s0, s1)
  leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
  assert len(leaves0) == len(leaves1) > 20
  for a, b in zip(leaves0, leaves1):
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= 1e-6 * max(np.abs(a).max(), 1e-30)
  assert sum(np.abs(a).sum() for a in leaves0) > 0


def test_remat_keeps_the_moe_dispatch(loss_fn):
  """The MoE dispatch holds no sort (ops/dispatch.py: running counts and gathers),
  and full remat recomputes the MoE layers in the backward pass but not the router's
  top-k: it runs once, in the forward pass (the train step's program holds as many
  as the forward's), its integer results saved (`moe.DISPATCH`). Each sort or top-k
  of the assignments is a large piece of TPU program, compiled per occurrence
  (docs/bench/compile_depth.md). Lowering only."""
  loss, params = loss_fn
  count = lambda f, op: f.lower(params).as_text().count(op)
  with schedule("steps"):
    forward, step = jax.jit(lambda p: loss(p)[0]), jax.jit(jax.grad(lambda p: loss(p)[0]))
    assert count(forward, "top_k") >= 1  # the MoE body's router (the steps schedule: one body a kind)
    assert count(step, "top_k") == count(forward, "top_k")
    assert count(step, "stablehlo.sort") == 0 == count(forward, "stablehlo.sort")


def test_cached_decoding_steps(model):
  """prefill and step through the steps schedule equal the full forward."""
  ids = jax.random.randint(jax.random.key(2), (2, 13), 0, 64)
  gd, params = nnx.split(model)
  full = jax.jit(lambda p, i: nnx.merge(gd, p)(i))(params, ids)
  with schedule("steps"):
    logits, cache = jax.jit(lambda p, i: prefill(nnx.merge(gd, p), i, capacity=13))(params, ids[:, :8])
    assert cache.k.shape[0] == 2  # keys and values: per attention layer, as with the runs
    got = step_through(gd, params, cache, ids, 8, 12)
  assert rel(jnp.concatenate([logits[:, None], got], 1), full[:, 7:12]) < 1e-5


def test_steps_compile_flat_in_depth():
  """The jaxpr of an irregular pattern's forward is the same size at 27 layers and
  at 45 (no repeat either way): one body a kind."""
  short = "MEM*E-MM*EM-M*EME-M*EEM-MM*"
  long = short + "E*M-EM*EM-E*MM-E*M"
  for p in (short, long):  # alike: every kind skipped somewhere (else it has no cond)
    assert not any(all(t) for t in _plan(p).steps.taken.values())

  def program(pattern):
    cfg = IRREGULAR.replace(n_layer=len(pattern), layer_pattern=pattern)
    gd, st = nnx.split(nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0))))
    text = str(jax.make_jaxpr(lambda s, ids: nnx.merge(gd, s)(ids))(st, jnp.zeros((1, 8), jnp.int32)))
    return text.count(" = "), text.count("dot_general")
  assert program(short) == program(long)
