"""The mixture-of-experts layer of a hybrid ('E' in `Mamba2Config.layer_pattern`),
the same function as transformers' NemotronHMoE: a pre-norm residual block
h + moe(rmsnorm(h)) whose moe is

  router   scores = sigmoid(u W_r) (float32); the experts chosen by scores +
           e_score_correction_bias, best num_experts_per_tok among the experts of
           the topk_group best groups of n_group (a group scored by its two best);
           their weights are the scores without the bias, renormalised to sum to 1
           (norm_topk_prob) and times routed_scaling_factor;
  experts  each a squared-ReLU MLP down(relu(up x)^2) over the width moe_width:
           d_model, or moe_latent_size with the latent projection (x = u W_fc1
           before them, their weighted sum times W_fc2 after);
  shared   a squared-ReLU MLP of moe_shared_expert_intermediate_size on u, added.

Dispatch is dropless: every token reaches each of its k experts. The (token,
expert) pairs are sorted by expert and the experts run as two grouped matmuls
(`jax.lax.ragged_dot`: one (T k, w) x (E, w, f) product whose row groups are the
experts' tokens), so the work is T k rows whatever E, never a dense
all-experts product. ragged_dot is XLA's own op: it differentiates, runs on
every backend, and lowers to a grouped matmul on TPU and GPU; tokamax's and
megablox's kernels are faster on TPU but pin versions this library does not. `experts_dense`
(every expert on every token, masked) is the reference it is tested against.
With the 'expert' mesh axis the experts are split over devices and tokens
travel to them by all-to-all (parallel/experts.py).

Router statistics come back with the output: the tokens each expert received
(summed over the batch) and the switch-style auxiliary loss
E * sum_e f_e P_e (f_e the fraction of assignments to e, P_e the mean
normalised score), which training may add to the loss; training also moves
e_score_correction_bias against the load (aux-loss-free balancing, train/step.py).

Precision: the router (its matmul, sigmoid, choice and weights) is float32 as
transformers keeps it (`_keep_in_fp32_modules_strict`); expert, latent and
shared matmuls in the compute dtype with float32 accumulation; the weighted sum
float32.

Shapes: t tokens (b l flattened), d d_model, w expert width (d or latent), f
expert hidden units, s shared-expert hidden units, e experts, k experts per token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mamba_train.model.config import Mamba2Config
from mamba_train.model.runtime import Runtime
from mamba_train.parallel import sharding

F32 = jnp.float32
Array = jax.Array

# One layer's parameters and their logical axes (the stacked `layers` axis is
# prepended). 'experts' is what expert parallelism splits; an expert's hidden
# units ('expert_mlp') what tensor parallelism splits.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "norm": ("embed",),
    "router": ("embed", None),  # (d, e) float32
    "e_score_correction_bias": (None,),  # (e,) float32, moved by training, not by gradients
    "experts_up": ("experts", "expert_embed", "expert_mlp"),  # (e, w, f)
    "experts_down": ("experts", "expert_mlp", "expert_embed"),  # (e, f, w)
    "latent_down": ("embed", None),  # (d, w): transformers' fc1_latent_proj
    "latent_up": (None, "embed"),  # (w, d): fc2_latent_proj
    "shared_up": ("embed", "mlp"),  # (d, s)
    "shared_down": ("mlp", "embed"),  # (s, d)
}
# The matmul weights (the compute dtype); the router stays float32.
MATMUL_WEIGHTS = frozenset({"experts_up", "experts_down", "latent_down", "latent_up",
                            "shared_up", "shared_down"})
# The parameter no gradient moves: training updates it from the load (train/step.py).
BIAS = "e_score_correction_bias"
# The keys of the statistics an 'E' layer returns beside its output.
STATS = ("moe_load", "moe_aux")


def shapes(cfg: Mamba2Config) -> dict[str, tuple[int, ...]]:
  d, e, w, f, s = (cfg.d_model, cfg.n_routed_experts, cfg.moe_width, cfg.moe_intermediate_size,
                   cfg.moe_shared_expert_intermediate_size)
  out = {"norm": (d,), "router": (d, e), BIAS: (e,), "experts_up": (e, w, f),
         "experts_down": (e, f, w), "latent_down": (d, w), "latent_up": (w, d),
         "shared_up": (d, s), "shared_down": (s, d)}
  if not cfg.moe_latent_size:
    del out["latent_down"], out["latent_up"]
  if not s:
    del out["shared_up"], out["shared_down"]
  return out


def param_axes(cfg: Mamba2Config) -> dict[str, tuple[str | None, ...]]:
  return {name: PARAM_AXES[name] for name in shapes(cfg)}


def init_params(cfg: Mamba2Config, key) -> dict[str, Array]:
  """One layer's parameters: the router normal(0, 0.02) as transformers initialises
  it, the correction bias zero, every matmul torch's nn.Linear default
  uniform(+-1/sqrt(fan_in)), the projections back into the residual stream
  scaled by 1/sqrt(n_layer) as the other kinds' are."""
  out = {}
  for i, (name, shape) in enumerate(shapes(cfg).items()):
    k = jax.random.fold_in(key, i)
    if name == "norm":
      out[name] = jnp.ones(shape, F32)
    elif name == BIAS:
      out[name] = jnp.zeros(shape, F32)
    elif name == "router":
      out[name] = 0.02 * jax.random.normal(k, shape, F32)
    else:
      bound = 1.0 / math.sqrt(shape[-2])
      if name in ("experts_down", "shared_down") and not (name == "experts_down" and cfg.moe_latent_size):
        bound /= math.sqrt(cfg.n_layer)
      elif name == "latent_up":
        bound /= math.sqrt(cfg.n_layer)
      out[name] = jax.random.uniform(k, shape, F32, -bound, bound)
  return out


# ----------------------------------------------------------------------------
# The router.


def route(p, u, cfg: Mamba2Config):
  """u (t, d) float32 -> (experts (t, k) int32, weights (t, k) float32, scores (t, e)
  float32): NemotronH's grouped top-k over sigmoid scores (see the module doc)."""
  logits = jnp.einsum("td,de->te", u.astype(F32), p["router"].astype(F32),
                      precision=jax.lax.Precision.HIGHEST)
  scores = jax.nn.sigmoid(logits)
  choice = scores + p[BIAS].astype(F32)
  e, g, k = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
  if g > 1:
    grouped = choice.reshape(-1, g, e // g)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # (t, g)
    _, best = jax.lax.top_k(group_scores, cfg.topk_group)
    keep = jnp.any(best[:, :, None] == jnp.arange(g)[None, None, :], axis=1)  # (t, g)
    choice = jnp.where(jnp.repeat(keep, e // g, axis=1), choice, -jnp.inf)
  _, experts = jax.lax.top_k(choice, k)
  weights = jnp.take_along_axis(scores, experts, axis=1)
  if cfg.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor, scores


def router_stats(experts, scores, cfg: Mamba2Config) -> dict[str, Array]:
  """Tokens per expert (e,) float32, and the auxiliary load-balancing loss (a
  scalar, 1 at a perfectly even load): E * sum_e f_e P_e with f_e the fraction of
  the t k assignments that went to e and P_e the mean over tokens of e's score
  normalised over experts (Switch Transformer's loss, as Megatron-Core computes it
  for sigmoid routers)."""
  e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
  load = jnp.zeros((e,), F32).at[experts.reshape(-1)].add(1.0)
  t = experts.shape[0]
  frac = load / (t * k)
  probs = jnp.mean(scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20), axis=0)
  # The fractions count choices (no gradient); the probabilities carry it.
  return {"moe_load": load, "moe_aux": e * jnp.sum(jax.lax.stop_gradient(frac) * probs)}


# ----------------------------------------------------------------------------
# The experts.


def _relu2(x):
  return jnp.square(jax.nn.relu(x))


def experts_ragged(x, experts, weights, up, down, cd):
  """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) by grouped matmuls.

  x (t, w); experts, weights (t, k); up (e, w, f), down (e, f, w), already in
  the compute dtype `cd`. Returns (t, w) float32. The t k (token, expert) pairs
  are sorted by expert (a stable sort: ties keep token order), each pair's token
  row gathered, both matmuls run per expert group, and each row scattered back
  onto its token with its weight."""
  t, k = experts.shape
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  token = order // k
  sizes = jnp.bincount(flat, length=up.shape[0]).astype(jnp.int32)
  rows = expert_mlp(jnp.take(x.astype(cd), token, axis=0), up, down, sizes, cd)
  w = jnp.take(weights.reshape(-1), order)
  return jnp.zeros((t, rows.shape[-1]), F32).at[token].add(rows * w[:, None])


def expert_mlp(rows, up, down, sizes, cd):
  """rows (m, w) sorted by expert, sizes (e,) rows per expert (summing to at most m;
  rows past the sum meet no expert and come out zero) -> (m, w) float32."""
  hid = jax.lax.ragged_dot(rows, up, sizes, preferred_element_type=F32)
  return jax.lax.ragged_dot(_relu2(hid).astype(cd), down, sizes, preferred_element_type=F32)


def experts_dense(x, experts, weights, up, down, cd):
  """The reference: every expert on every token, (t, e, w), then the weighted sum
  of each token's chosen ones (the others masked to zero). Same arguments and
  result as `experts_ragged`; e times the work, for tests."""
  hid = jnp.einsum("tw,ewf->tef", x.astype(cd), up, preferred_element_type=F32)
  out = jnp.einsum("tef,efw->tew", _relu2(hid).astype(cd), down, preferred_element_type=F32)
  dense = jnp.zeros(out.shape[:2], F32).at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
  return jnp.einsum("tew,te->tw", out, dense)


def moe(p, u, cfg: Mamba2Config, rt: Runtime, *, dense: bool = False):
  """The layer's function (no residual): u (..., d) float32 (normed) -> (..., d)
  float32, and its router statistics (`router_stats`). dense: the reference
  dispatch (`experts_dense`)."""
  cd = jnp.dtype(rt.compute_dtype)
  lead = u.shape[:-1]
  x = u.reshape(-1, u.shape[-1])
  experts, weights, scores = route(p, x, cfg)
  mm = lambda a, w: jnp.einsum("td,dw->tw", a.astype(cd), w.astype(cd), preferred_element_type=F32)
  xe = mm(x, p["latent_down"]) if cfg.moe_latent_size else x
  up, down = p["experts_up"].astype(cd), p["experts_down"].astype(cd)
  split = None if dense else sharding.expert_split()
  if dense:
    y = experts_dense(xe, experts, weights, up, down, cd)
  elif split is None:
    y = experts_ragged(xe, experts, weights, up, down, cd)
  else:  # under a mesh: each device its own tokens, experts over the 'expert' axis
    shaped = lambda a: a.reshape(*lead, a.shape[-1])
    y = split.experts(expert_mlp, shaped(xe.astype(cd)), shaped(experts), shaped(weights), up, down, cd)
    y = y.reshape(x.shape[0], -1)
  if cfg.moe_latent_size:
    y = mm(y, p["latent_up"])
  if cfg.moe_shared_expert_intermediate_size:
    y = y + mm(_relu2(mm(x, p["shared_up"])), p["shared_down"])
  return y.reshape(*lead, -1), router_stats(experts, scores, cfg)
