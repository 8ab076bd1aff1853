"""Model-level properties: precision policy, remat, config errors, init."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mamba_train import Mamba2Config, Mamba2LM, Runtime, config_for

from helpers import rel

CFG = Mamba2Config(d_model=64, n_layer=2, d_state=16, headdim=16, ngroups=2, chunk_size=16,
                   vocab_size=100)
forward = nnx.jit(lambda model, ids: model(ids))


@pytest.fixture(scope="module")
def params():
  return Mamba2LM(CFG, rngs=nnx.Rngs(0)).params()


def ids(b=2, l=45, seed=0):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, l), 0, CFG.vocab_size)


def test_bfloat16_compute_stays_near_float32(params):
  """bfloat16 matmuls: logits within 2% (relative to the largest logit) of float32,
  i.e. a few bfloat16 ulps (2**-8 = 0.4%) after two layers and the head.
  The float32 run itself is at 1e-6 of a float64 reference, for scale."""
  x = ids()
  f32 = forward(Mamba2LM.from_params(CFG, params), x)
  bf16 = forward(Mamba2LM.from_params(CFG, params, Runtime(compute_dtype="bfloat16")), x)
  assert bf16.dtype == jnp.float32  # logits stay float32 whatever the compute dtype
  err = rel(bf16, f32)
  assert err < 2e-2
  assert err > 1e-5  # and bfloat16 really was used
  with jax.enable_x64(True):
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    f64 = forward(Mamba2LM.from_params(CFG, p64), np.asarray(x))
  assert rel(f32, f64) < 1e-5


def test_precision_policy_of_parameters(params):
  model = Mamba2LM.from_params(CFG, params, Runtime(compute_dtype="bfloat16"))
  for leaf in jax.tree.leaves(model.params()):
    assert leaf.dtype == jnp.float32


def _loss_and_grads(params, runtime=None):
  x = ids(l=48)  # whole chunks: the fused kernels then read x in their own layout

  def loss(p):
    logits = Mamba2LM.from_params(CFG, p, runtime)(x)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, x[..., None], -1)[..., 0])
  return jax.jit(jax.value_and_grad(loss))(params)


@pytest.fixture(scope="module")
def reference(params):
  """Loss and gradients with no remat, XLA's SSD in the parallel form."""
  return _loss_and_grads(params, Runtime(ssd_form="parallel"))


# One runtime each (each costs a compile): the policies on XLA's SSD, and the one that
# also saves the SSD kernels' output and states on the Pallas kernels (interpreter).
@pytest.mark.parametrize("remat,impl", [("save_matmuls", "xla"), ("save_in_proj", "xla"),
                                        ("save_in_proj_ssd", "interpret")])
def test_remat_gives_the_same_loss_and_gradients(params, reference, remat, impl):
  l0, g0 = reference
  l1, g1 = _loss_and_grads(params, Runtime(remat=remat, ssd_impl=impl, ssd_form="parallel"))
  assert abs(float(l1) - float(l0)) < 1e-5 * abs(float(l0))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g0)):
    assert rel(a, b) < 1e-5, path


def _saved_by_layers(remat, impl):
  """[(dtype, element count)] of the residuals the layer scan keeps for the backward
  pass (bfloat16 matmuls), from `jax.ad_checkpoint.print_saved_residuals`."""
  import contextlib
  import io
  import re

  from jax.ad_checkpoint import print_saved_residuals
  rt = Runtime(compute_dtype="bfloat16", remat=remat, ssd_impl=impl, ssd_form="parallel")
  x = ids(l=48)
  params = jax.eval_shape(lambda: Mamba2LM(CFG, rngs=nnx.Rngs(0)).params())
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    print_saved_residuals(lambda p: Mamba2LM.from_params(CFG, p, rt)(x).sum(), params)
  found = re.findall(r"^(\w+)\[([\d,]*)\] output of scan", out.getvalue(), re.M)
  return sorted((t, math.prod(int(d) for d in s.split(",") if d)) for t, s in found)


def test_fused_layer_remat_saves_what_it_says():
  """Beyond what full remat keeps (each layer's input, and the last layer's output):
  save_in_proj keeps the in_proj result z|x|B|C in the compute dtype and dt float32;
  save_in_proj_ssd also the SSD kernels' y (x's dtype) and entering states (float32)."""
  n, (b, l) = CFG.n_layer, ids(l=48).shape
  i, gn, h, p, s = CFG.d_inner, CFG.ngroups * CFG.d_state, CFG.nheads, CFG.headdim, CFG.d_state
  full = _saved_by_layers("full", "interpret")
  assert full == sorted([("f32", b * l * CFG.d_model), ("f32", n * b * l * CFG.d_model)])
  in_proj = [("bf16", n * b * l * (2 * i + 2 * gn)), ("f32", n * b * l * h)]
  assert _saved_by_layers("save_in_proj", "interpret") == sorted(full + in_proj)
  ssd = [("bf16", n * b * l * h * p), ("f32", n * b * (l // CFG.chunk_size) * h * p * s)]
  assert _saved_by_layers("save_in_proj_ssd", "interpret") == sorted(full + in_proj + ssd)
  # Without the kernels (XLA's SSD) there is no kernel output to name: the in_proj alone.
  assert _saved_by_layers("save_in_proj_ssd", "xla") == sorted(full + in_proj)


def test_init_follows_mamba_ssm(params):
  L = params["layers"]
  A = np.exp(np.asarray(L["A_log"]))
  assert A.min() >= 1.0 and A.max() <= 16.0
  dt = np.asarray(jax.nn.softplus(L["dt_bias"]))
  assert dt.min() >= CFG.dt_init_floor * 0.999 and dt.max() <= CFG.dt_max * 1.001
  np.testing.assert_array_equal(np.asarray(L["D"]), 1.0)
  emb = np.asarray(params["embedding"])
  assert emb.shape == (CFG.padded_vocab_size, CFG.d_model) == (112, 64)
  assert abs(emb.std() - 0.02) < 2e-3
  bound = 1 / math.sqrt(CFG.d_inner) / math.sqrt(CFG.n_layer)
  assert np.abs(np.asarray(L["out_proj"])).max() <= bound


def test_param_logical_axes_cover_every_dimension():
  model = nnx.eval_shape(lambda: Mamba2LM(CFG.replace(tie_embeddings=False), rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  for path, var in nnx.to_flat_state(state):
    axes = var.logical_axes
    assert len(axes) == len(var.get_value().shape), path


def test_released_sizes():
  for size, (d, n, heads) in {"130m": (768, 24, 24), "370m": (1024, 48, 32),
                              "780m": (1536, 48, 48), "1.3b": (2048, 48, 64),
                              "2.7b": (2560, 64, 80)}.items():
    cfg = config_for(size)
    assert (cfg.d_model, cfg.n_layer, cfg.nheads) == (d, n, heads)
    assert cfg.padded_vocab_size == 50288 and cfg.d_state == 128 and cfg.chunk_size == 256


@pytest.mark.parametrize("kw,match", [
    (dict(d_model=100, headdim=64), "multiple of headdim"),
    (dict(ngroups=3), "multiple of ngroups"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(dt_limit=(0.1, 0.01)), "dt_limit"),
])
def test_config_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    Mamba2Config(**{**dict(d_model=64, n_layer=2, headdim=16), **kw})


@pytest.mark.parametrize("kw,match", [
    (dict(compute_dtype="float16"), "compute_dtype"),
    (dict(remat="some"), "remat"),
    (dict(ssd_form="fast"), "ssd_form"),
    (dict(ssd_impl="cuda"), "ssd_impl"),
    (dict(scan_chunk_size=0), "scan_chunk_size must be a positive integer"),
])
def test_runtime_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    Runtime(**kw)


def test_remat_auto_resolves_per_backend_and_names_the_choices():
  """'auto' takes the policy the counts chose for the backend compiled for; a bad
  name is refused with the choices listed."""
  from mamba_train.model.runtime import REMAT_TPU
  assert {b: Runtime(remat="auto").resolve(b).remat for b in ("cpu", "gpu", "tpu")} == {
      "cpu": "full", "gpu": "save_matmuls", "tpu": REMAT_TPU}
  assert Runtime(remat="save_in_proj").resolve("tpu").remat == "save_in_proj"
  # The fused layer (v6e, TPU7x) with the layers unrolled keeps its gated y as well;
  # in a layer scan, or with XLA's layer, it does not.
  for kind in ("TPU v6 lite", "TPU7x"):
    assert Runtime(remat="auto", unroll_layers=True).resolve("tpu", kind).remat == "save_in_proj_ssd"
    assert Runtime(remat="auto").resolve("tpu", kind).remat == REMAT_TPU
  assert Runtime(remat="auto", unroll_layers=True).resolve("tpu", "TPU v5").remat == REMAT_TPU
  with pytest.raises(ValueError, match=r"remat must be one of \(.*'save_in_proj_ssd'\), got 'some'"):
    Runtime(remat="some")


def test_from_params_names_mismatched_parameters(params):
  bad = jax.tree.map(lambda a: a, params)
  bad["layers"] = dict(bad["layers"], A_log=bad["layers"]["A_log"][:, :3])
  with pytest.raises(ValueError, match=r"layers/A_log: shape \(2, 3\), expected \(2, 8\)"):
    Mamba2LM.from_params(CFG, bad)
