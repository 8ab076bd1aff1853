"""Greedy decoding speed at a few context lengths, three ways, and how much of
the device's bandwidth it uses.

  * device loop: the whole loop of --new_tokens steps as one while_loop program
    (`mamba_train.generation.decode_loop`, what `generate` runs after its
    prefill), from a prefilled cache;
  * host loop: a Python loop calling a jitted one-token `step`, reading each
    token back to the host as a real loop must (to check for EOS);
  * recompute: no cache, a full forward pass over the whole prefix per token.

The three differ in what runs where, not in what they compute, which is why
they are timed side by side: a decode step reads every weight once, so its
speed is a bandwidth figure (bytes a step must move, times tokens/s, over the
measured copy and matvec rates). The programs are the benchmark's own, built on
the library's prefill, step and decode loop.
"""

from __future__ import annotations

import functools
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import peers, roofline
from benchmarks.common import add_rows, compile_fn, log, median_time, model_cfg, runtime
from mamba_train.generation import decode_loop, prefill, step
from mamba_train.metrics import Timer
from mamba_train.model.lm import Mamba2LM


@functools.partial(jax.jit, static_argnames=("graphdef", "capacity"))
def _prefill_program(graphdef, params, input_ids, *, capacity):
  # capacity: a hybrid's key/value buffers hold the prompt and the new tokens.
  return prefill(nnx.merge(graphdef, params), input_ids, capacity=capacity)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _loop_program(graphdef, params, logits, cache, *, max_new_tokens):
  """The decode loop alone (greedy, no EOS), from a prefilled cache."""
  return decode_loop(nnx.merge(graphdef, params), logits, cache, jax.random.key(0),
                     jnp.float32(0), jnp.int32(0), jnp.float32(1), jnp.int32(-1), jnp.int32(0),
                     jnp.int32(max_new_tokens), buffer_len=max_new_tokens)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(3,))
def _greedy_step_program(graphdef, params, token, cache):
  logits, cache = step(nnx.merge(graphdef, params), token, cache)
  return jnp.argmax(logits, -1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _recompute_program(graphdef, params, buffer, pos):
  """Greedy next token from a full forward pass over the whole buffer (b, L);
  the token after position `pos` (causal, so positions past it do not matter)."""
  logits = nnx.merge(graphdef, params)(buffer)
  return jnp.argmax(jax.lax.dynamic_index_in_dim(logits, pos, 1, keepdims=False), -1)


def _timed(fn, *args):
  """(fn(*args) blocked on, wall seconds)."""
  with Timer() as t:
    out = jax.block_until_ready(fn(*args))
  return out, t.seconds


def decode_benchmark(model: Mamba2LM, prompt_lens: Sequence[int], *, batch: int = 1,
                     new_tokens: int = 32, host_tokens: int | None = None, recompute_tokens: int = 3,
                     repeats: int = 3, seed: int = 0) -> list[dict]:
  """Greedy decode throughput of `model` at each prompt length, the three ways
  of the module docstring.

  Times exclude compilation (each program is compiled and run once first); the
  device and host loops report the best of `repeats` runs (this is for noisy
  shared machines; recompute, the slow one, runs once). Returns one dict per
  length: tokens/s for each way (batch * tokens / s), the prefill time, the
  loop's compile time (0 after the first length: its shapes do not depend on
  the length), and whether the host loop produced the device loop's tokens.
  """
  graphdef, params = nnx.split(model)
  cfg = model.config
  host_tokens = host_tokens or new_tokens
  rng = np.random.default_rng(seed)
  rows = []
  loops = {}
  for l in prompt_lens:
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, l)), jnp.int32)
    row = {"prompt_len": l, "batch": batch}
    capacity = l + max(new_tokens, host_tokens)

    pre, _ = compile_fn(_prefill_program, graphdef, params, ids, capacity=capacity)
    _timed(pre, params, ids)
    (logits, cache), row["prefill_s"] = _timed(pre, params, ids)
    row["cache_bytes"] = cache.nbytes  # a hybrid's grows with the capacity

    # Device loop: the loop program alone (one per cache shape: a pure model's
    # does not depend on the length, a hybrid's key/value buffers do).
    row["loop_compile_s"] = 0.0
    shapes = tuple(a.shape for a in jax.tree.leaves(cache))
    if shapes not in loops:
      loops[shapes], info = compile_fn(_loop_program, graphdef, params, logits, cache,
                                       max_new_tokens=new_tokens)
      row["loop_compile_s"] = info["compile_s"]
    loop = loops[shapes]
    _timed(loop, params, logits, cache)
    t = []
    for _ in range(repeats):
      (dev_tokens, *_), sec = _timed(loop, params, logits, cache)  # tokens, steps, lengths
      t.append(sec)
    row["device_tok_s"] = batch * (new_tokens - 1) / min(t)  # the first token is from prefill

    # Host loop: one jitted step per token, the token read back each time.
    fresh = lambda: jax.tree.map(jnp.copy, cache)  # the step donates its cache
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    _greedy_step_program(graphdef, params, first, fresh())  # compile and warm
    t = []
    for _ in range(repeats):
      tok, c = first, fresh()
      host = [np.asarray(tok)]
      with Timer() as timer:
        for _ in range(host_tokens - 1):
          tok, c = _greedy_step_program(graphdef, params, tok, c)
          host.append(np.asarray(tok))  # the per-token host round trip
      t.append(timer.seconds)
    row["host_tok_s"] = batch * (host_tokens - 1) / min(t)
    n_cmp = min(host_tokens, new_tokens)
    row["host_matches_device"] = bool(np.array_equal(np.stack(host, 1)[:, :n_cmp],
                                                     np.asarray(dev_tokens)[:, :n_cmp]))

    # Recompute: a fixed buffer of l + recompute_tokens positions, one full pass per token.
    buf = jnp.concatenate([ids, jnp.zeros((batch, recompute_tokens), jnp.int32)], 1)
    rec, _ = compile_fn(_recompute_program, graphdef, params, buf, jnp.int32(l - 1))
    _timed(rec, params, buf, jnp.int32(l - 1))
    with Timer() as timer:
      for i in range(recompute_tokens):
        nxt = rec(params, buf, jnp.int32(l - 1 + i))
        buf = buf.at[:, l + i].set(nxt)
        np.asarray(nxt)
    row["recompute_tok_s"] = batch * recompute_tokens / timer.seconds
    rows.append(row)
  return rows


def bench_decode(args, results, size, contexts, batch):
  rf = roofline.measure(args, results)
  compared = peers.available(args)
  cfg, rt = model_cfg(args, size), runtime(args)
  per_tok = lambda ctx: roofline.decode_bytes_per_step(cfg, batch, ctx + new) / batch
  new = args.new_tokens
  rows = []

  def add(impl, ctx, tps, extra=None):
    row = {"bench": "decode", "impl": impl, "config": size, "batch": batch, "seq_len": ctx,
           "dtype": args.dtype, "tokens_per_s": tps,
           "bw_util": roofline.bandwidth_utilisation(tps, per_tok(ctx), rf["copy_bytes_per_s"]),
           "matvec_util": roofline.bandwidth_utilisation(tps, per_tok(ctx), rf["matvec_bytes_per_s"]),
           **(extra or {})}
    rows.append(row)
    log(f"  decode {size} b{batch} ctx {ctx} {impl:16s}: {tps:9.1f} tok/s  bandwidth {100 * row['bw_util']:.0f}%"
        f" of copy, {100 * row['matvec_util']:.0f}% of matvec")

  model = Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt)
  got = decode_benchmark(model, prompt_lens=contexts, batch=batch, new_tokens=new,
                         host_tokens=min(new, 16), recompute_tokens=2, repeats=max(3, args.repeats // 2))
  del model
  for r in got:
    if not r["host_matches_device"]:
      log(f"  warning: ctx {r['prompt_len']}: the host loop's tokens differ from the device loop's")
    add("ours (device loop)", r["prompt_len"], r["device_tok_s"],
        {"compile_s": r["loop_compile_s"], "prefill_s": r["prefill_s"], "cache_bytes": r["cache_bytes"]})
    log(f"  decode {size} ctx {r['prompt_len']}: cache {r['cache_bytes'] / 2**20:.2f} MiB")
    add("ours (host loop)", r["prompt_len"], r["host_tok_s"])
    add("ours (recompute)", r["prompt_len"], r["recompute_tok_s"])
  n_peer = max(4, min(new, 16))
  chunk = rt.ssd_plan(cfg.chunk_size)[1]
  if "torch" in compared:
    import torch
    model = peers.torch_model(cfg, chunk, args.dtype).eval()
    for ctx in contexts:
      ids = torch.randint(0, cfg.vocab_size, (batch, ctx))
      gen = lambda k: model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                     use_cache=True, pad_token_id=0)
      with torch.no_grad():
        t1 = peers.torch_time(lambda: gen(1), 2)
        tk = peers.torch_time(lambda: gen(n_peer), 2)
      add("torch (cached)", ctx, batch * (n_peer - 1) / max(tk - t1, 1e-9))
    del model
  if "mamba2-jax" in compared:
    import mamba2_jax
    mcfg, m = peers.m2jax_model(cfg, chunk)
    gd, ps = nnx.split(m)

    @jax.jit
    def mstep(ps, ids, cache):
      out = nnx.merge(gd, ps)(ids, cache=cache)
      return jnp.argmax(out["logits"][:, -1], -1).astype(jnp.int32), out["cache"]
    for ctx in contexts:
      ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, ctx)), jnp.int32)
      tok, cache = mstep(ps, ids, mamba2_jax.create_empty_cache(mcfg, batch))
      mstep(ps, tok[:, None], cache)  # compile the one-token shape

      def loop():
        t, c = tok, cache
        for _ in range(n_peer - 1):
          t, c = mstep(ps, t[:, None], c)
          np.asarray(t)
        return t
      add("mamba2-jax (cached)", ctx, batch * (n_peer - 1) / median_time(loop, 2))
  return add_rows(results, rows)


# ----------------------------------------------------------------------------
# The decode step compiled ahead of time for a TPU (libtpu; no TPU needed).


def _hlo_computations(text: str) -> dict[str, list[str]]:
  """{computation name: its instruction lines} of an HLO module's text."""
  comps, name = {}, None
  for line in text.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if m and not line.startswith(" "):
      name = m.group(1)
      comps[name] = []
      if line.startswith("ENTRY"):
        comps["__entry__"] = comps[name]
    elif line.startswith("}"):
      name = None
    elif name is not None and "=" in line:
      comps[name].append(line)
  return comps


# Instructions that launch no work of their own.
_FREE_OPS = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
             "opt-barrier", "partition-id", "replica-id"}


def _type_prefix(rhs: str) -> str:
  """The result type at the start of an instruction's right-hand side."""
  if not rhs.startswith("("):
    return rhs.split(" ", 1)[0]
  depth = 0
  for i, ch in enumerate(rhs):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rhs[:i + 1]
  return rhs


def _opcode(line: str) -> str | None:
  """The opcode of an HLO instruction line ('%x = type opcode(...)...')."""
  rhs = line.split(" = ", 1)[1] if " = " in line else ""
  rest = rhs[len(_type_prefix(rhs)):]
  m = re.match(r"\s*([\w\-]+)\(", rest)
  return m.group(1) if m else None


def _trip_count(while_line: str, comps: dict[str, list[str]]) -> int:
  """A while loop's trip count: XLA's known_trip_count, else the bound its condition
  compares the counter with (a scan's `i < n`), else 1."""
  m = re.search(r"known_trip_count[^0-9]*(\d+)", while_line)
  if m:
    return int(m.group(1))
  cond = re.search(r"condition=%?([\w.\-]+)", while_line)
  lines = comps.get(cond.group(1), []) if cond else []
  consts = [int(c) for line in lines for c in re.findall(r"s32\[\]\S* constant\((\d+)\)", line)]
  return max(consts) if len(consts) == 1 and any("direction=LT" in x for x in lines) else 1


_ITEMSIZE = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f16": 2}
_ARRAY = re.compile(r"\b(f32|bf16|s32|u32|pred|s8|u8|f16)\[([\d,]*)\](\{[^}]*\})?")


def _hbm_bytes_of_type(t: str) -> int:
  """Bytes of the arrays in an HLO type string that live in HBM (no memory-space
  annotation S(n) with n > 0 in their layout: on TPU S(1) is VMEM)."""
  total = 0
  for dtype, dims, layout in _ARRAY.findall(t):
    if layout and re.search(r"S\([1-9]\)", layout):
      continue
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _ITEMSIZE[dtype]
  return total


def _sliced_params(fused: list[str]) -> dict[int, int]:
  """{parameter number: bytes read} for the parameters of a fused computation that
  it only reads through a dynamic-slice or gather (their results' bytes)."""
  params = {}
  for line in fused:
    m = re.search(r"parameter\((\d+)\)", line)
    if m:
      params[line.split(" = ", 1)[0].strip().lstrip("%")] = int(m.group(1))
  out = {}
  for line in fused:
    op = _opcode(line)
    if op in ("dynamic-slice", "gather"):
      src = line.split(f" {op}(", 1)[1].split(",")[0].strip().lstrip("%")
      if src in params:
        rhs = line.split(" = ", 1)[1]
        b = sum(_ITEMSIZE[t] * _prod(dims) for t, dims, _ in _ARRAY.findall(_type_prefix(rhs)))
        out[params[src]] = out.get(params[src], 0) + b
  return out


def _prod(dims: str) -> int:
  n = 1
  for d in filter(None, dims.split(",")):
    n *= int(d)
  return n


def hbm_bytes(text: str) -> int:
  """An estimate of the HBM bytes a compiled TPU module moves: for each op it
  launches (as `executed_kernels` counts them, loops by trip count), its operands
  and result that lie in HBM. Unlike XLA's 'bytes accessed' it does not count the
  reads of operands the compiler prefetched into VMEM a second time, nor a gather's
  whole table; it counts a dynamic-update-slice's whole buffer (an over-count)."""
  comps = _hlo_computations(text)
  sig = {}
  for m in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> .*\{\s*$", text, re.MULTILINE):
    sig[m.group(1)] = {k: v for k, v in re.findall(r"([\w.\-]+): ((?:\(.*?\))|\S+?)(?:,\s|$)", m.group(2))}

  def count(name: str) -> int:
    types = dict(sig.get(name, {}))
    for line in comps.get(name, []):
      lhs, rhs = line.split(" = ", 1)
      types[lhs.strip().replace("ROOT ", "").lstrip("%")] = _type_prefix(rhs)
    total = 0
    for line in comps.get(name, []):
      op = _opcode(line)
      if op is None or op in _FREE_OPS or op.endswith("-done"):
        continue
      if op == "while":
        total += _trip_count(line, comps) * count(re.search(r"body=%?([\w.\-]+)", line).group(1))
        continue
      lhs = line.split(" = ", 1)[0].strip().replace("ROOT ", "").lstrip("%")
      args = line.split(f" {op}(", 1)[1]
      depth, end = 1, 0
      for i, ch in enumerate(args):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
          end = i
          break
      operands = [a.strip().lstrip("%") for a in re.sub(r"/\*[^*]*\*/", "", args[:end]).split(",") if a.strip()]
      out_type = types.get(lhs, "")
      if op.endswith("-start"):  # an async copy or slice: the bytes it moves, once
        # Its result: (destination, source, ...) for a copy, ((source), destination,
        # ...) for a slice.
        arrays = [a.group(0).split("{")[0] for a in _ARRAY.finditer(out_type)]
        dest = arrays[1] if out_type.startswith("((") and len(arrays) > 1 else (arrays or [""])[0]
        total += _hbm_bytes_of_type(dest)
        continue
      out = _hbm_bytes_of_type(out_type)
      ins = [_hbm_bytes_of_type(types.get(o, "")) for o in operands]
      called = re.search(r"calls=%?([\w.\-]+)", line)
      for k, b in _sliced_params(comps.get(called.group(1), []) if called else []).items():
        if k < len(ins) and ins[k]:
          ins[k] = min(ins[k], b)  # a fused slice or gather reads only its result's size
      total += out + sum(ins)
    return total

  return count("__entry__")


def executed_kernels(text: str) -> dict[str, int]:
  """What the entry computation of a compiled module runs, a while loop's body
  counted trip-count times (`_trip_count`): fusions
  (custom calls included), DMAs (async copy starts) and other ops that launch work
  of their own (unfused ops, plain copies); the '-done' halves of async pairs and
  ops that launch nothing are left out."""
  comps = _hlo_computations(text)

  def count(name: str) -> dict[str, int]:
    n = {"fusions": 0, "dmas": 0, "other": 0}
    for line in comps.get(name, []):
      op = _opcode(line)
      if op is None:
        continue
      if op == "while":
        body = re.search(r"body=%?([\w.\-]+)", line).group(1)
        inner, trips = count(body), _trip_count(line, comps)
        for k in n:
          n[k] += trips * inner[k]
      elif op in ("call", "conditional"):
        for c in re.findall(r"(?:to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)", line):
          for k, v in count(c).items():
            n[k] += v
      elif op in ("fusion", "custom-call"):
        n["fusions"] += 1
      elif op == "copy-start":
        n["dmas"] += 1
      elif op not in _FREE_OPS and not op.endswith("-done"):
        n["other"] += 1
    return n

  return count("__entry__")


def compile_decode_step(cfg, rt, unrolled: bool, precast: bool, topology: str = "v6e:1x1",
                        hlo: bool = False, decode_impl: str = "auto", batch: int = 1) -> dict:
  """One greedy decode step of `batch` (1 by default) (token in, next token and states out), as the
  decode loop's body runs it, compiled for `topology`: XLA's bytes with every layer
  counted (xla_bytes; a scanned body scaled by the layer count, as the compile
  benchmark does; xla_bytes_raw as compiled) and FLOPs as compiled, the kernels
  it runs per token, and the compile time. precast: the weights as `decode_loop`
  hands them to the step (matmul weights and LM head already in the compute dtype)
  rather than the float32 parameters cast inside the step. decode_impl: the
  runtime's (`auto` on TPU: the fused step of `decode_tpu`; `xla`: the plain
  step). hlo: also return the compiled module's text. batch: sequences a step
  (1 in the benchmark's rows)."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from mamba_train.metrics import compiled_cost, every_layer_counts
  from mamba_train.model.cache import Mamba2Cache
  from mamba_train.parallel.mesh import make_mesh
  from mamba_train.parallel.topology import tpu_devices
  from mamba_train.train.state import with_shardings

  _, _, devices = tpu_devices(topology)
  rep = NamedSharding(make_mesh({"data": -1}, devices), P())
  rt = rt.replace(decode_layers="unrolled" if unrolled else "scan", decode_impl=decode_impl).resolve("tpu")
  gd, params = nnx.split(nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt)))
  on = lambda tree: with_shardings(tree, jax.tree.map(lambda _: rep, tree))

  def weights(params):
    m = nnx.merge(gd, params)
    if precast:
      return m.decode_layers(unrolled), m.head_for_logits(decode=True)
    return (m.unstacked_layers() if unrolled else {k: m.layer_params(k) for k in m._kinds()}), None

  def one_step(params, layers, head, token, states):
    # The states as the loop carries them: per layer when unrolled, else stacked.
    m = nnx.merge(gd, params)
    if unrolled:
      h, new = m.step_unrolled(token, layers, states)
    else:
      h, new = m.step(token, states, layers)
    return jnp.argmax(m.logits(h, head), -1).astype(jnp.int32), new

  layers, head = jax.eval_shape(weights, params)
  states = jax.eval_shape(lambda: Mamba2Cache.init(cfg, batch).states())
  if unrolled:
    states = jax.eval_shape(lambda p, s: nnx.merge(gd, p).unstack_states(s), params, states)
  args = (on(params), on(layers), None if head is None else on(head),
          jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rep), on(states))
  with Timer() as t:
    compiled = jax.jit(one_step, donate_argnums=(4,)).lower(*args).compile()
  cost = compiled_cost(compiled)
  out = {"xla_bytes_raw": cost.get("bytes accessed"), "hbm_bytes_est": float(hbm_bytes(compiled.as_text()))}
  if unrolled:
    out["xla_bytes"] = cost.get("bytes accessed")
  else:
    # XLA counts the scanned layer body once: add it n_layer - 1 more times, the
    # body being the step's count less that of the embedding, head and argmax alone.
    def outside(params, head, token):
      m = nnx.merge(gd, params)
      return jnp.argmax(m.logits(m.embed(token), head), -1).astype(jnp.int32)
    c0 = compiled_cost(jax.jit(outside).lower(*args[:1], *args[2:4]).compile())
    out["xla_bytes"] = every_layer_counts(cost, cfg.n_layer, more=cost, fewer=c0)["bytes accessed"]
  return {**out, "xla_flops_raw": cost.get("flops"),
          **executed_kernels(compiled.as_text()), "compile_cpu_s": t.cpu_seconds,
          **({"hlo": compiled.as_text()} if hlo else {})}


def bench_decode_tpu(args, results, size):
  """Batch-1 decode step of `size` in bfloat16 for one TPU v6e chip (AOT via libtpu):
  the plain step (decode_impl 'xla') unrolled against scanned layers, weights cast
  per token against once per loop; and the fused step (`decode_tpu`, the TPU
  default: pre-norm + in_proj, the step, out_proj + residual as three kernels) over
  weights made once, unrolled and scanned; and both unrolled over weights made once
  at batch 2 and 3 too. Ops a token are the sum of fusions (kernels included), DMAs
  and other ops, also given per layer (less the head's, measured as the step's
  embedding, final norm, head and argmax alone, at the row's batch)."""
  from benchmarks.roofline import decode_bytes_per_step
  from mamba_train.model.config import config_for
  from mamba_train.model.runtime import Runtime
  cfg = config_for(size)
  rt = Runtime(compute_dtype=args.dtype)
  rows = []
  ways = [("xla", unrolled, precast, 1) for unrolled in (True, False) for precast in (False, True)]
  ways += [("pallas", unrolled, True, 1) for unrolled in (True, False)]
  ways += [(impl, True, True, b) for b in (2, 3) for impl in ("xla", "pallas")]
  try:
    head_ops = {b: _head_ops(cfg, rt, batch=b) for b in sorted({w[3] for w in ways})}
  except ImportError as e:
    log(f"  decode TPU compile skipped: {e} (pip install libtpu)")
    return results
  for impl, unrolled, precast, b in ways:
    r = compile_decode_step(cfg, rt, unrolled, precast, decode_impl=impl, batch=b)
    ops = r["fusions"] + r["dmas"] + r["other"]
    f32_bytes = decode_bytes_per_step(cfg, b)
    row = {"bench": "decode_tpu", "config": size, "dtype": args.dtype, "target": "TPU v6e (AOT)", "batch": b,
           "decode_impl": impl, "layers": "unrolled" if unrolled else "scan",
           "weights": "cast once per loop" if precast else "cast every token",
           "min_bytes_f32": f32_bytes, "ops": ops, "head_ops": head_ops[b],
           "ops_per_layer": (ops - head_ops[b]) / cfg.n_layer, **r}
    rows.append(row)
    log(f"  decode step {size} {args.dtype} v6e batch {b}, {impl}, {row['layers']}, {row['weights']}: "
        f"XLA {r['xla_bytes']:.3e} bytes, HBM est. {r['hbm_bytes_est']:.3e} (f32 params once: {f32_bytes:.3e}), "
        f"{r['fusions']} fusions, {r['dmas']} DMAs, {r['other']} other ops a token "
        f"({row['ops_per_layer']:.1f} a layer + {head_ops[b]} head), compile {r['compile_cpu_s']:.1f}s cpu")
  return add_rows(results, rows)


def _head_ops(cfg, rt, topology: str = "v6e:1x1", batch: int = 1) -> int:
  """Ops a token outside the layers: the embedding row, final norm, LM head (cast
  once, as the decode loop hands it) and argmax of one token a sequence, compiled alone."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from mamba_train.parallel.mesh import make_mesh
  from mamba_train.parallel.topology import tpu_devices
  from mamba_train.train.state import with_shardings

  _, _, devices = tpu_devices(topology)
  rep = NamedSharding(make_mesh({"data": -1}, devices), P())
  rt = rt.resolve("tpu")
  gd, params = nnx.split(nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0), runtime=rt)))
  head = jax.eval_shape(lambda p: nnx.merge(gd, p).head_for_logits(decode=True), params)
  on = lambda tree: with_shardings(tree, jax.tree.map(lambda _: rep, tree))

  def outside(params, head, token):
    m = nnx.merge(gd, params)
    return jnp.argmax(m.logits(m.embed(token), head), -1).astype(jnp.int32)
  text = jax.jit(outside).lower(on(params), on(head), jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rep)
                                ).compile().as_text()
  return sum(executed_kernels(text).values())
