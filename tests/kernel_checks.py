"""Checks the kernel test files share (they import jax, which `helpers` does not at
import): a tiny model run through a kernel runtime against the XLA model, and the
layer kernels' inputs, loss-weighted gradients and bfloat16 check, which the TPU
(`test_layer_tpu`) and GPU (`test_layer_gpu`) kernels are held to alike; the fused
layers' (`test_layer_fused_tpu`, `test_layer_fused_gpu`) inputs and gradients."""

import jax
import jax.numpy as jnp

from mamba_train.ops import layer_math

from helpers import packed_ids, rel


def assert_model_matches_xla(cfg, kernels, xla, length: int = 40, tol: float = 1e-5):
  """The logits, the layers' states after the sequence and every parameter's gradient
  of `cfg` (random init) over packed documents of `length`, run by the `kernels`
  runtime, within `tol` of the `xla` one."""
  from flax import nnx

  from mamba_train import Mamba2LM
  ids = jax.random.randint(jax.random.PRNGKey(1), (2, length), 0, cfg.vocab_size)
  seq = packed_ids(3, 2, length)
  params = Mamba2LM(cfg, rngs=nnx.Rngs(0)).params()

  def run(rt):
    def loss(p):
      model = Mamba2LM.from_params(cfg, p, rt)
      h, states = model.backbone(ids, seq_idx=seq)
      logits = model.logits(h)
      return jnp.mean(jax.nn.logsumexp(logits, -1)), (logits, states)
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (_, (l1, s1)), g1 = run(kernels)
  (_, (l2, s2)), g2 = run(xla)
  assert rel(l1, l2) < tol
  assert s1.keys() == s2.keys()
  for name in s1:
    assert rel(s1[name], s2[name]) < tol, name
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g2)):
    assert rel(a, b) < tol, path


def conv_inputs(b, l, chan, k, dtype=jnp.float32):
  """x (in `dtype`), w, bias, front, and the weights of y and the new front in the loss."""
  ks = jax.random.split(jax.random.PRNGKey(l), 6)
  x = jax.random.normal(ks[0], (b, l, *chan)).astype(dtype)
  w = 0.5 * jax.random.normal(ks[1], (k, *chan))
  bias = jax.random.normal(ks[2], chan)
  front = jax.random.normal(ks[3], (b, k - 1, *chan))
  return x, w, bias, front, jax.random.normal(ks[4], x.shape), jax.random.normal(ks[5], front.shape)


def conv_grads(fn, seq, wy, wf, *extra):
  """Jitted value and gradients (x, w, bias, front) of a weighted sum of both of the
  conv's outputs, so every cotangent path is checked; `extra` follows seq_idx."""
  def loss(x, w, bias, front):
    y, tail = fn(x, w, bias, front, seq, *extra)
    return jnp.sum(y.astype(jnp.float32) * wy) + jnp.sum(tail * wf), (y, tail)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def norm_inputs(shape, dtype=jnp.float32):
  """y, z (in `dtype`), the norm's weight, and the output's weight in the loss."""
  ks = jax.random.split(jax.random.PRNGKey(shape[-1]), 4)
  y, z = (jax.random.normal(k, shape).astype(dtype) for k in ks[:2])
  return y, z, 1.0 + 0.1 * jax.random.normal(ks[2], shape[-1:]), jax.random.normal(ks[3], shape)


def norm_grads(fn, groups, wo):
  """Jitted value and gradients (y, z, weight) of the norm's output weighted by wo."""
  def loss(y, z, w):
    out = fn(y, z, w, groups, 1e-5)
    return jnp.sum(out.astype(jnp.float32) * wo), out
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def assert_bfloat16_within_plain_error(conv, norm):
  """bfloat16 inputs: the conv and norm kernels' outputs and gradients deviate from
  the float32 plain form (on the same rounded inputs) by no more than the plain form
  run on the bfloat16 inputs and rounded to bfloat16 as the model rounds it, to a
  factor 1.5."""
  x, w, bias, front, wy, wf = conv_inputs(2, 100, (32,), 4, jnp.bfloat16)
  seq = packed_ids(7, 2, 100)
  plain_bf16 = lambda *a: (lambda y, t: (y.astype(jnp.bfloat16), t))(*layer_math.causal_conv_silu(*a))
  (_, ref), gref = conv_grads(layer_math.causal_conv_silu, seq, wy, wf)(x.astype(jnp.float32), w, bias, front)
  (_, out_k), gk = conv_grads(conv, seq, wy, wf)(x, w, bias, front)
  (_, out_p), gp = conv_grads(plain_bf16, seq, wy, wf)(x, w, bias, front)
  y, z, nw, wo = norm_inputs((2, 40, 64), jnp.bfloat16)
  f32 = lambda a: a.astype(jnp.float32)
  (_, nref), ngref = norm_grads(layer_math.gated_rms_norm, 2, wo)(f32(y), f32(z), nw)
  (_, nk), ngk = norm_grads(norm, 2, wo)(y, z, nw)
  (_, npl), ngp = norm_grads(lambda *a: layer_math.gated_rms_norm(*a).astype(jnp.bfloat16), 2, wo)(y, z, nw)
  assert out_k[0].dtype == jnp.bfloat16 and nk.dtype == jnp.bfloat16
  pairs = [("conv y", out_k[0], out_p[0], ref[0]), ("norm out", nk, npl, nref)]
  pairs += [(f"conv d{n}", a, b, r) for n, a, b, r in zip(("x", "w", "bias", "front"), gk, gp, gref)]
  pairs += [(f"norm d{n}", a, b, r) for n, a, b, r in zip(("y", "z", "w"), ngk, ngp, ngref)]
  for name, k, plain, r in pairs:
    err_k, err_p = rel(k, r), rel(plain, r)
    assert err_p < 5e-2, (name, err_p)  # bfloat16 rounding, not a broken reference
    assert err_k <= 1.5 * err_p + 1e-6, (name, err_k, err_p)


def assert_conv_matches_plain(conv, l, chan, docs: bool, front_ids: bool = False):
  """The conv + SiLU kernel against `layer_math.causal_conv_silu` on a (2, l, *chan)
  input, float32: its output at 1e-5, the new front exactly, every gradient at 1e-5;
  with `docs`, packed documents, and an input of another document changes nothing
  after its boundary. `front_ids`: the front's own document ids too (its first input
  of an earlier document than position 0's)."""
  x, w, bias, front, wy, wf = conv_inputs(2, l, chan, 4)
  seq = packed_ids(l, 2, l) if docs else None
  extra = ((jnp.zeros((2, 3), jnp.int32).at[:, 0].set(-1) + seq[:, :1]) if docs else None,) if front_ids else ()
  (_, (y1, t1)), g1 = conv_grads(conv, seq, wy, wf, *extra)(x, w, bias, front)
  (_, (y2, t2)), g2 = conv_grads(layer_math.causal_conv_silu, seq, wy, wf, *extra)(x, w, bias, front)
  assert y1.shape == x.shape and y1.dtype == x.dtype and t1.dtype == jnp.float32
  assert rel(y1, y2) < 1e-5 and rel(t1, t2) == 0.0
  for name, a, b in zip(("x", "w", "bias", "front"), g1, g2):
    assert a.shape == b.shape and rel(a, b) < 1e-5, name
  if docs:  # an input of another document changes nothing at positions after the boundary
    cut = int(jnp.argmax(seq[0] > seq[0, 0]))
    y3, _ = jax.jit(conv)(x.at[0, cut - 1].add(5.0), w, bias, front, seq, *extra)
    assert rel(y3[0, cut:], y1[0, cut:]) == 0.0 and rel(y3[0, cut - 1], y1[0, cut - 1]) > 0


def assert_norm_matches_plain(norm, shape, groups):
  """The gated RMSNorm kernel against `layer_math.gated_rms_norm`, float32: output and
  every gradient at 1e-5."""
  y, z, w, wo = norm_inputs(shape)
  (_, o1), g1 = norm_grads(norm, groups, wo)(y, z, w)
  (_, o2), g2 = norm_grads(layer_math.gated_rms_norm, groups, wo)(y, z, w)
  assert o1.shape == shape and o1.dtype == jnp.float32 and rel(o1, o2) < 1e-5
  for name, a, b in zip(("y", "z", "weight"), g1, g2):
    assert a.shape == b.shape and rel(a, b) < 1e-5, name


def mixer_inputs(b, l, h, p, g, n, k=4):
  """Random arguments of `layer_math.mixer_core` (z|x, B|C, dt, the weights, the fronts, an
  initial state) and a key for the loss's weights, as the fused layers' tests take them."""
  ks = jax.random.split(jax.random.PRNGKey(l * h + g), 12)
  i = h * p
  w = dict(conv_x=0.5 * jax.random.normal(ks[4], (k, i)), conv_x_bias=0.1 * jax.random.normal(ks[5], (i,)),
           conv_bc=0.5 * jax.random.normal(ks[6], (k, 2, g * n)),
           conv_bc_bias=0.1 * jax.random.normal(ks[7], (2, g * n)), dt_bias=0.1 * jax.random.normal(ks[8], (h,)),
           A_log=jnp.log(jnp.linspace(1.0, 8.0, h)), D=jax.random.normal(ks[9], (h,)))
  fronts = jax.random.split(ks[11], 3)
  # z|x joined, as in_proj's GEMM writes them: the kernels read z's and x's blocks out
  # of it and write dz|dx back into one cotangent.
  return (jax.random.normal(ks[0], (b, l, 2 * i)), jax.random.normal(ks[2], (b, l, 2, g * n)),
          jax.random.normal(ks[3], (b, l, h)) - 2.0, w,
          jax.random.normal(fronts[0], (b, k - 1, i)), jax.random.normal(fronts[1], (b, k - 1, 2, g * n)),
          0.1 * jax.random.normal(ks[10], (b, h, p, n)), fronts[2])


def mixer_run(fn, args, seq, chunk, g, dt_limit, grads):
  """`fn` (a `mixer_core`) on `mixer_inputs`' args: its outputs, and with `grads` the gradient of
  a random weighted sum of them with respect to every input."""
  *inputs, key = args

  def outputs(zx, bc, dt_raw, w, fx, fbc, s0):
    return fn(zx, bc, dt_raw, w, chunk, ngroups=g, dt_limit=dt_limit, front_x=fx, front_bc=fbc,
              initial_state=s0, seq_idx=seq)

  out = jax.jit(outputs)(*inputs)
  if not grads:
    return out, None
  wts = [jax.random.normal(kk, o.shape) for kk, o in zip(jax.random.split(key, 3), out)]
  loss = lambda *a: sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outputs(*a), wts))
  return out, jax.jit(jax.grad(loss, argnums=tuple(range(7))))(*inputs)
