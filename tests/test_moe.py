"""Mixture-of-experts layers ('E'): against transformers' NemotronHForCausalLM on
identical random weights (logits, greedy tokens, export and from_pretrained), the
grouped-matmul dispatch against a dense every-expert reference (forward and
gradients), packed documents against each document alone, and the refusals."""

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import NemotronHConfig, NemotronHForCausalLM

from mamba_train import Mamba2Config, Mamba2LM, load_model
from mamba_train.interop import mamba_ssm as mamba_ssm_layout, nemotron_h
from mamba_train.interop.export import save_hf, save_mamba_ssm
from mamba_train.model import moe as moe_lib
from mamba_train.model.runtime import Runtime
from mamba_train.ops import dispatch, experts, experts_gpu, experts_tpu

import reference_checks
from helpers import rel, skip_on_known_transformers_bug

forward = nnx.jit(lambda model, ids, seq_idx=None: model(ids, seq_idx=seq_idx))

COMMON = dict(hidden_size=32, vocab_size=90, ssm_state_size=8, mamba_head_dim=16,
              mamba_num_heads=4, chunk_size=8, head_dim=8, intermediate_size=48, n_groups=2,
              num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8,
              moe_intermediate_size=24, moe_shared_expert_intermediate_size=16,
              pad_token_id=0, bos_token_id=0, eos_token_id=0)
# Two patterns: grouped routing (4 groups, the best 2 kept) with renormalised and
# scaled weights; a latent projection with ungrouped, unnormalised weights.
SMALL = {
    "grouped_ME*E": dict(layers_block_type=["mamba", "moe", "attention", "moe"], n_group=4,
                         topk_group=2, num_experts_per_tok=3, norm_topk_prob=True,
                         routed_scaling_factor=2.5),
    "latent_EM-E*": dict(layers_block_type=["moe", "mamba", "mlp", "moe", "attention"],
                         moe_latent_size=12, num_experts_per_tok=2, norm_topk_prob=False),
}


def hf_model(path, seed, **kw):
  torch.manual_seed(seed)
  model = NemotronHForCausalLM(NemotronHConfig(**{**COMMON, **kw})).eval()
  # Spread what transformers initialises to constants; the router wider than its
  # 0.02 init, and the correction bias nonzero, so both decide the choice.
  with torch.no_grad():
    for layer in model.model.layers:
      layer.norm.weight.normal_(1.0, 0.2)
      if layer.block_type == "linear_attention":
        layer.mixer.A_log.uniform_(-1.0, 2.5)
        layer.mixer.dt_bias.uniform_(-3.0, 0.0)
        layer.mixer.D.normal_(1.0, 0.5)
      if layer.block_type == "moe":
        layer.mixer.gate.weight.normal_(0.0, 0.5)
        layer.mixer.gate.e_score_correction_bias.normal_(0.0, 0.1)
        layer.mixer.experts.up_proj.normal_(0.0, 0.3)
        layer.mixer.experts.down_proj.normal_(0.0, 0.3)
  model.save_pretrained(path)
  return model


@pytest.fixture(scope="module", params=list(SMALL))
def pair(request, tmp_path_factory):
  path = tmp_path_factory.mktemp("nemotron_h_moe")
  ref = hf_model(path, seed=list(SMALL).index(request.param), **SMALL[request.param])
  return request.param, ref, load_model(path)


def test_config_read(pair):
  name, ref, ours = pair
  c, r = ours.config, ref.config
  assert c.pattern == "".join({"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}[k]
                              for k in SMALL[name]["layers_block_type"])
  assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob,
          c.routed_scaling_factor, c.moe_latent_size or None) == (
      r.n_routed_experts, r.num_experts_per_tok, r.n_group, r.topk_group, r.norm_topk_prob,
      r.routed_scaling_factor, r.moe_latent_size)


def test_logits_match_transformers(pair):
  _, ref, ours = pair
  skip_on_known_transformers_bug(ref.config)
  reference_checks.assert_logits_match(ref, ours)


def test_greedy_matches_transformers(pair):
  _, ref, ours = pair
  skip_on_known_transformers_bug(ref.config)
  reference_checks.assert_greedy_matches(ref, ours, 10)


MOE_CFG = Mamba2Config(d_model=32, n_layer=4, d_state=8, headdim=16, ngroups=2, chunk_size=8,
                       vocab_size=90, layer_pattern="EM*E", attn_num_heads=4, attn_num_heads_kv=2,
                       attn_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=24, moe_shared_expert_intermediate_size=16,
                       moe_latent_size=12, n_group=2, topk_group=1)


def test_export_then_from_pretrained(tmp_path):
  """An MoE hybrid built here (tied head, latent, grouped routing) -> transformers
  -> the same logits; back through load_model bit-exact; bfloat16 keeps the router float32."""
  ours = Mamba2LM(MOE_CFG, rngs=nnx.Rngs(3))
  ref = reference_checks.export_to_transformers(ours, tmp_path / "out")
  skip_on_known_transformers_bug(ref.config)
  back = reference_checks.assert_export_round_trip(ref, ours, tmp_path / "out")
  assert back.config.weight_differences(MOE_CFG.replace(tie_embeddings=False)) == {}
  jax.tree.map(np.testing.assert_array_equal, back.params()["moe"], ours.params()["moe"])
  save_hf(ours, tmp_path / "bf16", dtype="bfloat16")
  from safetensors import safe_open
  with safe_open(tmp_path / "bf16" / "model.safetensors", "np") as f:
    assert f.get_tensor("backbone.layers.0.mixer.gate.weight").dtype == np.float32
    assert f.get_tensor("backbone.layers.0.mixer.experts.3.up_proj.weight").dtype != np.float32
  with pytest.raises(ValueError, match="mixture-of-experts"):
    save_mamba_ssm(ours, tmp_path / "ssm")
  with pytest.raises(ValueError, match="shared expert"):
    nemotron_h.ours_to_nemotron_h_config(MOE_CFG.replace(moe_shared_expert_intermediate_size=0))


def test_eval_harness_scores_as_transformers(tmp_path):
  """The eval harness's log-likelihoods and greedy flags (lm-eval's loglikelihood) of
  an MoE hybrid against transformers' NemotronH on its export, computed in float64
  from the logits. Rows are padded after the continuation, where no padding token
  can reach an earlier position (nor, counted in token order, take its capacity)."""
  from mamba_train.data.tokenizer import load_tokenizer
  from mamba_train.interop.eval_harness import HarnessLM
  ours = Mamba2LM(MOE_CFG.replace(vocab_size=257), rngs=nnx.Rngs(4))
  ref = reference_checks.export_to_transformers(ours, tmp_path / "hf")
  skip_on_known_transformers_bug(ref.config)
  rng = np.random.default_rng(0)
  pairs = [(rng.integers(0, 256, n).tolist(), rng.integers(0, 256, m).tolist()) for n, m in ((9, 3), (14, 1), (5, 6))]
  got = HarnessLM(ours, load_tokenizer("byte"), batch_size=4).score(pairs)
  for (ctx, cont), (ll, greedy) in zip(pairs, got):
    with torch.no_grad():
      logits = ref(torch.tensor([ctx + cont])).logits[0, len(ctx) - 1:-1].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(cont)), torch.tensor(cont)].sum().item()
    assert abs(ll - want) <= 1e-5 * abs(want)
    assert greedy == bool((logits.argmax(-1) == torch.tensor(cont)).all())


@pytest.mark.parametrize("kw", [dict(), dict(moe_latent_size=0, n_group=4, topk_group=3,
                                              num_experts_per_tok=3, norm_topk_prob=False)])
def test_grouped_matmuls_equal_dense_reference(kw):
  """The ragged_dot dispatch against every expert on every token, masked (float32):
  the layer's output and the gradients of every parameter and the input."""
  cfg = MOE_CFG.replace(**kw)
  p = jax.tree.map(lambda a: a[0], Mamba2LM(cfg, rngs=nnx.Rngs(1)).layer_params("E"))
  p = {**p, moe_lib.BIAS: jnp.linspace(-0.05, 0.05, 8)}
  u = jax.random.normal(jax.random.key(2), (3, 37, 32))
  rt = Runtime().resolve()
  loss = lambda dense: lambda p, u: jnp.sum(jnp.sin(moe_lib.moe(p, u, cfg, rt, dense=dense)[0]))
  got, want = (jax.jit(jax.value_and_grad(loss(d), argnums=(0, 1)))(p, u) for d in (False, True))
  assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
  y, stats = jax.jit(lambda p, u: moe_lib.moe(p, u, cfg, rt))(p, u)
  yd, _ = moe_lib.moe(p, u, cfg, rt, dense=True)
  assert rel(y, yd) < 1e-6
  for name in set(p) - {"norm"}:  # (the norm is the block's, before the layer's function)
    if name == moe_lib.BIAS:  # the choice is discrete: no gradient reaches the bias
      assert not np.any(got[1][0][name]) and not np.any(want[1][0][name])
    else:
      assert rel(got[1][0][name], want[1][0][name]) < 1e-5, name
  assert rel(got[1][1], want[1][1]) < 1e-5
  # Every token reaches its k experts (dropless).
  assert float(jnp.sum(stats["moe_load"])) == 3 * 37 * cfg.num_experts_per_tok


def test_save_moe_keeps_the_expert_rows():
  """remat 'save_moe' (`lm.remat_policy`; its gradients against the dense reference:
  `test_capacity_drops_as_the_dense_reference`): the MoE layer's backward pass keeps the
  routed rows, hidden units, activation and returned rows, so it runs no grouped product
  again (as many as without remat, fewer than 'full'); and `moe.dot_in` (the shared
  expert's and latent projections' matmuls): plain autodiff's gradients in float32, and
  backward products in the operands' dtype (bfloat16) with a float32 cotangent. Tracing
  and two tiny eager gradients: about 1 CPU-s."""
  from jax.ad_checkpoint import print_saved_residuals

  from mamba_train.model.lm import remat_policy
  from mamba_train.model.select import ops_for
  cfg = MOE_CFG.replace(moe_latent_size=0, n_group=1, topk_group=1)
  p = jax.eval_shape(lambda: moe_lib.init_params(cfg, jax.random.key(1)))  # shapes: traced only
  u = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32)
  rt = Runtime().resolve()
  layer = lambda p, u: jnp.sum(jnp.sin(moe_lib.moe(p, u, cfg, rt)[0]))
  under = lambda name: jax.checkpoint(layer, policy=remat_policy(name, ops_for(cfg, rt)))
  grad = lambda f: jax.grad(f, argnums=(0, 1))
  products = lambda f: str(jax.make_jaxpr(grad(f))(p, u)).count("ragged_dot_general[")
  assert products(under("save_moe")) == products(layer) < products(under("full"))
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    print_saved_residuals(under("save_moe"), p, u)
  kept = out.getvalue()
  assert all(f"'{name}'" in kept for name in moe_lib.SAVED_ROWS), kept
  # dot_in: plain autodiff's gradients (float32); bfloat16 operands, bfloat16 backward products.
  a, w, g = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(8, 32), (32, 16), (8, 16)]))
  plain = lambda a, w: jnp.einsum("td,df->tf", a, w, preferred_element_type=jnp.float32)
  got, want = (jax.grad(lambda a, w: jnp.sum(fn(a, w) * g), argnums=(0, 1))(a, w) for fn in (moe_lib.dot_in, plain))
  assert all(rel(x, y) <= 1e-6 for x, y in zip(got, want))
  bf = [x.astype(jnp.bfloat16) for x in (a, w)]
  text = str(jax.make_jaxpr(jax.grad(lambda a, w: jnp.sum(moe_lib.dot_in(a, w) * g), argnums=(0, 1)))(*bf))
  dots = [ln for ln in text.splitlines() if "dot_general[" in ln]
  assert len(dots) == 3 and not any(":f32[" in ln.split("dot_general")[1] and "bf16" not in ln for ln in dots)


def test_capacity_drops_as_the_dense_reference():
  """A capacity factor (Runtime.moe_capacity_factor): large enough, the dropless
  output bit for bit; small, the grouped matmuls with assignments past capacity
  dropped against every expert on every token with the same assignments masked
  (kept there by a sort, here by one-hot running counts), forward and gradients."""
  cfg = MOE_CFG.replace(moe_latent_size=0, n_group=1, topk_group=1)
  p = jax.tree.map(lambda a: a[0], Mamba2LM(cfg, rngs=nnx.Rngs(1)).layer_params("E"))
  u = jax.random.normal(jax.random.key(2), (3, 37, 32))
  run = lambda cf, dense=False: jax.jit(lambda p, u: moe_lib.moe(
      p, u, cfg, Runtime(moe_capacity_factor=cf).resolve(), dense=dense))(p, u)
  (y0, s0), (y_big, s_big) = run(0.0), run(4.0)  # capacity 37: all a row's tokens
  np.testing.assert_array_equal(y_big, y0)
  assert float(s_big["moe_dropped"]) == 0.0 == float(s0["moe_dropped"])
  experts = moe_lib.route(p, u.reshape(-1, 32), cfg)[0].reshape(3, 37, 2)
  cap = moe_lib.capacity(37, cfg, 0.5)  # ceil(0.5 * 37 * 2 / 8) = 5
  keep = moe_lib.within_capacity(experts, cap, n_experts=8)
  np.testing.assert_array_equal(keep, moe_lib.within_capacity_reference(experts, cap, 8))
  (y, s), (yd, sd) = run(0.5), run(0.5, dense=True)
  assert float(s["moe_dropped"]) == float(sd["moe_dropped"]) == float(np.sum(~np.asarray(keep))) > 0
  assert rel(y, yd) < 1e-6 and rel(y, y0) > 1e-2
  rt = Runtime(moe_capacity_factor=0.5).resolve()
  loss = lambda dense: lambda p, u: jnp.sum(jnp.sin(moe_lib.moe(p, u, cfg, rt, dense=dense)[0]))
  # The grouped matmuls' gradients under remat 'save_moe' (the backward pass reads the rows
  # the forward kept: `test_save_moe_keeps_the_expert_rows`), the reference's without remat.
  from mamba_train.model.lm import remat_policy
  from mamba_train.model.select import ops_for
  save_moe = jax.checkpoint(loss(False), policy=remat_policy("save_moe", ops_for(cfg, rt)))
  got, want = (jax.jit(jax.grad(f, argnums=(0, 1)))(p, u) for f in (save_moe, loss(True)))
  for name in set(p) - {"norm", moe_lib.BIAS}:
    assert rel(got[0][name], want[0][name]) < 1e-5, name
  assert rel(got[1], want[1]) < 1e-5


def test_dispatch_without_sorts_is_the_stable_sort():
  """ops/dispatch.py against numpy's stable sort by expert: the buffer slots, their
  inverse and experts (2 devices of 4 experts, some assignments dropped), the grouping
  of received blocks; and `take_rows` (a gather whose gradient is the gather by the
  inverse) against jnp.take, forward and gradient (autodiff's scatter-add), also with
  the out-of-range rows left unzeroed; `combine` (the weighted sum's own VJP) against
  autodiff of the float32 product."""
  rng = np.random.default_rng(0)
  n, e_local, t, k = 2, 4, 15, 3
  m = t * k
  flat = rng.integers(0, n * e_local, m)
  flat[rng.random(m) < 0.2] = n * e_local  # dropped
  cap = int(max(np.sum(flat // e_local == d) for d in range(n)))
  x = jax.random.normal(jax.random.key(0), (t, 5))
  cot = jax.random.normal(jax.random.key(1), (n * cap, 5))

  @jax.jit
  def run(flat, x):  # one compile
    slot, src, ids = dispatch.assignment_slots(flat, n, e_local, cap)
    plain = lambda x: jnp.take(x, src // k, axis=0, mode="fill", fill_value=0)
    ours = lambda x: dispatch.take_rows(x, src, slot, k)
    grad = lambda f: jax.grad(lambda x: jnp.sum(f(x) * cot))(x)
    # the weighted sum's own VJP against autodiff of the float32 product, bf16 rows
    got, w = jnp.repeat(x, k, axis=0).astype(jnp.bfloat16).reshape(t, k, -1).swapaxes(0, 1), x[:, :k].T ** 2
    mix = lambda f: jax.value_and_grad(lambda g, w: jnp.sum(f(g, w) * x), (0, 1))(got, w)
    sums = (mix(dispatch.combine), mix(lambda g, w: jnp.sum(g.astype(jnp.float32) * w[..., None], axis=0)))
    # the choice-major gather (by_choice) against the token-major one, forward and gradient
    flat_rows = lambda r: dispatch.take_rows(r, slot, src).reshape(t, k, -1)
    chosen = lambda r: dispatch.take_rows(r, *dispatch.by_choice(slot, src, k)).reshape(k, t, -1).swapaxes(0, 1)
    back = lambda f: jax.grad(lambda r: jnp.sum(f(r) * jnp.repeat(x, k, axis=0).reshape(t, k, -1)))(cot)
    sums += ((chosen(cot), flat_rows(cot)), (back(chosen), back(flat_rows)))
    # rows left unzeroed (zero=False, zero_grad=False), read where the index is in range
    loose = (dispatch.take_rows(x, src, slot, k, zero=False),
             back(lambda r: dispatch.take_rows(r, *dispatch.by_choice(slot, src, k), zero_grad=False
                                               ).reshape(k, t, -1).swapaxes(0, 1)))
    return ((slot, src, ids), dispatch.group_by_expert(ids, n, e_local), (ours(x), plain(x)),
            (grad(ours), grad(plain)), sums, loose)
  (slot, src, ids), (pos, by_expert, sizes), rows, grads, sums, loose = jax.tree.map(
      np.asarray, run(jnp.asarray(flat, jnp.int32), x))
  sent = src < m  # the rows that hold an assignment: the same with or without the zeros
  np.testing.assert_array_equal(loose[0][sent], rows[1][sent])
  np.testing.assert_array_equal(loose[1][sent], sums[3][1][sent])
  assert np.any(loose[0][~sent]) and np.any(loose[1][~sent])  # the others really left as gathered
  for a, b in [*zip(jax.tree.leaves(sums[0]), jax.tree.leaves(sums[1])), *sums[2:]]:  # the same arithmetic
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  assert sums[0][1][0].dtype == jnp.bfloat16 and np.any(sums[0][1][1]) and np.any(sums[3][0])
  order = np.argsort(flat, kind="stable")
  want_slot = np.full(m, n * cap)
  for d in range(n):
    mine = order[flat[order] // e_local == d]
    want_slot[mine] = d * cap + np.arange(len(mine))
  np.testing.assert_array_equal(slot, want_slot)
  want_src, want_ids = np.full(n * cap, m), np.full(n * cap, e_local)
  want_src[want_slot[flat < n * e_local]] = np.flatnonzero(flat < n * e_local)
  want_ids[want_slot[flat < n * e_local]] = flat[flat < n * e_local] % e_local
  np.testing.assert_array_equal(src, want_src)
  np.testing.assert_array_equal(ids, want_ids)
  by = np.argsort(ids, kind="stable")
  filled = int(np.sum(ids < e_local))
  np.testing.assert_array_equal(by_expert[:filled], by[:filled])
  assert np.all(by_expert[filled:] == n * cap)
  np.testing.assert_array_equal(pos[by[:filled]], np.arange(filled))
  assert np.all(pos[ids == e_local] == n * cap)
  np.testing.assert_array_equal(sizes, np.bincount(ids[ids < e_local], minlength=e_local))
  np.testing.assert_array_equal(rows[0], rows[1])
  assert np.any(rows[0])
  np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6, atol=1e-6)
  assert np.any(grads[0])


def test_dropped_share_on_known_logits():
  """The capacity's accounting on a router whose logits are set (the first 8 input
  features through an identity router; experts 0 to 2 favoured, so they overflow):
  the layer's dropped count and the step metric's share against a count made here
  with numpy (each sequence's assignments to an expert past the first ceil(cf l k / E)
  are dropped; a token's k choices go to k different experts, so token order decides)."""
  from mamba_train.train import balance
  cfg = MOE_CFG.replace(moe_latent_size=0, n_group=1, topk_group=1)
  p = {**moe_lib.init_params(cfg, jax.random.key(1)), "router": jnp.eye(32, 8, dtype=jnp.float32)}
  b, l, e, k, cf = 3, 40, 8, 2, 1.25
  logits = np.random.default_rng(0).normal(size=(b, l, e)) + np.array([2.0, 1.5, 1.0, 0, 0, 0, 0, 0])
  u = jnp.zeros((b, l, 32), jnp.float32).at[..., :e].set(logits.astype(np.float32))
  _, stats = jax.jit(lambda p, u: moe_lib.moe(p, u, cfg, Runtime(moe_capacity_factor=cf).resolve()))(p, u)
  chosen = np.argsort(-logits, axis=-1)[..., :k]  # sigmoid is monotone and the bias zero
  per_row = np.stack([np.bincount(chosen[i].reshape(-1), minlength=e) for i in range(b)])  # (b, e)
  cap = int(np.ceil(cf * l * k / e))  # 13
  want = int(np.maximum(per_row - cap, 0).sum())
  np.testing.assert_array_equal(stats["moe_load"], per_row.sum(0))
  assert float(stats["moe_dropped"]) == want > 0
  m = balance.metrics(stats["moe_load"][None], stats["moe_aux"], stats["moe_dropped"])
  assert float(m["moe_dropped_tokens"]) == want
  assert float(m["moe_dropped_share"]) == pytest.approx(want / (b * l * k), rel=1e-6)


def test_megablox_equals_ragged_dot():
  """`expert_mlp` by megablox's grouped matmul (in Pallas' interpreter) against
  jax.lax.ragged_dot on the same rows, float32: squared-ReLU experts forward and the
  gradients to the rows and the weights, with experts given no rows, rows past
  sum(sizes) (dropped: zero out, zero gradient) and 150 rows padded to two row tiles
  of 128; swiglu experts forward on 24 rows padded to a tile of 32. (The gate's
  gradient is the same kernels as up's: each interpreted kernel costs seconds of
  compile, so swiglu runs forward only.)"""
  f32 = jnp.dtype("float32")
  ks = jax.random.split(jax.random.key(5), 5)
  e, w, f = 6, 32, 24
  rows = jax.random.normal(ks[0], (150, w))
  up, gate = (0.3 * jax.random.normal(k, (e, w, f)) for k in ks[1:3])
  down = 0.3 * jax.random.normal(ks[3], (e, f, w))
  sizes = jnp.array((40, 0, 30, 50, 0, 20), jnp.int32)  # 140 of 150 rows: 10 dropped

  def loss(impl):
    def fn(rows, up, down):
      out = impl(rows, up, down, sizes, f32)
      return jnp.sum(jnp.sin(out)), out
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2), has_aux=True))

  megablox = functools.partial(experts_tpu.expert_mlp_megablox, interpret=True)
  (_, got), g_got = loss(megablox)(rows, up, down)
  (_, want), g_want = loss(experts.expert_mlp_xla)(rows, up, down)
  assert rel(got, want) < 1e-5
  assert not np.any(np.asarray(got[140:])) and not np.any(np.asarray(g_got[0][140:]))
  for name, a, b in zip(("rows", "up", "down"), g_got, g_want):
    assert rel(a, b) < 1e-5, name
  few = jnp.array((5, 0, 7, 12, 0, 0), jnp.int32)
  swiglu = lambda impl: jax.jit(lambda r: impl(r, (gate, up), down, few, f32))(rows[:24])
  assert rel(swiglu(megablox), swiglu(experts.expert_mlp_xla)) < 1e-5
  assert experts_tpu.gmm_tiling(2688 * 4, 2688, 1856) == (128, 896, 1856)  # Nano's widths


def _tokamax_or_skip():
  try:
    return experts_gpu.import_tokamax()
  except ImportError as err:
    print(err)
    pytest.skip(f"tokamax (the gpu extra) absent: pip install -e '.[gpu]' ({err})")


def test_tokamax_path_equals_ragged_dot(monkeypatch):
  """`expert_mlp` with moe_impl='tokamax' against jax.lax.ragged_dot, float32: swiglu
  experts (gate, up, down: every product the squared-ReLU ones have, and the gate),
  forward and the gradients to the rows and every weight, with
  experts given no rows and rows past sum(sizes) (zero out, zero gradient). tokamax's
  Triton kernels have no interpreter on CPU (jax 0.10.2's Pallas HLO interpreter
  cannot lower the program_id they read inside a `pl.when`), so its ragged dot runs
  here as tokamax's XLA op carrying tokamax's own backward (rows by a ragged dot
  on the transposed weights, weights by a ragged contraction): what is checked is
  our padding, masking, dtype and empty-expert handling around tokamax's op and
  its weights' gradient, and the rows' gradient by our kernel (`_rows_grad`, in Pallas'
  interpreter; widths multiples of its 16-wide tiles); the kernels' sm_90a compile is
  `test_tokamax_experts_compile_for_h100`."""
  import functools

  _tokamax_or_skip()
  from tokamax._src.ops.ragged_dot import base
  monkeypatch.setattr(experts_gpu, "TOKAMAX_IMPLEMENTATION", base.RaggedDot(vjp=functools.partial(base.vjp)))
  monkeypatch.setattr(experts_gpu, "INTERPRET", True)
  f32 = jnp.dtype("float32")
  ks = jax.random.split(jax.random.key(6), 4)
  e, w, f = 6, 16, 32
  rows = jax.random.normal(ks[0], (50, w))
  up, gate = (0.3 * jax.random.normal(k, (e, w, f)) for k in ks[1:3])
  down = 0.3 * jax.random.normal(ks[3], (e, f, w))
  sizes = jnp.array((12, 0, 10, 16, 0, 8), jnp.int32)  # 46 of 50 rows: 4 dropped

  def grads(impl):
    def fn(rows, up, gate, down):
      out = impl(rows, (gate, up), down, sizes, f32)
      return jnp.sum(jnp.sin(out)), out
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3), has_aux=True))(rows, up, gate, down)

  (_, got), g_got = grads(experts_gpu.expert_mlp_tokamax)
  (_, want), g_want = grads(experts.expert_mlp_xla)
  assert rel(got, want) < 1e-5
  assert not np.any(np.asarray(got[46:])) and not np.any(np.asarray(g_got[0][46:]))
  for name, a, b in zip(("rows", "up", "gate", "down"), g_got, g_want):
    assert rel(a, b) < 1e-5, name
    if name != "rows":  # experts 1 and 4 met no row
      assert not np.any(np.asarray(a[1])) and not np.any(np.asarray(a[4])), name


_TOKAMAX_COMPILE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mamba_train.parallel.topology import gpu_devices
rep = NamedSharding(Mesh(np.array(gpu_devices("h100-1")[2][:1]), ("d",)), P())
import tokamax
from mamba_train.ops import experts_gpu
from mamba_train.tools.hlo import kernel_costs
bf = jnp.bfloat16
m, e, w, f = 256, 8, 128, 64
S = lambda s, d=bf: jax.ShapeDtypeStruct(s, d, sharding=rep)
def loss(rows, gate, up, down, sizes):
  return jnp.sum(jnp.sin(experts_gpu.expert_mlp_tokamax(rows, (gate, up), down, sizes, bf)))
args = (S((m, w)), S((e, w, f)), S((e, w, f)), S((e, f, w)), S((e,), jnp.int32))
fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
with tokamax.config.cross_compile(True):
  compiled = fn.lower(*args).compile()
  jaxpr = fn.trace(*args).jaxpr
hlo = compiled.as_text()
calls = [l for l in hlo.splitlines() if "custom-call(" in l and "TritonRaggedDot" in l]
ours = [l for l in hlo.splitlines() if "custom-call(" in l and "experts_rows_grad" in l]
# Forward gate, up, down and each one's weights gradient by tokamax; the rows' gradients ours.
assert (len(calls), len(ours)) == (6, 3), (len(calls), len(ours))
# ours read the weights as stored: no transposed copy of a weight is written
assert not [l for l in hlo.splitlines() if " transpose(" in l and ("[8,128,64]" in l or "[8,64,128]" in l)]
# No other matmul: no cuBLAS GEMM, no dot, so nothing dense over the experts.
assert "cublas" not in hlo and " dot(" not in hlo, [l for l in hlo.splitlines() if "cublas" in l or " dot(" in l][:3]
mp = m + experts_gpu.TOKAMAX_ROW_PAD
k = kernel_costs(compiled, jaxpr)
assert k["flops"] == 9 * 2 * mp * w * f, k
print("compiled", len(calls) + len(ours))
# attention='tokamax': its flash kernels forward and backward, no score-sized buffer,
# counted by `hlo.flash_attention_cost` (2 + 5 l s h e FLOPs: the causal half).
import re
from mamba_train.ops import attention_gpu
l, h, kv, d = 256, 4, 2, 64
seq = jnp.asarray(np.repeat(np.arange(2), l // 2)[None], jnp.int32)
def att(q, k, v):
  return jnp.sum(attention_gpu.flash(q, k, v, seq, None, bf) ** 2)
fn = jax.jit(jax.grad(att, argnums=(0, 1, 2)))
qkv = (S((1, l, h, d)), S((1, l, kv, d)), S((1, l, kv, d)))
with tokamax.config.cross_compile(True):
  compiled = fn.lower(*qkv).compile()
  jaxpr = fn.trace(*qkv).jaxpr
hlo = compiled.as_text()
flash = [x for x in hlo.splitlines() if "custom-call(" in x and "PallasTritonFlashAttention" in x]
assert len(flash) == 2, len(flash)
assert not re.search(r"f32\\[[0-9,]*256,256\\]", hlo), re.search(r".*f32\\[[0-9,]*256,256\\].*", hlo).group(0)[:200]
assert kernel_costs(compiled, jaxpr)["flops"] == 7 * l * l * h * d
print("attention compiled", len(flash))
"""


def test_tokamax_experts_compile_for_h100():
  """The experts through tokamax (gate, up, down; forward and both gradients) for
  sm_90a with the gpu extra's wheels (no GPU needed): six tokamax Triton custom
  calls, three of ours (the rows' gradients) and no other matmul in the optimised
  module (XLA:GPU's rewrite of ragged_dot into a dense all-experts dot is gone), no
  transposed weight copy, and `hlo.kernel_costs` counting each at 2 m k n; and
  attention='tokamax' (`attention_gpu.flash`): tokamax's two flash kernels, no float32
  scores written, counted by `hlo.flash_attention_cost`."""
  import os
  import subprocess
  import sys

  from helpers import ROOT, missing_gpu_wheels
  _tokamax_or_skip()
  missing = missing_gpu_wheels()
  if missing:
    reason = f"GPU compile wheels absent ({', '.join(missing)}): pip install -e '.[gpu]'"
    print(reason)
    pytest.skip(reason)
  assert Runtime().resolve("gpu").moe_impl == "tokamax"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(ROOT)
  r = subprocess.run([sys.executable, "-c", _TOKAMAX_COMPILE], capture_output=True, text=True, env=env,
                     timeout=600)
  assert r.returncode == 0 and "compiled 9" in r.stdout and "attention compiled 2" in r.stdout, r.stderr[-3000:]


def test_moe_impl_choice():
  """Runtime.moe_impl: megablox on TPU, tokamax on GPUs where it imports (else
  ragged_dot), ragged_dot on CPU; a bad name refused."""
  from mamba_train.model import runtime
  assert Runtime().resolve("tpu").moe_impl == "megablox"
  assert Runtime().resolve("cpu").moe_impl == "xla"
  assert Runtime().resolve("gpu").moe_impl == ("tokamax" if runtime.tokamax_imports() else "xla")
  old = Runtime(moe_impl="megablox_interpret").resolve("tpu")  # an old spelling, read as today's
  assert (old.moe_impl, old.interpret) == ("megablox", True)
  with pytest.raises(ValueError, match="moe_impl must be one of"):
    Runtime(moe_impl="bogus")


def test_router_is_nemotron_h():
  """The router against a numpy transcription of NemotronH's (grouped top-k over
  sigmoid scores plus the bias; the weights without it)."""
  cfg = MOE_CFG.replace(n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=2.0)
  rng = np.random.default_rng(0)
  p = {"router": rng.normal(size=(32, 8)).astype(np.float32),
       moe_lib.BIAS: rng.normal(0, 0.1, 8).astype(np.float32)}
  u = rng.normal(size=(50, 32)).astype(np.float32)
  experts, weights, _ = moe_lib.route(p, jnp.asarray(u), cfg)
  s = 1 / (1 + np.exp(-(u.astype(np.float64) @ p["router"])))
  c = s + p[moe_lib.BIAS]
  for t in range(50):
    groups = np.sort(c[t].reshape(4, 2), axis=1)[:, -2:].sum(1)
    allowed = np.repeat(np.isin(np.arange(4), np.argsort(groups)[-2:]), 2)
    best = np.argsort(np.where(allowed, c[t], -np.inf))[-3:]
    assert set(np.asarray(experts[t])) == set(best)
    w = s[t, np.asarray(experts[t])]
    np.testing.assert_allclose(weights[t], 2.0 * w / w.sum(), rtol=1e-5, atol=1e-7)


def test_packed_row_equals_each_document_alone():
  model = Mamba2LM(MOE_CFG, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  lens = (7, 13, 4)
  docs = [rng.integers(0, 90, n) for n in lens]
  row = jnp.asarray(np.concatenate(docs))[None]
  seq_idx = jnp.asarray(np.repeat(np.arange(3), lens))[None]
  packed = np.asarray(forward(model, row, seq_idx))[0]
  alone = np.zeros((3, 13), np.int32)
  for i, d in enumerate(docs):
    alone[i, :len(d)] = d
  alone = np.asarray(forward(model, jnp.asarray(alone), jnp.zeros((3, 13), jnp.int32)))
  start = 0
  for i, n in enumerate(lens):
    assert rel(packed[start:start + n], alone[i, :n]) < 1e-5
    start += n


@pytest.mark.parametrize("kw, match", [
    (dict(n_routed_experts=0), "n_routed_experts"),
    (dict(n_group=3), "n_group"),
    (dict(n_group=8), "two best"),
    (dict(topk_group=3), "topk_group"),
    (dict(num_experts_per_tok=5), "exceeds"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
])
def test_bad_moe_config(kw, match):
  with pytest.raises(ValueError, match=match):
    MOE_CFG.replace(**kw)


# ----------------------------------------------------------------------------
# Training: the router's load balancing and statistics.


def test_train_step_balances_routers():
  """The train step's router metrics are the forward pass's tokens per expert; the
  correction bias moves by rate * sign(mean - load) and no optimizer touches it;
  the auxiliary loss adds coef * its value to the loss; micro-batches add up."""
  from mamba_train.data import SyntheticLoader
  from mamba_train.parallel.mesh import make_mesh
  from mamba_train.train import balance, optim, state as train_state, step as trainer
  # Two MoE layers and nothing else: the router statistics are per MoE layer, and what
  # layers of other kinds feed them changes none of what is checked (their train step
  # compiles in half the CPU of the "EM-E" hybrid this used).
  cfg = MOE_CFG.replace(layer_pattern="EE", n_layer=2, vocab_size=64)
  ocfg = dict(lr=1e-2, schedule="constant", warmup_frac=0.0, decay_frac=0.0, final_lr_frac=0.1,
              b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0, state_dtype="float32")
  tx, schedule = optim.make_optimizer(ocfg, 10)
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  rt = Runtime().resolve("cpu")
  batch = trainer.to_global(next(SyntheticLoader(vocab_size=64, seq_len=24, global_batch_size=4, seed=0)), mesh)
  state = train_state.init_train_state(cfg, tx, mesh, seed=0)
  init = jax.device_get(state.params)
  ours = Mamba2LM.from_params(cfg, init, rt)
  fwd = nnx.jit(lambda m, ids, s: m.backbone(ids, seq_idx=s)[1])
  states = fwd(ours, batch["input_ids"], batch["seq_idx"])
  load, aux = np.asarray(states["moe_load"]), float(np.mean(states["moe_aux"]))
  # The loss is per micro-batch (rows i, i + 2 in micro-batch i of two), weighted by its tokens.
  halves = [fwd(ours, batch["input_ids"][i::2], batch["seq_idx"][i::2]) for i in (0, 1)]
  counts = [float(batch["loss_mask"][i::2].sum()) for i in (0, 1)]
  aux2 = sum(c * float(np.mean(h["moe_aux"])) for c, h in zip(counts, halves)) / sum(counts)
  assert load.shape == (2, 8) and (load.sum(-1) == 4 * 24 * 2).all()

  def run(coef, rate, accum):
    step = trainer.make_train_step(cfg, rt, tx, schedule, mesh, grad_accum=accum,
                                   moe=balance.MoeSpec(coef, rate))
    return jax.device_get(step(jax.tree.map(jnp.copy, state), batch))

  # Balancing on, in one batch; off, in two micro-batches (whose sums add up).
  (on, m), (off, m0) = run(1e-2, 1e-3, 1), run(0.0, 0.0, 2)
  for metrics, want_aux in ((m, aux), (m0, aux2)):
    np.testing.assert_array_equal(metrics["moe_tokens_per_expert"], load)
    assert float(metrics["moe_dropped_tokens"]) == 0.0 == float(metrics["moe_dropped_share"])
    assert float(metrics["moe_aux_loss"]) == pytest.approx(want_aux, rel=1e-5)
    assert float(metrics["moe_load_max"]) == pytest.approx(np.max(load / load.mean(-1, keepdims=True)))
  assert float(m["loss"]) - float(m0["loss"]) == pytest.approx(1e-2 * aux, rel=1e-3)  # (0.01 x ~1: 1e-5 of the loss)
  bias0 = np.asarray(init["moe"][moe_lib.BIAS])
  want = bias0 + 1e-3 * np.sign(load.mean(-1, keepdims=True) - load)
  np.testing.assert_allclose(on.params["moe"][moe_lib.BIAS], want, rtol=0, atol=1e-9)
  np.testing.assert_array_equal(off.params["moe"][moe_lib.BIAS], bias0)  # off: untouched
  for params, metrics in ((on.params, m), (off.params, m0)):  # the norm of the weights returned
    want_norm = np.sqrt(sum(np.sum(np.square(np.float64(x))) for x in jax.tree.leaves(params)))
    assert float(metrics["param_norm"]) == pytest.approx(want_norm, rel=1e-6)


def test_heads_not_a_multiple_of_d_model(tmp_path):
  """Nemotron-3-Nano's Mamba-2 layers have 64 heads of 64 on d_model 2688: d_inner
  4096 is no multiple of it, so the heads are given outright (mamba_num_heads)."""
  ref = hf_model(tmp_path, seed=5, **{**SMALL["grouped_ME*E"], "hidden_size": 40,
                                     "mamba_num_heads": 6})
  ours = load_model(tmp_path)
  assert (ours.config.mamba_num_heads, ours.config.d_inner, ours.config.d_model) == (6, 96, 40)
  reference_checks.assert_logits_match(ref, ours, length=13, seed=4)
  assert nemotron_h.ours_to_nemotron_h_config(ours.config)["mamba_num_heads"] == 6
  with pytest.raises(ValueError, match="mamba_num_heads"):
    mamba_ssm_layout.ours_to_mamba_ssm_config(ours.config)


def test_run_config_refusals():
  import sys
  sys.path.insert(0, str(__import__("helpers").ROOT))
  from configs import base
  from mamba_train.train.run_config import ConfigError, validate
  c = base.get_config()
  c.model.update(MOE_CFG.to_dict())
  assert validate(c, num_devices=8).moe.bias_update_rate == 1e-3
  # A softmax router (GraniteMoeHybrid) has no correction bias: the default rate does not
  # stop its finetune, it just moves nothing there.
  c.model.moe_router_score_function = "softmax"
  assert validate(c, num_devices=8).moe.bias_update_rate == 0.0
  c.model.moe_router_score_function = "sigmoid"
  c.mesh.update(data=1, expert=8)
  assert validate(c, num_devices=8).mesh_shape["expert"] == 8
  # config.layout 'auto': the non-expert weights inside the expert group on one host
  # (fsdp 1), fsdp alone once fsdp spans devices; one that cannot divide d_model refused.
  assert validate(c, num_devices=8).layout == "fsdp_expert"
  c.layout = "fsdp"
  assert validate(c, num_devices=8).layout == "fsdp"
  c.layout = "auto"
  c.mesh.update(expert=4, fsdp=2)
  assert validate(c, num_devices=8).layout == "fsdp"
  c.mesh.update(expert=2, fsdp=3)
  c.layout = "fsdp_expert"
  with pytest.raises(ConfigError, match=r"layout='fsdp_expert' splits the non-expert weights' d_model \(32\) "
                     r"over fsdp x expert = 6 devices"):
    validate(c, num_devices=6)
  c.layout = "zero3"
  c.mesh.update(expert=8, fsdp=1)
  with pytest.raises(ConfigError, match="layout must be 'auto' or one of"):
    validate(c, num_devices=8)
  c.layout = "auto"
  c.model.n_routed_experts, c.model.n_group = 12, 1
  with pytest.raises(ConfigError, match="n_routed_experts \\(12\\)"):
    validate(c, num_devices=8)
  c.model.n_routed_experts, c.moe.aux_loss_coef = 8, -1.0
  with pytest.raises(ConfigError, match="moe.aux_loss_coef"):
    validate(c, num_devices=8)
