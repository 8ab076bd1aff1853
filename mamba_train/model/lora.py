"""Low-rank adapters (LoRA) on the model's matmul weights, and the quantized frozen
base of QLoRA.

An adapted weight is W + (alpha / r) * A @ B, with A (in, r) and B (r, out) over
W's input and output axes flattened; B starts at zero, so a fresh adapter leaves
the model as it was. Every matmul is a target, by name:

  in_proj   one adapter over the joined z|x|B|C|dt output (the one nn.Linear of
            mamba_ssm and transformers; stored split into in_proj_zx / _bc / _dt);
            in a Mamba-3 layer over z|x|B|C|dd_dt|dd_A|trap|angles (in_proj_zx / _bc /
            _heads / _angles)
  out_proj  the Mamba-2 and Mamba-3 mixers' output projection
  q_proj, k_proj, v_proj, o_proj     a hybrid's attention layers
  up_proj, gate_proj, down_proj      a hybrid's MLP layers
  lm_head   the LM head (with tied embeddings: the head only, not the lookup)

Two ways to run an adapted matmul, chosen by `LoraSpec.separate`:

  merged    the adapters merged into the weight inside each layer's function, per
            layer (`merge_layer`): the matmul is the base's, with exactly what
            peft's merged weights add. The weight gradient of the adapted matmul
            is formed per layer (in x out, as full finetuning forms it) before it
            is reduced to A's and B's.
  separate  peft's y = x W + scale * dropout(x) A B (`matmul.Adapter`), the
            adapter's own small dots beside the base's: no weight gradient of the
            base is formed at all, and dropout on the adapter's input (training
            only, one mask per step, layer and target from the train state's key,
            so a resumed run draws the masks the uninterrupted one drew) can be
            expressed. The LM head's adapter joins the head as extra columns
            (`Mamba2LM.head_operands`), so the blockwise loss runs it unchanged.

Dropout needs the separate path; without dropout the merged one is kept
(`LoraSpec.separate` says why, with the figures in docs/bench/lora.md). Decoding
always runs the merged model (`merge`). qwix's LoRA provider intercepts the dot
calls of Flax modules by the module's parameter; here the weights reach their dots
sliced out of layer stacks inside a scan, where it cannot see them. The base's
quantization is qwix's (`qwix.quantize`, `qwix.dequantize`), dequantized per layer
where it is used, so no whole dequantized copy exists. The frozen matmul weights
that only compute-dtype matmuls read (`frozen_base`: those no adapter is merged
into, Nemotron's routed and shared experts) are held in the run's compute dtype,
as peft users load a bfloat16 base, rather than cast in every layer's forward and
again in its recompute, every step.

Shapes: adapters are stacked over a kind's layers like the weights, so
`{"layers": {"in_proj": {"a": (L, d, r), "b": (L, r, 2i+2gn+h)}, ...},
"lm_head": {"a": (d, r), "b": (r, v)}}`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from mamba_train.model.params import MATMUL_WEIGHTS

F32 = jnp.float32

# target -> (the kind's parameter stack, its weights (joined in this order along the
# output), the number of leading input axes of each weight).
TARGETS: dict[str, tuple[str, tuple[str, ...], int]] = {
    "in_proj": ("layers", ("in_proj_zx", "in_proj_bc", "in_proj_dt"), 1),
    "out_proj": ("layers", ("out_proj",), 1),
    "q_proj": ("attn", ("q_proj",), 1),
    "k_proj": ("attn", ("k_proj",), 1),
    "v_proj": ("attn", ("v_proj",), 1),
    "o_proj": ("attn", ("o_proj",), 2),  # (h, e, d): input h*e
    "up_proj": ("mlp", ("up_proj",), 1),
    "gate_proj": ("mlp", ("gate_proj",), 1),
    "down_proj": ("mlp", ("down_proj",), 1),
}
# Targets a second stack has too (the Mamba-3 layers' in_proj and out_proj):
# (target, stack) -> (its weights, the number of leading input axes).
MORE_STACKS: dict[tuple[str, str], tuple[tuple[str, ...], int]] = {
    ("in_proj", "mamba3"): (("in_proj_zx", "in_proj_bc", "in_proj_heads", "in_proj_angles"), 1),
    ("out_proj", "mamba3"): (("out_proj",), 1),
}
HEAD = "lm_head"
DEFAULT_TARGETS = ",".join(TARGETS)  # every layer matmul; the head on request
BASE_DTYPES = ("", "int8", "int4")  # '' = the base as stored (float32)
# int4 scales come per block of this many input rows (QLoRA's block of 64): one scale
# per output channel over a whole d_model row loses too much at 4 bits.
INT4_BLOCK = 64


class LoraError(ValueError):
  pass


def entries(target: str) -> list[tuple[str, tuple[str, ...], int]]:
  """Every (stack, weights, leading input axes) a target adapts."""
  return [TARGETS[target]] + [(s, *v) for (t, s), v in MORE_STACKS.items() if t == target]


def _entry_for(target: str, p: dict[str, Any]) -> tuple[tuple[str, ...], int]:
  """The weights and input axes of `target` in a layer whose weights are `p`."""
  return next((names, n_in) for _, names, n_in in entries(target) if all(n in p for n in names))


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  rank: int
  alpha: float
  targets: tuple[str, ...]  # resolved names from TARGETS and HEAD
  base_dtype: str = ""
  dropout: float = 0.0  # on the adapters' input (peft's lora_dropout), training only
  # int4 values two to a byte. XLA:CPU's compiled programs want int4 arguments packed,
  # but JAX's CPU client makes them one to a byte (JAX 0.10), so a CPU run stores them
  # in int8 (the same numbers, int8's memory): the caller says which for its backend.
  packed_int4: bool = True
  # The dtype `frozen_base` holds the frozen matmul weights in that only compute-dtype
  # matmuls read ('' = as stored): the run's compute dtype, which the caller says
  # (run_config.validate), as it says packed_int4.
  frozen_dtype: str = ""

  def replace(self, **kw) -> "LoraSpec":
    return dataclasses.replace(self, **kw)

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @property
  def separate(self) -> bool:
    """Run the adapters beside the base (x W + scale dropout(x) A B) rather than
    merged into it. Dropout needs it. Without dropout the merged form is kept: it
    is today's numbers exactly, and its per-layer weight gradient cost less than
    the separate dots' extra activations on the runs measured
    (docs/bench/lora.md, "dropout and the separate path")."""
    return self.dropout > 0.0


def resolve_targets(patterns: str, present: set[str]) -> tuple[str, ...]:
  """The target names matched by comma-separated glob `patterns` that the model has
  (`present`: its stacks' weight names and 'lm_head'). A pattern matching no target
  of any model is an error; one matching only weights this model lacks is not (the
  default names attention and MLP matmuls, which a pure Mamba-2 model has none of)."""
  names = [*TARGETS, HEAD]
  out, bad = [], []
  for pat in (p.strip() for p in patterns.split(",") if p.strip()):
    hit = [n for n in names if fnmatch.fnmatchcase(n, pat)]
    if not hit:
      bad.append(pat)
    out += [n for n in hit if n not in out and (n == HEAD or any(e[1][0] in present for e in entries(n)))]
  if bad:
    raise LoraError(f"lora.targets {bad} match no LoRA target; targets are {names} "
                    "(glob patterns, comma-separated)")
  if not out:
    raise LoraError(f"lora.targets {patterns!r} match no weight of this model; it has "
                    f"{sorted(n for n in TARGETS if TARGETS[n][1][0] in present)} and {HEAD}")
  return tuple(out)


def make_spec(rank: int, alpha: float, dropout: float, targets: str, base_dtype: str,
              present: set[str]) -> LoraSpec | None:
  """The adapters a run trains (None when rank is 0), checked."""
  if not isinstance(rank, int) or rank < 0:
    raise LoraError(f"lora.rank must be an integer >= 0 (0 = off), got {rank!r}")
  if rank == 0:
    if base_dtype:  # quantizing a base that nothing adapts would train the quantized model itself
      raise LoraError(f"lora.base_dtype={base_dtype!r} (QLoRA) needs adapters: set lora.rank > 0")
    return None
  if not (isinstance(alpha, (int, float)) and alpha > 0):
    raise LoraError(f"lora.alpha must be > 0, got {alpha!r}")
  if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
    raise LoraError(f"lora.dropout must be in [0, 1) (peft's lora_dropout), got {dropout!r}")
  if base_dtype not in BASE_DTYPES:
    raise LoraError(f"lora.base_dtype must be one of {BASE_DTYPES} ('' = as stored), got {base_dtype!r}")
  return LoraSpec(rank, float(alpha), resolve_targets(targets, present), base_dtype, float(dropout))


def spec_from_config(c: dict, present: set[str]) -> LoraSpec | None:
  """`make_spec` from a run config's `lora` section (a dict)."""
  return make_spec(c.get("rank", 0), c.get("alpha", 16.0), c.get("dropout", 0.0),
                   c.get("targets", DEFAULT_TARGETS), c.get("base_dtype", ""), present)


def _in_out(stack: dict[str, Any], target: str) -> tuple[int, int]:
  names, n_in = _entry_for(target, stack)
  fan_in = math.prod(stack[names[0]].shape[1:1 + n_in])
  return fan_in, sum(math.prod(stack[n].shape[1 + n_in:]) for n in names)


def adapter_shapes(params: dict[str, Any], spec: LoraSpec) -> dict[str, Any]:
  """{stack: {target: {'a', 'b'}}, 'lm_head': {'a', 'b'}} as float32 ShapeDtypeStructs,
  for a parameter tree in `Mamba2LM.params()`'s layout (leaves with a shape)."""
  out: dict[str, Any] = {}
  r = spec.rank
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
  for t in spec.targets:
    if t == HEAD:
      v, d = params.get("lm_head", params["embedding"]).shape
      out[HEAD] = {"a": sds(d, r), "b": sds(r, v)}
      continue
    for name, names, _ in entries(t):
      if name not in params:
        continue
      stack = params[name]
      layers = stack[names[0]].shape[0]
      fan_in, fan_out = _in_out(stack, t)
      out.setdefault(name, {})[t] = {"a": sds(layers, fan_in, r), "b": sds(layers, r, fan_out)}
  return out


def init_adapters(params: dict[str, Any], spec: LoraSpec, key) -> dict[str, Any]:
  """Fresh adapters for `params`: A uniform(+-1/sqrt(in)) (torch's nn.Linear default,
  as peft initialises lora_A), B zero."""
  shapes = adapter_shapes(params, spec)
  paths, tree = jax.tree_util.tree_flatten_with_path(shapes)
  leaves = []
  for (path, s), k in zip(paths, jax.random.split(key, len(paths))):
    bound = 1.0 / math.sqrt(s.shape[-2])
    leaves.append(jnp.zeros(s.shape, F32) if path[-1].key == "b"
                  else jax.random.uniform(k, s.shape, F32, -bound, bound))
  return jax.tree.unflatten(tree, leaves)


def adapter_logical_axes(adapters: dict[str, Any]) -> dict[str, Any]:
  """Adapters are small: replicated, but for the stacked layers axis."""
  return jax.tree.map(lambda a: ("layers",) + (None,) * (a.ndim - 1) if a.ndim == 3 else (None,) * a.ndim,
                      adapters)


# ----------------------------------------------------------------------------
# The quantized base (QLoRA).


def quantize(w, base_dtype: str, n_in: int, stacked: bool, packed_int4: bool = True):
  """A weight (stacked over layers when `stacked`) as a qwix QArray: symmetric absmax,
  one scale per output channel (and per layer), int4 per block of input rows too."""
  lead = 1 if stacked else 0
  channel = tuple(range(lead)) + tuple(range(lead + n_in, w.ndim))
  # A row count no block divides (a small test model) keeps one scale per output channel.
  tiles = {lead: INT4_BLOCK} if base_dtype == "int4" and w.shape[lead] % INT4_BLOCK == 0 else {}
  q = qwix.quantize(w, {"int8": jnp.int8, "int4": jnp.int4}[base_dtype], channelwise_axes=channel,
                    tiled_axes=tiles)
  if base_dtype == "int4" and not packed_int4:  # qtype stays int4: dequantize reads it so
    q = dataclasses.replace(q, qvalue=q.qvalue.astype(jnp.int8))
  return q


def quantize_base(params: dict[str, Any], spec: LoraSpec) -> dict[str, Any]:
  """The base with every adapted weight quantized to `spec.base_dtype` (the rest, and
  every weight when base_dtype is '', as given)."""
  if not spec.base_dtype:
    return params
  out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in params.items()}
  for t in spec.targets:
    if t == HEAD:
      key = "lm_head" if "lm_head" in params else "embedding"
      if key == "lm_head":  # a tied head is also the embedding lookup: kept whole
        out[key] = quantize(params[key], spec.base_dtype, 1, stacked=False, packed_int4=spec.packed_int4)
      continue
    for stack, names, n_in in entries(t):
      if stack not in params:
        continue
      for n in names:
        out[stack][n] = quantize(params[stack][n], spec.base_dtype, n_in, stacked=True,
                                 packed_int4=spec.packed_int4)
  return out


def merged_into(spec: LoraSpec) -> set[tuple[str, str]]:
  """(stack, weight) of every weight an adapter is merged into (none on the separate path)."""
  if spec.separate:
    return set()
  return {(stack, n) for t in spec.targets if t != HEAD for stack, names, _ in entries(t) for n in names}


def frozen_base(params: dict[str, Any], spec: LoraSpec) -> dict[str, Any]:
  """The frozen base a run with adapters holds: `quantize_base`'s, and with
  `spec.frozen_dtype` every matmul weight of the layer stacks (`params.MATMUL_WEIGHTS`)
  that no adapter is merged into and no quantization holds, and an untied LM head
  without an adapter, in that dtype.

  Those weights reach only matmuls that cast them to the compute dtype first (each
  layer's `_matmuls_in_compute_dtype`, the loss's head), so holding them cast gives
  the same products and gradients, while a float32 base is cast again in each layer's
  forward and in its recompute, every step: on the Nano recipe that is the 128 routed
  experts' weights. A weight an adapter is merged into stays float32: the merge adds
  the adapter to the float32 weight before the cast. Norms, the router, conv, dt, A, D
  and the embedding are not matmul weights and stay float32."""
  out = quantize_base(params, spec)
  if not spec.frozen_dtype:
    return out
  dt, merged = jnp.dtype(spec.frozen_dtype), merged_into(spec)
  cast = lambda w: w if is_quantized(w) else w.astype(dt)
  out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in out.items()}
  for stack, weights in out.items():
    if isinstance(weights, dict):
      out[stack] = {n: cast(w) if n in MATMUL_WEIGHTS and (stack, n) not in merged else w
                    for n, w in weights.items()}
  if "lm_head" in out and HEAD not in spec.targets:
    out["lm_head"] = cast(out["lm_head"])
  return out


def as_held(x):
  """A frozen base's weight as a model holds it: quantized or in a 16-bit float as
  `frozen_base` made it, else float32."""
  if is_quantized(x) or jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return x
  return jnp.asarray(x, F32)


def is_quantized(x) -> bool:
  return isinstance(x, qwix.QArray)


def dense(x) -> jax.Array:
  """A weight dequantized to float32 when quantized, else as held (float32, or the
  compute dtype of `frozen_base`'s, which only compute-dtype matmuls read)."""
  return qwix.dequantize(x).astype(F32) if is_quantized(x) else x


# ----------------------------------------------------------------------------
# Merging.


def _delta(a, b, scale):
  return scale * jnp.einsum("...ir,...ro->...io", a.astype(F32), b.astype(F32))


def merge_layer(p: dict[str, Any], adapters: dict[str, Any], spec: LoraSpec) -> dict[str, Any]:
  """One layer's weights (p, unstacked; matmul weights float32, quantized or held in
  the compute dtype) with its adapters ({target: {'a', 'b'}}, unstacked) added: the
  adapted weights float32, the rest as `dense` gives them."""
  out = {n: dense(w) for n, w in p.items()}
  for t, ab in adapters.items():
    names, n_in = _entry_for(t, p)
    d = _delta(ab["a"], ab["b"], spec.scale)  # (in, sum of outs)
    start = 0
    for n in names:
      w = out[n]
      size = math.prod(w.shape[n_in:])
      out[n] = w + d[:, start:start + size].reshape(w.shape)
      start += size
  return out


def merge_head(w, adapter: dict[str, Any] | None, spec: LoraSpec):
  """The LM head (v, d) with its adapter added (float32); without one, as `dense`
  gives it."""
  w = dense(w)
  if adapter is None:
    return w
  return w + _delta(adapter["a"], adapter["b"], spec.scale).T


def merge(params: dict[str, Any], adapters: dict[str, Any], spec: LoraSpec) -> dict[str, Any]:
  """The whole base (`Mamba2LM.params()`, possibly quantized) with the adapters merged
  in: plain float32 parameters a model without adapters runs (export, generation).
  A tied head that has an adapter comes out untied (the lookup keeps the embedding)."""
  out = {k: (dict(v) if isinstance(v, dict) else dense(v)) for k, v in params.items()}
  for stack, per_target in adapters.items():
    if stack == HEAD:
      out["lm_head"] = merge_head(params.get("lm_head", params["embedding"]), per_target, spec)
      continue
    merged = jax.vmap(lambda p, a: merge_layer(p, a, spec))(params[stack], per_target)
    out[stack] = {n: merged.get(n, dense(w)) for n, w in params[stack].items()}
  f32 = lambda w: dense(w).astype(F32)
  for stack, v in out.items():
    out[stack] = {n: f32(w) for n, w in v.items()} if isinstance(v, dict) else f32(v)
  return out


def fingerprint(params: dict[str, Any]) -> str:
  """A short hash naming a base: every parameter's path and shape and a strided sample
  of its values (up to 4096 per parameter), the same under any sharding."""
  h = hashlib.sha256()
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    h.update(jax.tree_util.keystr(path).encode())
    h.update(str(tuple(x.shape)).encode())
    step = max(1, x.size // 4096)
    sample = jax.jit(lambda a, step=step: a.reshape(-1)[::step][:4096].astype(F32))(x)
    h.update(np.asarray(jax.device_get(sample)).tobytes())
  return h.hexdigest()[:16]
