"""The trainer's parts on their own: schedules, the weight-decay mask, the FLOP
count (against XLA's own count), the non-finite guard and the hooks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mamba_train import Mamba2LM, Runtime, config_for, metrics
from mamba_train.train import hooks, optim

OPTIM = dict(lr=1e-2, schedule="cosine", warmup_frac=0.1, decay_frac=0.2, final_lr_frac=0.1,
             b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0, state_dtype="float32")
MICRO = dict(d_model=32, n_layer=2, d_state=16, headdim=16, chunk_size=16, vocab_size=64)


def test_cosine_schedule():
  s = optim.make_schedule(OPTIM, 100)
  assert float(s(0)) == 0.0
  assert float(s(10)) == pytest.approx(1e-2)
  assert float(s(100)) == pytest.approx(1e-3)  # 10% of the peak
  lrs = [float(s(i)) for i in range(10, 101)]
  assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_wsd_schedule():
  s = optim.make_schedule({**OPTIM, "schedule": "wsd"}, 100)
  assert float(s(5)) == pytest.approx(5e-3)  # warming up
  assert [float(s(i)) for i in (10, 50, 80)] == pytest.approx([1e-2] * 3)  # stable
  assert float(s(90)) == pytest.approx(5.5e-3)  # halfway down the last 20 steps
  assert float(s(100)) == pytest.approx(1e-3)


def test_weight_decay_skips_biases_norms_and_ssm_parameters():
  params = Mamba2LM(config_for("tiny", **MICRO), rngs=nnx.Rngs(0)).params()
  mask = optim.weight_decay_mask(params)
  decayed = {jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(mask) if v}
  assert decayed == {"['embedding']", "['layers']['in_proj_zx']", "['layers']['in_proj_bc']",
                     "['layers']['in_proj_dt']", "['layers']['conv_x']", "['layers']['conv_bc']",
                     "['layers']['out_proj']"}
  # With zero gradients AdamW only decays: exactly the masked parameters shrink.
  tx, _ = optim.make_optimizer({**OPTIM, "schedule": "constant", "warmup_frac": 0.0}, 10)
  zeros = jax.tree.map(jnp.zeros_like, params)

  @jax.jit
  def second_update(params):
    _, opt_state = tx.update(zeros, tx.init(params), params)  # the warmup step has lr 0
    return tx.update(zeros, opt_state, params)[0]

  updates = second_update(params)
  for path, u in jax.tree_util.tree_leaves_with_path(updates):
    p = params
    for k in path:
      p = p[k.key]
    expected = -1e-2 * 0.1 * p if jax.tree_util.keystr(path) in decayed else jnp.zeros_like(p)
    np.testing.assert_allclose(u, expected, rtol=1e-6, atol=1e-12, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("chunk", [32, 128])
def test_flop_count_matches_xla(chunk):
  # One layer, and the parallel SSD form: XLA's cost analysis counts a scan body
  # once, whatever the trip count (the layer scan, and the CPU's chunk scan).
  cfg = config_for("tiny", d_model=256, n_layer=1, vocab_size=256, d_state=32, headdim=64,
                   chunk_size=chunk)
  rt = Runtime(ssd_form="parallel", ssd_impl="xla")
  model = Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt)
  graph, state = nnx.split(model)
  ids = jnp.zeros((2, 256), jnp.int32)
  xla = jax.jit(lambda s, x: nnx.merge(graph, s)(x)).lower(state, ids).cost_analysis()["flops"] / ids.size
  ours = metrics.forward_flops_per_token(cfg, rt, 256)
  # XLA also counts what we leave out as not the model's: the elementwise work, and the
  # parallel form's segment sums of the decays, a (Q x Q) x (Q x Q) matmul per chunk and
  # head (2 Q^2 FLOPs per token and head; 22% of the total at Q = 128).
  segsum = 2 * chunk ** 2 * cfg.nheads
  assert 0.85 < (ours + segsum) / xla < 1.0, (ours, segsum, xla)
  assert metrics.train_flops_per_token(cfg, rt, 256) == 3 * ours
  # The scan form runs at scan_chunk_size and passes states without a matmul.
  scan = Runtime(ssd_form="scan", scan_chunk_size=chunk, ssd_impl="xla")
  h, pn = cfg.nheads, cfg.headdim * cfg.d_state
  passing = 2 * (256 // chunk + 1) ** 2 * h * pn / 256
  assert metrics.forward_flops_per_token(cfg, scan, 256) == pytest.approx(ours - passing)


def test_mfu_and_peak_table():
  cpu = jax.devices()[0]
  assert metrics.peak_flops_per_device(cpu) == metrics.CPU_PEAK_FLOPS
  assert metrics.peak_flops_per_device(cpu, override=1e12) == 1e12
  assert metrics.mfu(1000.0, 1e9, 1e12, 2) == pytest.approx(0.5)
  assert metrics.mfu(1000.0, 1e9, None, 2) is None


def test_nonfinite_guard_stops_after_the_limit():
  guard = hooks.NonFiniteGuard(max_steps=3, last_step=100)
  for step, streak in [(1, 0), (2, 1), (3, 2), (4, 0), (5, 1), (6, 2)]:
    guard(step, None, {"nonfinite_streak": streak})
  guard(7, None, {"nonfinite_streak": 3})  # read on the next call
  with pytest.raises(hooks.NonFiniteLossError, match=r"non-finite for 3 steps in a row \(steps 5\.\.7"):
    guard(8, None, {"nonfinite_streak": 4})
  last = hooks.NonFiniteGuard(max_steps=1, last_step=2)
  last(1, None, {"nonfinite_streak": 0})
  with pytest.raises(hooks.NonFiniteLossError):
    last(2, None, {"nonfinite_streak": 1})  # the last step is checked at once


def test_hooks_run_on_their_period_and_at_the_end():
  seen = []
  periodic = [hooks.Hook("a", 3, lambda s, *_: seen.append(("a", s))),
              hooks.Hook("b", 0, lambda s, *_: seen.append(("b", s)))]
  for step in range(1, 8):
    hooks.run_hooks(periodic, step, 7, None, {})
  assert seen == [("a", 3), ("a", 6), ("a", 7)]


def test_bfloat16_optimizer_state():
  shapes = {"embedding": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
  tx, _ = optim.make_optimizer({**OPTIM, "state_dtype": "bfloat16"}, 10)
  adam = jax.eval_shape(tx.init, shapes).inner_state[1]
  assert adam.mu["embedding"].dtype == jnp.bfloat16 and adam.nu["embedding"].dtype == jnp.float32


def test_guard_skips_nonfinite_steps_and_weight_jumps():
  """optim.guard against its inner transformation run alone: accepted steps are the inner
  one's bit for bit; a norm jump (after the window fills) and a NaN leave the parameters
  and the inner state as they were and count in the same streak. `update_with_squares`'
  sums of squares are those of the parameters the step leaves (train/step.py's param_norm)."""
  import optax
  inner = optax.sgd(0.1, momentum=0.9)
  tx = optim.guard(inner, factor=10.0, window=3)
  assert optim.guard(tx) is tx  # a second wrap is a no-op
  params = {"w": jnp.linspace(1.0, 2.0, 8)}
  state, ref_state = tx.init(params), inner.init(params)
  update = jax.jit(tx.update_with_squares)
  normal = {"w": jnp.full(8, 0.1)}
  grads = [normal, normal, normal, {"w": jnp.full(8, 1e4)}, {"w": jnp.full(8, jnp.nan)}, normal]
  seen = []
  for g in grads:
    u, new_state, squares = update(g, state, params)
    after = optax.apply_updates(params, u)["w"]
    np.testing.assert_allclose(squares["w"], np.sum(np.square(np.float64(after))), rtol=1e-6)
    m = {k: float(v) for k, v in optim.guard_metrics(new_state).items()}
    seen.append((m["nonfinite_streak"], m["weight_jump"]))
    if m["nonfinite_streak"] == 0:  # accepted: exactly the inner transformation's step
      ref_u, ref_state = inner.update(g, ref_state, params)
      np.testing.assert_array_equal(u["w"], ref_u["w"])
    else:
      assert not np.any(u["w"])
      for a, b in zip(jax.tree.leaves(new_state.inner_state), jax.tree.leaves(state.inner_state)):
        np.testing.assert_array_equal(a, b)
    params, state = optax.apply_updates(params, u), new_state
  assert seen == [(0, 0), (0, 0), (0, 0), (1, 1), (2, 0), (0, 0)]
  assert int(state.total_skipped) == 2 and int(state.accepted) == 4
  off = optim.guard(inner, factor=0.0, window=3)  # norm checks off: only non-finite steps skip
  s = off.init(params)
  for g in grads[:4]:
    _, s = off.update(g, s, params)
  assert int(s.notfinite_count) == 0


def test_train_step_takes_any_optax_transformation():
  """make_train_step with a plain optax.adamw (which failed inside the step: 'tuple' object
  has no attribute 'notfinite_count') and with one wrapped in optax.apply_if_finite: one
  step of each equals AdamW applied by hand to the loss's gradient."""
  import optax

  from mamba_train.data import SyntheticLoader
  from mamba_train.parallel.mesh import make_mesh
  from mamba_train.train import state as train_state, step as trainer
  cfg = config_for("tiny", **{**MICRO, "n_layer": 1})
  rt = Runtime().resolve("cpu")
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  batch = trainer.to_global(next(SyntheticLoader(vocab_size=64, seq_len=32, global_batch_size=2, seed=0)), mesh)
  adamw = optax.adamw(1e-3, b2=0.95, weight_decay=0.1)
  with pytest.raises(TypeError, match="needs an optax GradientTransformation"):
    trainer.make_train_step(cfg, rt, "adamw", optax.constant_schedule(1e-3), mesh)

  def mean_loss(p):
    total, count = trainer.loss_sums(p, batch, cfg, rt)
    return total / count

  @jax.jit
  def by_hand(p):
    updates, _ = adamw.update(jax.grad(mean_loss)(p), adamw.init(p), p)
    return optax.apply_updates(p, updates)

  expected = None
  for tx in (adamw, optax.apply_if_finite(adamw, max_consecutive_errors=5)):
    state = train_state.init_train_state(cfg, tx, mesh, seed=0)
    expected = expected or jax.device_get(by_hand(state.params))  # the same init for both
    step = trainer.make_train_step(cfg, rt, tx, optax.constant_schedule(1e-3), mesh)
    state, m = step(state, batch)
    assert float(m["nonfinite_streak"]) == 0 and float(m["weight_jump"]) == 0
    for path, got in jax.tree_util.tree_leaves_with_path(jax.device_get(state.params)):
      want = expected
      for k in path:
        want = want[k.key]
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    # param_norm, from the guard's sums, is the norm of the weights the step returned
    want_norm = np.sqrt(sum(np.sum(np.square(np.float64(x))) for x in jax.tree.leaves(jax.device_get(state.params))))
    np.testing.assert_allclose(float(m["param_norm"]), want_norm, rtol=1e-6)
