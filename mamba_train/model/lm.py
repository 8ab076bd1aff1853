"""The language model in Flax NNX: the same function as mamba_ssm's MambaLMHeadModel
with Mamba2 mixers, and as transformers' Mamba2ForCausalLM; with a `layer_pattern`,
a hybrid of Mamba-2, attention, MLP and mixture-of-experts layers, the same
function as transformers' NemotronHForCausalLM.

Layers are stored stacked (a leading `layers` axis on every block parameter, one
stack per layer kind: `params.KIND_PARAMS`) and run with `jax.lax.scan`
(`pattern.py`), so compile time does not grow with depth. The per-layer math is
pure functions of a dict of that layer's arrays (Mamba-2: `mamba2.py`; attention
and MLP: `attention.py`; mixture of experts: `moe.py`).

Precision policy: parameters float32; the LM head runs in the runtime's compute
dtype or matmul_precision (`matmul.head`); the residual stream, norms and logits
are float32.

Shapes: b batch, l length, d d_model, v vocabulary.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mamba_train.model import (
  attention as attn_lib,
  lora as lora_lib,
  mamba3 as m3,
  matmul as mm,
  moe as moe_lib,
  pattern as pattern_lib,
)
from mamba_train.model.config import ATTENTION, MAMBA, MAMBA3, MLP, MOE, Mamba2Config
from mamba_train.model.mamba2 import (
  IN_PROJ_NAMES,
  block,
  block_step,
  fused_decode_weights,
  residual,
  rms_norm,
)
from mamba_train.model.params import (
  ADAPTERS,
  KIND_PARAMS,
  MATMUL_WEIGHTS,
  STATE_KEYS,
  init_params,
  kind_axes,
  param_shapes,
  shape_problems,
  state_keys,
  unstack,
)
from mamba_train.model.runtime import Runtime
from mamba_train.model.select import ops_for
from mamba_train.ops.table import Ops
from mamba_train.parallel import sharding

F32 = jnp.float32
Array = jax.Array


def _param(value, axes):
  return nnx.Param(value, logical_axes=tuple(axes))


def remat_policy(name: str, ops: Ops):
  """The `jax.checkpoint` policy of the runtime's remat `name` (runtime.REMAT, not
  'none'), for a model whose SSD runs as `ops` says."""
  cp = jax.checkpoint_policies
  # Every policy also saves the MoE dispatch's integer results (moe_lib.DISPATCH: small,
  # and costly to recompute and to compile again on TPU).
  save = lambda *names: cp.save_only_these_names(*names, moe_lib.DISPATCH)
  policies = {
      "full": save(),  # recompute everything in the backward pass but the MoE dispatch's indices
      # The in_proj results (one (b, l, 2i + 2gn) buffer in the compute dtype, and dt):
      # the backward pass recomputes only what is cheap from them (the conv + SiLU, the
      # dt softplus, the SSD's forward, the gate and norm), not the pre-norm and the
      # in_proj matmul with its weight's read.
      "save_in_proj": save(*IN_PROJ_NAMES),
      # And the SSD kernel's output and entering states (Pallas on TPU, Triton on
      # GPUs), so the backward pass does not run the forward kernel again.
      "save_in_proj_ssd": save(*IN_PROJ_NAMES, *ops.ssd_save_names),
      # The matmuls' results, and what `Ops.ssd_saved_with_matmuls` says of the SSD kernel's.
      "save_matmuls": cp.save_from_both_policies(cp.dots_with_no_batch_dims_saveable,
                                                 save(*ops.ssd_saved_with_matmuls)),
      # As 'full', and the MoE layers' routed rows, hidden units and activation and the
      # rows returned (`moe.SAVED_ROWS`; under expert parallelism the return all-to-all's
      # result, kept by its primitive: the one all-to-all whose result the backward
      # pass reads), so the backward pass runs no dispatch, all-to-all or experts'
      # forward product again. The other kinds are recomputed as under 'full'. For
      # unrolled layers: in a layer scan the kept rows' stacks cost more than they save
      # (docs/bench/moe.md, "The MoE layer's rows kept").
      "save_moe": cp.save_from_both_policies(save(*moe_lib.SAVED_ROWS), _all_to_all_saveable),
  }
  return policies[name]


def _all_to_all_saveable(prim, *_, **__) -> bool:
  """A `jax.checkpoint` policy: keep every all-to-all's result. Only those the backward
  pass reads become residuals; under 'save_moe' that is the MoE's return all-to-all
  (the rows its router weights' gradient reads), as the rows sent are read only
  through the expert rows, which the policy keeps by name."""
  return prim.name == "all_to_all"


class Mamba2LM(nnx.Module):
  """Mamba-2 language model. `model(input_ids) -> logits (b, l, vocab_size)` in float32.

  `config` is the architecture; `runtime` how it runs (default `Runtime()`), resolved
  for JAX's default backend unless the caller resolved it for another target.
  """

  def __init__(self, config: Mamba2Config, *, rngs: nnx.Rngs, runtime: Runtime | None = None):
    self.config = config
    self.runtime = (runtime or Runtime()).resolve()
    # LoRA (model/lora.py): the spec and the adapters, set by `from_params`; None without.
    self.lora: lora_lib.LoraSpec | None = None
    self.adapters = nnx.data(None)
    # The adapters' dropout key for this training step (`lora.dropout`); None: no dropout.
    self.dropout_key = nnx.data(None)
    init = init_params(config, rngs.params())
    self.embedding = _param(init["embedding"], ("vocab", "embed"))
    for kind, attr in KIND_PARAMS.items():
      if config.count(kind):
        setattr(self, attr, nnx.Dict({name: _param(init[attr][name], ("layers",) + axes)
                                      for name, axes in kind_axes(config, kind).items()}))
    self.norm_f = _param(init["norm_f"], ("embed",))
    if not config.tie_embeddings:
      self.lm_head = _param(init["lm_head"], ("vocab", "embed"))

  # -- pieces, also used by training (loss on hidden states) and generation --

  def layer_params(self, kind: str = MAMBA) -> dict[str, Array]:
    """The stacked parameters of the layers of `kind` (default the Mamba-2 ones)."""
    stack = getattr(self, KIND_PARAMS[kind])
    out = {name: stack[name].get_value() for name in kind_axes(self.config, kind)}
    if "in_proj_zx" in out and out["in_proj_zx"].ndim == 3:  # held joined (`for_inference`)
      zx = out["in_proj_zx"]
      out["in_proj_zx"] = zx.reshape(*zx.shape[:2], 2, -1)
    return out

  def _compute_params(self, kind: str) -> dict[str, Array]:
    """`layer_params(kind)` with the matmul weights in the compute dtype: cast once
    for the whole stack, before the layer loop, not inside every layer (where each
    use, and a remat's recompute, reads the float32 weight and writes a copy),
    and a sharded stack is gathered per layer in the compute dtype. Gradients are
    the same: a cast's cotangent is rounded to the cast dtype either way.

    With adapters the weights stay as stored (float32, or quantized) and travel with
    the kind's adapters under ADAPTERS: each layer merges (or, on the separate path,
    dequantizes) and casts its own (`_layer_fns`), so no whole merged or dequantized
    stack is made. On the separate path the adapters travel as `matmul.LayerAdapters`
    with one dropout key per layer when the model has a dropout key."""
    if self.lora is None:
      return self._matmuls_in_compute_dtype(self.layer_params(kind))
    ab = self.adapters.get(KIND_PARAMS[kind], {})
    if not self.lora.separate:
      return {**self.layer_params(kind), ADAPTERS: ab}
    keys = None
    if self.dropout_key is not None:
      salt = list(KIND_PARAMS).index(kind)
      keys = jax.random.split(jax.random.fold_in(self.dropout_key, salt), self.config.count(kind))
    return {**self.layer_params(kind),
            ADAPTERS: mm.LayerAdapters(ab, keys, self.lora.scale, self.lora.dropout)}

  def _merged_layer(self, p: dict[str, Array]) -> dict[str, Array]:
    """One layer's weights with its adapters merged in, matmuls in the compute dtype;
    on the separate path the base as it is (dequantized) and the adapters beside it."""
    weights = {n: a for n, a in p.items() if n != ADAPTERS}
    if self.lora.separate:
      return {**self._matmuls_in_compute_dtype({n: lora_lib.dense(w) for n, w in weights.items()}),
              ADAPTERS: p[ADAPTERS]}
    return self._matmuls_in_compute_dtype(lora_lib.merge_layer(weights, p[ADAPTERS], self.lora))

  def _matmuls_in_compute_dtype(self, params: dict[str, Array]) -> dict[str, Array]:
    cd = jnp.dtype(self.runtime.compute_dtype)
    return {n: a.astype(cd) if n in MATMUL_WEIGHTS else a for n, a in params.items()}

  def _kinds(self) -> list[str]:
    return [k for k in KIND_PARAMS if self.config.count(k)]

  def _layer_fns(self, ops: Ops, *, seq_idx=None, mask=None, decode=False):
    """kind -> f(p, h, state) -> (h, state): one residual block of that kind, over
    a sequence (h (b, l, d)) or, with decode, one position (h (b, d)), its
    operations run as `ops` (`select.ops_for`) says."""
    cfg, rt = self.config, self.runtime
    norm = lambda p, h: rms_norm(h, p["norm"], cfg.norm_eps)
    if decode:
      def attn(p, h, st):
        out, st = attn_lib.attention_step(p, norm(p, h), cfg, rt, st)
        return residual(h, out, cfg), st
      return {MAMBA: lambda p, h, st: block_step(p, h, cfg, rt, st, ops), ATTENTION: attn,
              MAMBA3: lambda p, h, st: m3.block_step(p, h, cfg, rt, st, ops),
              MLP: lambda p, h, st: (residual(h, attn_lib.mlp(p, norm(p, h), cfg, rt), cfg), None),
              MOE: lambda p, h, st: (residual(h, moe_lib.moe(p, norm(p, h), cfg, rt, ops)[0], cfg), None)}
    act = lambda h: sharding.constrain(h, ("batch", "act_length", "act_embed"))

    def mamba(p, h, st):
      h, st = block(p, h, cfg, rt, seq_idx=seq_idx, mask=mask, state=st, ops=ops)
      return act(h), st

    def mamba3(p, h, st):
      h, st = m3.block(p, h, cfg, rt, seq_idx=seq_idx, mask=mask, state=st, ops=ops)
      return act(h), st

    def attn(p, h, _):
      out, kv = attn_lib.attention(p, norm(p, h), cfg, rt, ops, seq_idx=seq_idx, mask=mask)
      return act(residual(h, out, cfg)), kv

    def mlp(p, h, _):
      return act(residual(h, attn_lib.mlp(p, norm(p, h), cfg, rt), cfg)), None

    def moe(p, h, _):  # its router statistics travel as its state (moe.STATS)
      out, stats = moe_lib.moe(p, norm(p, h), cfg, rt, ops)
      return act(residual(h, out, cfg)), stats

    fns = {MAMBA: mamba, ATTENTION: attn, MLP: mlp, MOE: moe, MAMBA3: mamba3}
    if self.lora is not None:  # inside the remat: the backward pass merges again, nothing is kept
      fns = {k: (lambda p, h, st, f=f: f(self._merged_layer(p), h, st)) for k, f in fns.items()}
    return fns

  def _remat(self, ops: Ops):
    """`pattern.run`'s remat: the runtime's policy, or None for 'none'."""
    policy = self.runtime.remat
    if policy == "none":
      return None
    return lambda f, prevent_cse: jax.checkpoint(f, policy=remat_policy(policy, ops), prevent_cse=prevent_cse)

  def _by_kind(self, states) -> dict[str, Any]:
    """A flat states dict -> {kind: its states} (kinds without state: None)."""
    return {k: ({n: states[n] for n in state_keys(self.config, k)} if STATE_KEYS[k] else None)
            for k in self._kinds()}

  @staticmethod
  def _flat(by_kind) -> dict[str, Array]:
    return {n: a for st in by_kind.values() if st is not None for n, a in st.items()}

  def embed(self, input_ids):
    """The embedding rows of input_ids (..., d) float32, times embedding_multiplier (Granite)."""
    table = self.embedding.get_value()
    split = sharding.embedding_split(table.shape, input_ids.shape)
    h = split.lookup(table, input_ids) if split else jnp.take(table, input_ids, axis=0)
    m = self.config.embedding_multiplier
    return h if m == 1.0 else h * m

  def head_operands(self, h):
    """(x, w) whose product x w^T is the logits (padded vocabulary) of the residual
    stream h (..., d): what the blockwise loss takes. x is the final norm of h and w
    the head (float32), merged with its adapter; on LoRA's separate path the
    adapter instead joins as r more columns, x = [norm(h), scale dropout(norm(h)) A]
    and w = [W, B^T], so the loss's one matmul runs it (its backward forms the
    gradient of every column, the base's too, as it does for a merged head)."""
    x = self.final_norm(h)
    ad = self.adapters.get(lora_lib.HEAD) if self.lora is not None else None
    if ad is None or not self.lora.separate:
      return x, self.head_weight()
    w = (self.embedding if self.config.tie_embeddings else self.lm_head).get_value()
    key = None if self.dropout_key is None else jax.random.fold_in(self.dropout_key, len(KIND_PARAMS))
    adapter = mm.Adapter(ad["a"], ad["b"], key, self.lora.scale, self.lora.dropout)
    xa = adapter.project_in(x, self.runtime.compute_dtype)
    return jnp.concatenate([x, xa], -1), jnp.concatenate([lora_lib.dense(w), ad["b"].T], -1)

  def head_weight(self):
    """The LM head (padded vocabulary, d) float32, with its adapter when it has one."""
    w = (self.embedding if self.config.tie_embeddings else self.lm_head).get_value()
    if self.lora is not None:
      return lora_lib.merge_head(w, self.adapters.get(lora_lib.HEAD), self.lora)
    return w

  def final_norm(self, h):
    """The norm before the LM head: (..., d) float32; divided by logits_scaling
    (Granite) here, so every product with the head (logits, the blockwise loss,
    decoding) gives logits / logits_scaling."""
    x = rms_norm(h, self.norm_f.get_value(), self.config.norm_eps)
    s = self.config.logits_scaling
    return x if s == 1.0 else x / s

  def head_for_logits(self, decode: bool = False):
    """The LM head as `logits` multiplies by it: (vocab_size, d) in the compute dtype;
    for decoding (`decode`), quantized once in the runtime's matmul_precision."""
    # The padding rows are dropped from the weight, inside its cast to the compute
    # dtype, not from the logits: slicing (b, l, padded vocab) logits copies them.
    w = self.head_weight()[: self.config.vocab_size]
    if decode:
      return mm.quantize_head(w, self.runtime.matmul_precision, self.runtime.compute_dtype)
    return w.astype(self.runtime.compute_dtype)

  def logits(self, h, head=None):
    """Final norm and LM head: (..., d) -> (..., vocab_size) float32 (padding rows
    dropped). head: `head_for_logits()` computed once by a caller that reuses it
    (a decode loop), else made here."""
    w = self.head_for_logits() if head is None else head
    return mm.head(self.final_norm(h), w, self.runtime.compute_dtype)

  def backbone(self, input_ids, *, seq_idx=None, mask=None, states=None):
    """Embedding and all blocks. Returns the residual stream (b, l, d) before the
    final norm, and the per-layer states stacked over each kind's layers: the
    Mamba-2 layers' recurrent states (continued from `states` when given), an
    attention layer's keys and values {k, v} (b, l, kv, e) (`Mamba2Cache.from_prefill`
    puts them in a decoding buffer), a mixture-of-experts layer's router
    statistics (`moe.STATS`: tokens per expert, auxiliary loss)."""
    cfg = self.config
    h = sharding.constrain(self.embed(input_ids), ("batch", "act_length", "act_embed"))
    b = input_ids.shape[0]
    if states is not None and cfg.count(ATTENTION):
      raise ValueError("backbone cannot continue attention layers from earlier states; "
                       "run the whole prefix, or decode with `step`")
    if states is not None and cfg.ssd_window:
      raise ValueError(f"backbone cannot continue a windowed model (ssd_window={cfg.ssd_window}) "
                       "from earlier states: run the whole prefix, or decode with `step`")
    given = lambda kind: {n: states[n] for n in state_keys(cfg, kind)}
    init = {}
    if cfg.count(MAMBA):
      # Without states a Mamba-2 layer starts from none (`mamba2.mixer` makes its zeros
      # where it needs them: the fused kernel on chip, not read from HBM).
      init[MAMBA] = None if states is None else given(MAMBA)
    if cfg.count(MAMBA3):
      init[MAMBA3] = (given(MAMBA3) if states is not None else
                      jax.vmap(lambda _: m3.zero_state(cfg, b))(jnp.arange(cfg.count(MAMBA3))))
    ops = ops_for(cfg, self.runtime)
    h, new = pattern_lib.run(pattern_lib.plan(cfg.pattern), self._layer_fns(ops, seq_idx=seq_idx, mask=mask),
                             {k: self._compute_params(k) for k in self._kinds()}, init, h,
                             unroll=self.runtime.unroll_layers, remat=self._remat(ops))
    return h, self._flat(new)

  def step(self, input_ids, states, layers=None):
    """One token per sequence through every block, for decoding: input_ids (b,),
    states stacked over layers as a `Mamba2Cache` holds them. Returns the residual
    stream (b, d) before the final norm and the new states. Never goes through
    the chunked scan, so a Mamba-2 layer's step costs the same at any context
    length; an attention layer's grows with its buffer's capacity. layers: the
    stacked layer parameters per kind to use instead of the model's
    (`decode_layers(unrolled=False)`)."""
    if self.lora is not None:
      raise ValueError("decode a model with adapters through `merged()` (generate does)")
    if layers is None:
      layers = {k: self.layer_params(k) for k in self._kinds()}
    ops = ops_for(self.config, self.runtime)
    h, new = pattern_lib.run(pattern_lib.plan(self.config.pattern), self._layer_fns(ops, decode=True),
                             layers, self._by_kind(states), self.embed(input_ids))
    return h, self._flat(new)

  def decode_layers(self, unrolled: bool):
    """The layer parameters a decode loop reads every token, made once before the
    loop: the matmul weights (`MATMUL_WEIGHTS`) already in the compute dtype, or
    quantized once in the runtime's matmul_precision (`matmul.quantize_weights`),
    so no step converts them again (the converted values are the ones each step
    would make, so the tokens are the same); norms, conv, dt, A and D stay
    float32. Per layer in pattern order for `step_unrolled` (unrolled), else
    stacked per kind for `step`."""
    if self.lora is not None:
      raise ValueError("decode a model with adapters through `merged()` (generate does)")
    if unrolled:
      return [self._decode_weights(p, 0) for p in self.unstacked_layers()]
    return {k: self._decode_weights(self.layer_params(k), 1) for k in self._kinds()}

  def _decode_weights(self, params: dict[str, Array], lead: int) -> dict[str, Array]:
    rt = self.runtime
    ops = ops_for(self.config, rt)
    if "A_log" in params and ops.decode is not None:  # a Mamba-2 layer's fused step
      return fused_decode_weights(params, rt, ops, lead)
    return {n: (mm.quantize_weights(a, rt.matmul_precision, 2 if n == "o_proj" else 1, rt.compute_dtype, lead)
                if n in MATMUL_WEIGHTS else a) for n, a in params.items()}

  def unstacked_layers(self) -> list[dict[str, Array]]:
    """Each layer's parameters as separate arrays (copies), in pattern order, for
    `step_unrolled`."""
    per_kind = {k: iter(unstack(self.layer_params(k), self.config.count(k))) for k in self._kinds()}
    return [next(per_kind[k]) for k in self.config.pattern]

  def unstack_states(self, states) -> list:
    """Stacked states (as `step` takes them) -> one per layer in pattern order
    (None for an MLP layer), for `step_unrolled`."""
    per_kind = {k: iter(unstack(st, self.config.count(k)) if st is not None else [])
                for k, st in self._by_kind(states).items()}
    return [next(per_kind[k], None) for k in self.config.pattern]

  def stack_states(self, per_layer: list) -> dict[str, Array]:
    """The inverse of `unstack_states`."""
    by_kind = {}
    for k in self._kinds():
      mine = [st for kind, st in zip(self.config.pattern, per_layer) if kind == k]
      if state_keys(self.config, k):
        by_kind[k] = jax.tree.map(lambda *a: jnp.stack(a), *mine)
    return self._flat(by_kind)

  def step_unrolled(self, input_ids, layers, states):
    """`step` with the layers unrolled over per-layer parameters and states (lists
    in pattern order: `unstacked_layers()`, and `unstack_states(states)`).

    Decoding is memory-bound: each step reads every weight once. Inside a layer
    scan XLA:CPU first copies the layer's slice of each stacked weight, then
    multiplies, so a step moves the weights twice or more. The decode loop
    unstacks the weights once, before it starts (`decode_layers`), and runs this;
    compile time grows with depth instead (figures: docs/bench/design_notes.md,
    docs/bench/decode_tpu.md).
    """
    fns = self._layer_fns(ops_for(self.config, self.runtime), decode=True)
    h, new = self.embed(input_ids), []
    for kind, p, state in zip(self.config.pattern, layers, states):
      h, state = fns[kind](p, h, state)
      new.append(state)
    return h, new

  def __call__(self, input_ids, *, seq_idx=None):
    h, _ = self.backbone(input_ids, seq_idx=seq_idx)
    return self.logits(h)

  # -- parameters as a plain nested dict (the paths conversion and checkpoints use) --

  def params(self) -> dict[str, Any]:
    out = {"embedding": self.embedding.get_value(), "norm_f": self.norm_f.get_value()}
    out.update({KIND_PARAMS[k]: self.layer_params(k) for k in self._kinds()})
    if not self.config.tie_embeddings:
      out["lm_head"] = self.lm_head.get_value()
    return out

  def merged(self) -> "Mamba2LM":
    """This model with its adapters merged into the weights (itself without adapters)."""
    if self.lora is None:
      return self
    params = lora_lib.merge(self.params(), self.adapters, self.lora)
    # An adapted tied head is no longer the embedding: the merged model unties it.
    cfg = self.config.replace(tie_embeddings=self.config.tie_embeddings and "lm_head" not in params)
    return Mamba2LM.from_params(cfg, params, self.runtime)

  def for_inference(self) -> "Mamba2LM":
    """This model (adapters merged) holding the weights it only multiplies by in the
    compute dtype: the layer stacks' `MATMUL_WEIGHTS` and an untied LM head, which
    every forward casts before its matmuls (`_compute_params`, `head_for_logits`), cast
    once here. Logits, prefill and decoded tokens are the same bit for bit, bf16
    weights take half the memory, and a forward reads each weight once in bf16 where
    it read the float32 weight and wrote and read its cast (docs/bench/fused_layer.md,
    "Inference weights"). With a quantized matmul_precision the weights stay float32:
    quantizing a cast weight would give other values. Norms, conv, dt, A, D, the
    router and the embedding stay float32 (a tied head too: XLA casts it inside the
    head's GEMM, and a bf16 copy beside it counted no fewer bytes). in_proj's z|x
    weight is held joined (see below); `params()` gives every weight in its schema's
    shape. For inference only: training updates float32 weights."""
    merged = self.merged()
    rt = merged.runtime
    cd = jnp.dtype(rt.compute_dtype) if rt.matmul_precision == "default" else F32
    # A new module over the same arrays (`from_params` makes its own variables), so
    # that setting its weights leaves self as it was.
    model = Mamba2LM.from_params(merged.config, merged.params(), rt)
    for kind in model._kinds():
      stack = getattr(model, KIND_PARAMS[kind])
      for name in kind_axes(model.config, kind):
        if name in MATMUL_WEIGHTS:
          stack[name].set_value(stack[name].get_value().astype(cd))
      if "in_proj_zx" in stack:
        # Held as (L, d, 2i), the GEMM's (d, 2i) operand: a (d, 2, i) weight's minor
        # (2, i) pair is tiled (2, 128) on TPU, so each forward copied every layer's
        # weight into the GEMM's layout. `layer_params` gives (L, d, 2, i) back by a
        # reshape that XLA folds into the GEMM's own.
        zx = stack["in_proj_zx"].get_value()
        stack["in_proj_zx"].set_value(zx.reshape(*zx.shape[:2], -1))
    if not model.config.tie_embeddings:
      model.lm_head.set_value(model.lm_head.get_value().astype(cd))
    return model

  @classmethod
  def from_params(cls, config: Mamba2Config, params: dict[str, Any], runtime: Runtime | None = None,
                  *, adapters: dict[str, Any] | None = None,
                  lora: lora_lib.LoraSpec | None = None, dropout_key=None) -> "Mamba2LM":
    """Build a model holding `params` (as `params()` returns them) without a random init;
    with `lora`, also its `adapters` (`lora.init_adapters`' layout), and the adapted
    weights of `params` may be quantized (`lora.quantize_base`); `dropout_key` (a
    training step's) turns the adapters' dropout on."""
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), runtime=runtime))
    bad = shape_problems(param_shapes(model.params()), param_shapes(params))
    if lora is not None:
      bad += shape_problems(param_shapes(lora_lib.adapter_shapes(model.params(), lora)), param_shapes(adapters))
    if bad:
      raise ValueError(f"Parameters do not match the model config: {'; '.join(bad)}")
    # With adapters the base stays as the run holds it (`lora.frozen_base`).
    weight = (lambda a: jnp.asarray(a, F32)) if lora is None else lora_lib.as_held
    model.embedding.set_value(weight(params["embedding"]))
    model.norm_f.set_value(weight(params["norm_f"]))
    for kind in model._kinds():
      attr = KIND_PARAMS[kind]
      for name in kind_axes(config, kind):
        getattr(model, attr)[name].set_value(weight(params[attr][name]))
    if not config.tie_embeddings:
      model.lm_head.set_value(weight(params["lm_head"]))
    if lora is not None:
      model.lora, model.adapters = lora, nnx.data(adapters)
      model.dropout_key = nnx.data(dropout_key)
    return model

