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

and, with moe_router_score_function 'softmax' and mlp_act 'swiglu', the same
function as transformers' GraniteMoeHybridMoE plus its shared_mlp: the top k
router logits chosen, their weights the softmax over those k (no correction
bias); experts and shared expert gated, down(silu(gate x) * up x).

Dispatch is dropless by default: every token reaches each of its k experts.
With a capacity (`Runtime.moe_capacity_factor` cf > 0, MaxText's and
Megatron's capacity factor) each expert takes at most C = ceil(cf l k / E) of the
assignments of each sequence of l tokens, counted in token order (a token's k
choices in turn); the rest are dropped (they add nothing, the other weights are
not renormalised) and counted (`moe_dropped`). The count is per sequence, so the
function does not depend on how the batch is split over devices. The (token,
expert) pairs are laid out by expert (ties in token order, from running counts,
not a sort: ops/dispatch.py) and the experts run as two grouped matmuls
(`jax.lax.ragged_dot`: one (T k, w) x (E, w, f) product whose row groups are the
experts' tokens), so the program asks for T k rows of work whatever E. Who runs
them is the runtime's choice for the experts, made in `ops/table.py`: XLA's ragged_dot
(`ops/experts.py`), megablox on TPUs (`ops/experts_tpu.py`), tokamax's ragged dot
on NVIDIA GPUs (`ops/experts_gpu.py`). `experts_dense` (every expert on every
token, masked) is the reference it is tested against.
With the 'expert' mesh axis the experts are split over devices and tokens
travel to them by all-to-all (parallel/experts.py).

Router statistics come back with the output: the tokens each expert received
(summed over the batch) and the switch-style auxiliary loss
E * sum_e f_e P_e (f_e the fraction of assignments to e, P_e the mean
normalised score), which training may add to the loss; training also moves
e_score_correction_bias against the load (aux-loss-free balancing, train/step.py).

Precision: the router (its matmul, sigmoid, choice and weights) is float32 as
transformers keeps it (`_keep_in_fp32_modules_strict`); expert, latent and
shared matmuls in the compute dtype with float32 accumulation, forward and
backward (`dot_in`); the weighted sum float32.

Shapes: t tokens (b l flattened), d d_model, w expert width (d or latent), f
expert hidden units, s shared-expert hidden units, e experts, k experts per token.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mamba_train.model.config import Mamba2Config
from mamba_train.model.runtime import Runtime
from mamba_train.model.select import ops_for
from mamba_train.ops import experts as experts_ops
from mamba_train.ops.dispatch import assignment_slots, take_rows
from mamba_train.ops.experts import act
from mamba_train.ops.table import Ops
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
    "experts_gate": ("experts", "expert_embed", "expert_mlp"),  # (e, w, f), swiglu only
    "experts_down": ("experts", "expert_mlp", "expert_embed"),  # (e, f, w)
    "latent_down": ("embed", None),  # (d, w): transformers' fc1_latent_proj
    "latent_up": (None, "embed"),  # (w, d): fc2_latent_proj
    "shared_up": ("embed", "mlp"),  # (d, s)
    "shared_gate": ("embed", "mlp"),  # (d, s), swiglu only
    "shared_down": ("mlp", "embed"),  # (s, d)
}
# The matmul weights (the compute dtype); the router stays float32.
MATMUL_WEIGHTS = frozenset({"experts_up", "experts_gate", "experts_down", "latent_down", "latent_up",
                            "shared_up", "shared_gate", "shared_down"})
# The parameter no gradient moves: training updates it from the load (train/step.py).
BIAS = "e_score_correction_bias"
# The keys of the statistics an 'E' layer returns beside its output.
STATS = ("moe_load", "moe_aux", "moe_dropped")
# The dispatch's integer results (the chosen experts, which assignments are kept,
# row slots and their inverses, group sizes): every remat policy saves them
# (`lm.remat_policy`), a few hundred KB a layer, so the backward pass does not run
# the router's top-k and the dispatch's counts and index scatters again. On TPU each
# sort or scatter of the t k assignments is tens of thousands of instructions of
# program, compiled per occurrence (docs/bench/compile_depth.md).
DISPATCH = "moe_dispatch"
# The expert rows back in their tokens' order before the weighted sum (one device:
# the grouped matmuls' output), which the router weights' gradient reads. Under
# expert parallelism they are the return all-to-all's result, which 'save_moe' keeps
# by that primitive (`lm.remat_policy`).
RETURNED = "moe_returned_rows"
# What 'save_moe' keeps beyond every policy's DISPATCH: the routed experts' rows, hidden
# units and activation (`ops/experts.py`) and the rows returned, so the backward pass
# runs neither the dispatch, its all-to-alls nor the experts' forward products again. That pays with unrolled layers; in
# a layer scan the kept rows' per-layer stacks (zero-filled, written, copied out) cost
# more than the recompute they save (docs/bench/moe.md, "The MoE layer's rows kept").
SAVED_ROWS = (experts_ops.ROWS, experts_ops.HIDDEN, experts_ops.ACT, RETURNED)


def _saved(x):
  return checkpoint_name(x, DISPATCH)


def shapes(cfg: Mamba2Config) -> dict[str, tuple[int, ...]]:
  d, e, w, f, s = (cfg.d_model, cfg.n_routed_experts, cfg.moe_width, cfg.moe_intermediate_size,
                   cfg.moe_shared_expert_intermediate_size)
  out = {"norm": (d,), "router": (d, e), BIAS: (e,), "experts_up": (e, w, f), "experts_gate": (e, w, f),
         "experts_down": (e, f, w), "latent_down": (d, w), "latent_up": (w, d),
         "shared_up": (d, s), "shared_gate": (d, s), "shared_down": (s, d)}
  if cfg.moe_router_score_function != "sigmoid":  # only the sigmoid router has a correction bias
    del out[BIAS]
  if cfg.mlp_act != "swiglu":
    del out["experts_gate"], out["shared_gate"]
  if not cfg.moe_latent_size:
    del out["latent_down"], out["latent_up"]
  if not s:
    for name in ("shared_up", "shared_gate", "shared_down"):
      out.pop(name, None)
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
  float32): NemotronH's grouped top-k over sigmoid scores, or (softmax) the top k
  logits with the softmax over them as weights, and scores the softmax over every
  expert (what the auxiliary loss reads, as transformers' load_balancing_loss_func)."""
  logits = jnp.einsum("td,de->te", u.astype(F32), p["router"].astype(F32),
                      precision=jax.lax.Precision.HIGHEST)
  softmax = cfg.moe_router_score_function == "softmax"
  scores = jax.nn.softmax(logits, axis=-1) if softmax else jax.nn.sigmoid(logits)
  choice = logits if softmax else scores + p[BIAS].astype(F32)
  e, g, k = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
  if g > 1:
    grouped = choice.reshape(-1, g, e // g)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # (t, g)
    _, best = jax.lax.top_k(group_scores, cfg.topk_group)
    keep = jnp.any(best[:, :, None] == jnp.arange(g)[None, None, :], axis=1)  # (t, g)
    choice = jnp.where(jnp.repeat(keep, e // g, axis=1), choice, -jnp.inf)
  top, experts = jax.lax.top_k(choice, k)
  experts = _saved(experts)
  if softmax:
    return experts.astype(jnp.int32), jax.nn.softmax(top, axis=-1) * cfg.routed_scaling_factor, scores
  # Each choice's score by a compare and a sum over experts, not take_along_axis,
  # whose gradient is a scatter-add (libtpu: a sort and a scatter); the same values.
  weights = jnp.sum(jnp.where(experts[:, :, None] == jnp.arange(e), scores[:, None, :], 0.0), axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return experts.astype(jnp.int32), weights * cfg.routed_scaling_factor, scores


def counts(ids, n: int):
  """(n,) int32: how many of `ids` (any shape, values in [0, n) or outside, which
  count nowhere) equal each of 0..n-1. A compare and a sum, not jnp.bincount's
  scatter-add, which libtpu compiles as a sort of the ids and a scatter: a large
  piece of program each time (docs/bench/compile_depth.md)."""
  return jnp.sum(ids.reshape(-1, 1) == jnp.arange(n, dtype=ids.dtype), axis=0, dtype=jnp.int32)


def router_stats(experts, scores, cfg: Mamba2Config) -> dict[str, Array]:
  """Tokens per expert (e,) float32, and the auxiliary load-balancing loss (a
  scalar, 1 at a perfectly even load): E * sum_e f_e P_e with f_e the fraction of
  the t k assignments that went to e and P_e the mean over tokens of e's score
  normalised over experts (Switch Transformer's loss, as Megatron-Core computes it
  for sigmoid routers)."""
  e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
  load = counts(experts, e).astype(F32)
  t = experts.shape[0]
  frac = load / (t * k)
  probs = jnp.mean(scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20), axis=0)
  # The fractions count choices (no gradient); the probabilities carry it.
  return {"moe_load": load, "moe_aux": e * jnp.sum(jax.lax.stop_gradient(frac) * probs)}


# ----------------------------------------------------------------------------
# The experts.



def capacity(length: int, cfg: Mamba2Config, factor: float) -> int:
  """The assignments one expert takes from a sequence of `length` tokens at
  capacity factor `factor` > 0: ceil(factor * length * k / E), at least 1 (MaxText's
  per-sequence rule; 1.0 is an even share)."""
  return max(1, math.ceil(factor * length * cfg.num_experts_per_tok / cfg.n_routed_experts))


def within_capacity(experts, cap: int, before=None, *, n_experts: int):
  """experts (b, l, k) -> (b, l, k) bool: whether each assignment is among the first
  `cap` of its sequence to its expert, in token order (token-major, a token's k
  choices in turn). before (b, E): assignments each expert already took from
  earlier parts of the sequence (a sequence split over devices). By a running
  count of the one-hot (b, l k, E) assignments, not a sort (libtpu compiles each
  sort of the t k assignments as a large piece of program:
  docs/bench/compile_depth.md)."""
  b, l, k = experts.shape
  flat = experts.reshape(b, l * k)
  hot = (flat[..., None] == jnp.arange(n_experts, dtype=flat.dtype)).astype(jnp.int32)
  rank = jnp.sum((jnp.cumsum(hot, axis=1) - hot) * hot, axis=-1)  # earlier ones to the same expert
  if before is not None:
    rank = rank + jnp.take_along_axis(before.astype(rank.dtype), flat, axis=1)
  return (rank < cap).reshape(b, l, k)


def within_capacity_reference(experts, cap: int, n_experts: int):
  """`within_capacity` by a stable sort of each row's assignments by expert (an
  assignment's rank is its index minus its expert group's first), for tests."""
  del n_experts
  b, l, k = experts.shape
  flat = experts.reshape(b, l * k)
  order = jnp.argsort(flat, axis=1, stable=True)
  grouped = jnp.take_along_axis(flat, order, axis=1)
  first = jax.vmap(lambda g: jnp.searchsorted(g, g, side="left"))(grouped)
  rank = jnp.zeros_like(flat).at[jnp.arange(b)[:, None], order].set(jnp.arange(l * k) - first)
  return (rank < cap).reshape(b, l, k)


def experts_ragged(x, experts, weights, up, down, cd, expert_mlp: Callable, keep=None):
  """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) by grouped matmuls.

  x (t, w); experts, weights (t, k); up (e, w, f), or (gate, up) both (e, w, f)
  for swiglu experts; down (e, f, w); all already in the compute dtype `cd`;
  keep (t, k) bool or None: False drops the assignment (past its expert's
  capacity); expert_mlp: who runs the grouped matmuls (`Ops.expert_mlp`). Returns (t, w)
  float32. The t k (token, expert) pairs' rows are laid out by expert (ties in
  token order; dropped ones nowhere: the rows past every group are zero), both
  matmuls run per expert group, and each pair's row taken back, weighted and
  summed onto its token; the layout by running counts and the rows moved by
  gathers both ways (`ops/dispatch.py`), no sort."""
  t, k = experts.shape
  e = down.shape[0]
  flat = experts.reshape(-1) if keep is None else jnp.where(keep, experts, e).reshape(-1)
  slot, src, _ = (_saved(a) for a in assignment_slots(flat, 1, e, t * k))
  sizes = _saved(counts(flat, e))
  rows = checkpoint_name(expert_mlp(take_rows(x.astype(cd), src, slot, k), up, down, sizes, cd), RETURNED)
  # Token-major here, not the expert split's choice-major gather and `combine`
  # (parallel/experts.py): that form's gain was counted only on the TPU slices, and on
  # one device it moved the schedules' float32 rounding apart (layer scan against runs,
  # held to 1e-6 by tests/test_pattern_steps.py) by which products XLA fuses.
  got = take_rows(rows, slot, src) * weights.reshape(-1, 1)
  return jnp.sum(got.reshape(t, k, -1), axis=1)


def experts_dense(x, experts, weights, up, down, cd):
  """The reference: every expert on every token, (t, e, w), then the weighted sum
  of each token's chosen ones (the others masked to zero). Same arguments and
  result as `experts_ragged`; e times the work, for tests."""
  gate, up = up if isinstance(up, tuple) else (None, up)
  hidden = lambda w: jnp.einsum("tw,ewf->tef", x.astype(cd), w, preferred_element_type=F32)
  hid = act(hidden(up), None if gate is None else hidden(gate))
  out = jnp.einsum("tef,efw->tew", hid.astype(cd), down, preferred_element_type=F32)
  dense = jnp.zeros(out.shape[:2], F32).at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
  return jnp.einsum("tew,te->tw", out, dense)


@jax.custom_vjp
def dot_in(a, w):
  """a (t, d) times w (d, f) -> (t, f) float32: both operands in one dtype (the compute
  dtype), float32 accumulation. Its backward products run in that dtype too, the
  incoming float32 cotangent rounded to it first: plain autodiff would multiply the
  float32 cotangent by the weights widened to float32 (a float32 GEMM, its operands'
  float32 copies written and read: docs/bench/moe.md). The gradients are rounded to the
  operands' dtype as plain autodiff's are; in float32 it is plain autodiff's arithmetic."""
  return jnp.einsum("td,df->tf", a, w, preferred_element_type=F32)


def _dot_in_fwd(a, w):
  return dot_in(a, w), (a, w)


def _dot_in_bwd(res, g):
  a, w = res
  g = g.astype(a.dtype)
  return (jnp.einsum("tf,df->td", g, w, preferred_element_type=F32).astype(a.dtype),
          jnp.einsum("td,tf->df", a, g, preferred_element_type=F32).astype(w.dtype))


dot_in.defvjp(_dot_in_fwd, _dot_in_bwd)


def moe(p, u, cfg: Mamba2Config, rt: Runtime, ops: Ops | None = None, *, dense: bool = False):
  """The layer's function (no residual): u (..., d) float32 (normed) -> (..., d)
  float32, and its router statistics (`router_stats`). ops: who runs the grouped
  matmuls (`Ops.expert_mlp`; `select.ops_for(cfg, rt)` unless given). dense: the
  reference dispatch (`experts_dense`)."""
  ops = ops_for(cfg, rt) if ops is None and not dense else ops
  cd = jnp.dtype(rt.compute_dtype)
  lead = u.shape[:-1]
  x = u.reshape(-1, u.shape[-1])
  experts, weights, scores = route(p, x, cfg)
  factor = rt.moe_capacity_factor
  # Capacity is per sequence: one position per row (decoding) never exceeds it.
  cap = capacity(lead[-1], cfg, factor) if factor and len(lead) == 2 else None
  keep = None
  if cap is not None and (dense or sharding.expert_split() is None):
    rows3 = experts.reshape(*lead, -1)
    keep = _saved((within_capacity_reference(rows3, cap, cfg.n_routed_experts) if dense
                   else within_capacity(rows3, cap, n_experts=cfg.n_routed_experts)).reshape(experts.shape))
  mm = lambda a, w: dot_in(a.astype(cd), w.astype(cd))
  xe = mm(x, p["latent_down"]) if cfg.moe_latent_size else x
  up, down = p["experts_up"].astype(cd), p["experts_down"].astype(cd)
  if "experts_gate" in p:
    up = (p["experts_gate"].astype(cd), up)
  split = None if dense else sharding.expert_split()
  if dense:
    y = experts_dense(xe, experts, weights if keep is None else jnp.where(keep, weights, 0.0), up, down, cd)
  elif split is None:
    y = experts_ragged(xe, experts, weights, up, down, cd, ops.expert_mlp, keep)
  else:  # under a mesh: each device its own tokens, experts over the 'expert' axis
    shaped = lambda a: a.reshape(*lead, a.shape[-1])
    y, keep = split.experts(ops.expert_mlp, shaped(xe.astype(cd)), shaped(experts), shaped(weights), up, down,
                            cd, cap, functools.partial(within_capacity, n_experts=cfg.n_routed_experts),
                            check_vma=ops.expert_mlp_checks_vma, mark=_saved,
                            count=counts)
    y, keep = y.reshape(x.shape[0], -1), None if keep is None else keep.reshape(experts.shape)
  if cfg.moe_latent_size:
    y = mm(y, p["latent_up"])
  if cfg.moe_shared_expert_intermediate_size:
    gate = mm(x, p["shared_gate"]) if "shared_gate" in p else None
    y = y + mm(act(mm(x, p["shared_up"]), gate), p["shared_down"])
  stats = router_stats(experts, scores, cfg)
  stats["moe_dropped"] = jnp.zeros((), F32) if keep is None else jnp.sum(~keep).astype(F32)
  return y.reshape(*lead, -1), stats
