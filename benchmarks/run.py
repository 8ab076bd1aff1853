"""Speed of mamba_train on this machine, beside the peers, in one run.

  python scripts/bench.py all --compare --plots --out bench_out      # everything (tiny and 130m)
  python scripts/bench.py ssd --compare                               # b2 l2048 h24 p64 n128, chunk sweep
  python scripts/bench.py train --config 130m --batch 1 --seq_len 512 --compare
  python scripts/bench.py forward --config 130m --seq_len 2048 --compare
  python scripts/bench.py decode --config tiny --compare
  python scripts/bench.py compile          # compile time against depth; 2.7b for TPU v6e with libtpu
  python scripts/bench.py memory --config 130m
  python scripts/bench.py loader

Every figure is the median of --repeats runs after a warm-up run; compile time
is timed apart (`jit(...).lower(...).compile()`), in wall seconds and in this
process's CPU seconds (the better figure on a shared machine). Memory is XLA's
memory analysis of the compiled program (arguments + outputs + scratch -
donated). The same run measures the device's matmul rate in the compute dtype
and its copy bandwidth: MFU is model FLOPs/s (mamba_train.metrics, SSD terms
included) over that matmul rate; decode's bandwidth utilisation is the bytes a
step must move (all parameters, the state read and written) over the copy
bandwidth.

--compare adds the peers on the same shapes with random weights: transformers'
PyTorch Mamba2 (its CPU path; torch threads = this machine's cores) and the
pure-JAX mamba2-jax, when installed (`pip install -e '.[bench]'`). The ratio
column is our tokens/s over the row's: above 1 means we are faster.
Outputs under --out: results.json, results.md and, with --plots, PNGs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any, Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.dirname(os.path.abspath(__file__))):
  if _p not in sys.path:
    sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mamba_train import metrics, roofline  # noqa: E402
from mamba_train.config import config_for  # noqa: E402
from mamba_train.model import Mamba2LM  # noqa: E402
from mamba_train.ssd import ssd_chunked, ssd_sequential  # noqa: E402

F32 = jnp.float32
CORES = os.cpu_count() or 1


def log(*a):
  print(*a, flush=True)


# ----------------------------------------------------------------------------
# Timing and compiling.


class Clock:
  """Wall and process-CPU seconds of a block."""

  def __enter__(self):
    self.w0, self.c0 = time.perf_counter(), time.process_time()
    return self

  def __exit__(self, *exc):
    self.wall, self.cpu = time.perf_counter() - self.w0, time.process_time() - self.c0
    return False


def compile_fn(jitted, *args):
  """(compiled, {'compile_s', 'compile_cpu_s', memory..., cost...})."""
  with Clock() as c:
    compiled = jitted.lower(*args).compile()
  info = {"compile_s": c.wall, "compile_cpu_s": c.cpu}
  mem = roofline.compiled_memory(compiled)
  if mem:
    info["peak_bytes"] = mem["peak_bytes"]
    info["temp_bytes"] = mem["temp_bytes"]
  return compiled, info


def median_time(fn: Callable[[], Any], repeats: int) -> float:
  return roofline.time_call(fn, repeats=repeats, warmup=1)


def torch_median_time(fn, repeats: int) -> float:
  fn()
  t = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    t.append(time.perf_counter() - t0)
  return statistics.median(t)


# ----------------------------------------------------------------------------
# Peers (optional).


def have_torch():
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    return True
  except ImportError:
    return False


def have_mamba2_jax():
  try:
    import mamba2_jax  # noqa: F401
    return True
  except ImportError:
    return False


def _speed_row(kind, impl, size, batch, l, cfg, dtype, sec, flops_per_token, rf, info=None):
  """One forward/train table row (tokens/s and MFU against this run's roofline), logged."""
  tps = batch * l / sec
  row = {"bench": kind, "impl": impl, "config": size, "batch": batch, "seq_len": l,
         "chunk": cfg.ssd_plan()[1], "dtype": dtype, "tokens_per_s": tps,
         "mfu": roofline.mfu(tps, flops_per_token, rf["matmul_flops"]), **(info or {})}
  log(f"  {kind} {size} {batch}x{l} {impl:10s}: {tps:9.0f} tok/s  MFU {100 * row['mfu']:.0f}%"
      + (f"  compile {info['compile_s']:.1f}s" if info else ""))
  return row

def peers_available(args) -> list[str]:
  if not args.compare:
    return []
  out = []
  if have_torch():
    import torch
    torch.set_num_threads(CORES)
    out.append("torch")
  else:
    log("peer missing: transformers + torch (pip install -e '.[bench]'); running ours only")
  if have_mamba2_jax():
    out.append("mamba2-jax")
  else:
    log("peer missing: mamba2-jax (pip install mamba2-jax); running ours only")
  return out


# The peers run at the chunk size our model runs with (cfg.ssd_plan(): 64 on CPU),
# which is also their fastest forward+backward on this CPU (see the ssd chunk sweep).
def torch_model(cfg, dtype: str):
  import torch
  import transformers
  tcfg = transformers.Mamba2Config(
      hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer, vocab_size=cfg.padded_vocab_size,
      num_heads=cfg.nheads, head_dim=cfg.headdim, n_groups=cfg.ngroups, state_size=cfg.d_state,
      expand=cfg.expand, conv_kernel=cfg.d_conv, chunk_size=cfg.ssd_plan()[1], tie_word_embeddings=True,
      use_cache=True)
  torch.manual_seed(0)
  model = transformers.Mamba2ForCausalLM(tcfg)
  if dtype == "bfloat16":
    model = model.to(torch.bfloat16)
  return model


def m2jax_model(cfg):
  import mamba2_jax
  mcfg = mamba2_jax.Mamba2Config(
      vocab_size=cfg.padded_vocab_size, hidden_size=cfg.d_model, state_size=cfg.d_state,
      head_dim=cfg.headdim, chunk_size=cfg.ssd_plan()[1], expand=cfg.expand, conv_kernel=cfg.d_conv,
      num_hidden_layers=cfg.n_layer)
  return mcfg, mamba2_jax.Mamba2ForCausalLM(mcfg, rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------
# Roofline of this device.


def measure_roofline(args, results):
  if "roofline" in results:
    return results["roofline"]
  n, mib = args.roofline_n, args.roofline_mib
  log(f"roofline: matmul {n}^3 in {args.dtype}" + (" and float32" if args.dtype != "float32" else "")
      + f", copy {mib} MiB ...")
  r = {"matmul_flops": roofline.matmul_rate(args.dtype, n=n, repeats=args.repeats)}
  if args.dtype != "float32":
    r["matmul_flops_f32"] = roofline.matmul_rate("float32", n=n, repeats=args.repeats)
  bw = roofline.copy_bandwidth(mib * 2**20, repeats=args.repeats)
  r.update({f"copy_bytes_per_s_{k}": v for k, v in bw.items()})
  r["copy_bytes_per_s"] = r["copy_bytes_per_s_donated"]
  r["matvec_bytes_per_s"] = roofline.matvec_bandwidth(mib * 2**20, repeats=args.repeats)
  if have_torch() and jax.default_backend() == "cpu":  # the peers' CPU rate; off CPU it is not their device
    import torch
    torch.set_num_threads(CORES)
    for dt in sorted({"float32", args.dtype}):
      td = getattr(torch, dt)
      a, b = torch.randn(n, n, dtype=td), torch.randn(n, n, dtype=td)
      r[f"torch_matmul_flops_{dt}"] = 2 * n**3 / torch_median_time(lambda: a @ b, args.repeats)
  log("  " + ", ".join(f"{k} {v / 1e9:.1f}G" for k, v in r.items()))
  results["roofline"] = r
  return r


# ----------------------------------------------------------------------------
# SSD alone.


def ssd_flops_per_token(h, p, n, g, q, l) -> float:
  """The SSD terms of metrics.forward_flops_per_token (forward, per token)."""
  c = -(-l // q)
  return 2 * q * g * n + 2 * q * h * p + 4 * h * p * n + 2 * (c + 1) ** 2 * h * p * n / l


def bench_ssd(args, results):
  rf = measure_roofline(args, results)
  b, l, h, p, n, g = args.batch or 2, args.seq_len or 2048, 24, 64, 128, 1
  chunks = args.chunks or ([args.chunk_size] if args.chunk_size else [64, 128, 256])
  dtype = jnp.dtype(args.dtype)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((b, l, h, p)), F32).astype(dtype)
  dt = jnp.asarray(rng.uniform(0.001, 0.1, (b, l, h)), F32)
  A = -jnp.asarray(rng.uniform(1, 16, (h,)), F32)
  B = jnp.asarray(rng.standard_normal((b, l, g, n)), F32).astype(dtype)
  C = jnp.asarray(rng.standard_normal((b, l, g, n)), F32).astype(dtype)
  D = jnp.ones((h,), F32)
  cot = jnp.asarray(rng.standard_normal((b, l, h, p)), F32)
  tokens = b * l
  rows = []

  def add(impl, chunk, mode, sec, info=None):
    fl = ssd_flops_per_token(h, p, n, g, chunk or 1, l) * (3 if mode == "fwd+bwd" else 1)
    row = {"bench": "ssd", "impl": impl, "mode": mode, "chunk": chunk, "batch": b, "seq_len": l,
           "dtype": args.dtype, "tokens_per_s": tokens / sec, "gflops": fl * tokens / sec / 1e9,
           "frac_matmul_peak": fl * tokens / sec / rf["matmul_flops"], **(info or {})}
    if chunk is None:
      row["gflops"] = row["frac_matmul_peak"] = None  # the recurrence has no matmuls
    rows.append(row)
    log(f"  ssd {impl:10s} {mode:8s} chunk {chunk}: {row['tokens_per_s']:9.0f} tok/s"
        + (f"  {row['gflops']:6.1f} GFLOP/s" if row["gflops"] else ""))

  # --ssd_form auto times the backend's default form; "scan,parallel" times both.
  forms = [None] if args.ssd_form == "auto" else args.ssd_form.split(",")
  for form, q in ((f, q) for f in forms for q in chunks):
    impl = "ours" if form is None else f"ours ({form})"
    fwd = jax.jit(lambda x, dt, A, B, C, D, q=q, f=form: ssd_chunked(x, dt, A, B, C, q, D=D, form=f)[0])
    loss = lambda x, dt, A, B, C, D, q=q, f=form: jnp.sum(
        ssd_chunked(x, dt, A, B, C, q, D=D, form=f)[0].astype(F32) * cot)
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))
    for mode, fn in (("fwd", fwd), ("fwd+bwd", bwd)):
      compiled, info = compile_fn(fn, x, dt, A, B, C, D)
      add(impl, q, mode, median_time(lambda: compiled(x, dt, A, B, C, D), args.repeats), info)
  seq = jax.jit(lambda x, dt, A, B, C, D: ssd_sequential(x, dt, A, B, C, D=D)[0])
  compiled, info = compile_fn(seq, x, dt, A, B, C, D)
  add("sequential", None, "fwd", median_time(lambda: compiled(x, dt, A, B, C, D), max(2, args.repeats // 2)), info)

  peers = peers_available(args)
  if "torch" in peers:
    import torch
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
    tdt = getattr(torch, args.dtype)
    tx = torch.tensor(np.asarray(x.astype(F32))).to(tdt)
    tdt_, tA, tD = torch.tensor(np.asarray(dt)), torch.tensor(np.asarray(A)), torch.tensor(np.asarray(D))
    tB, tC = torch.tensor(np.asarray(B.astype(F32))).to(tdt), torch.tensor(np.asarray(C.astype(F32))).to(tdt)
    tcot = torch.tensor(np.asarray(cot))
    for q in chunks:
      with torch.no_grad():
        sec = torch_median_time(lambda: mamba2_chunk_scan(tx, tdt_, tA, tB, tC, q, D=tD), args.repeats)
      add("torch", q, "fwd", sec)
      ins = [t.clone().requires_grad_(True) for t in (tx, tdt_, tA, tB, tC, tD)]

      def fb():
        for t in ins:
          t.grad = None
        y = mamba2_chunk_scan(*ins[:5], q, D=ins[5])
        (y.float() * tcot).sum().backward()
      add("torch", q, "fwd+bwd", torch_median_time(fb, args.repeats))
  if "mamba2-jax" in peers:
    from mamba2_jax import ssd_forward
    Bh, Ch = jnp.repeat(B, h // g, axis=2), jnp.repeat(C, h // g, axis=2)  # it takes B, C per head
    zero = jnp.zeros((h,), F32)
    for q in chunks:
      f = lambda x, dt, A, B, C, D, q=q: ssd_forward(x, dt, A, B, C, q, D, zero, 0.0, 1e9)[0]
      fwd = jax.jit(f)
      bwd = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(F32) * cot), argnums=(0, 1, 2, 3, 4, 5)))
      for mode, fn in (("fwd", fwd), ("fwd+bwd", bwd)):
        compiled, info = compile_fn(fn, x, dt, A, Bh, Ch, D)
        add("mamba2-jax", q, mode, median_time(lambda: compiled(x, dt, A, Bh, Ch, D), args.repeats), info)
  results.setdefault("rows", []).extend(rows)
  return rows


# ----------------------------------------------------------------------------
# Model: forward, train step, decode.


def _model_cfg(args, size, **kw):
  over = {"compute_dtype": args.dtype}
  if args.chunk_size:
    over["chunk_size"] = args.chunk_size
  if args.ssd_form in ("scan", "parallel"):
    over["ssd_form"] = args.ssd_form
  if args.remat:
    over["remat"] = args.remat
  over.update(kw)
  return config_for(size, **over)


def bench_forward(args, results, size, lengths, batch):
  rf = measure_roofline(args, results)
  peers = peers_available(args)
  rows = []
  for l in lengths:
    cfg = _model_cfg(args, size)
    ids_np = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, l)).astype(np.int32)
    ids = jnp.asarray(ids_np)
    fl = metrics.forward_flops_per_token(cfg, l)

    def add(impl, sec, info=None):
      rows.append(_speed_row("forward", impl, size, batch, l, cfg, args.dtype, sec, fl, rf, info))

    graphdef, params = nnx.split(Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    fwd = jax.jit(lambda params, ids: nnx.merge(graphdef, params)(ids))
    compiled, info = compile_fn(fwd, params, ids)
    add("ours", median_time(lambda: compiled(params, ids), args.repeats), info)
    del params, compiled
    if "torch" in peers:
      import torch
      model = torch_model(cfg, args.dtype).eval()
      tids = torch.tensor(ids_np, dtype=torch.long)
      with torch.no_grad():
        add("torch", torch_median_time(lambda: model(tids).logits, args.repeats))
      del model
    if "mamba2-jax" in peers:
      _, m = m2jax_model(cfg)
      gd, ps = nnx.split(m)
      fwd = jax.jit(lambda ps, ids: nnx.merge(gd, ps)(ids)["logits"])
      compiled, info = compile_fn(fwd, ps, ids)
      add("mamba2-jax", median_time(lambda: compiled(ps, ids), args.repeats), info)
      del ps, compiled
  results.setdefault("rows", []).extend(rows)
  return rows


def _run_config(args, size, batch, l):
  from configs import base
  c = base.get_config()
  c.model.update(_model_cfg(args, size).to_dict())
  c.batch_size, c.seq_len = batch, l
  c.mesh.update(data=1, fsdp=1, tensor=1)
  return c


def _batch(cfg, batch, l, mesh=None):
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, l + 1)).astype(np.int32)
  out = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "seq_idx": np.zeros((batch, l), np.int32),
         "loss_mask": np.ones((batch, l), np.float32)}
  return {k: jnp.asarray(v) for k, v in out.items()}


def bench_train(args, results, size, lengths, batch):
  from mamba_train import trainer
  from mamba_train.mesh import make_mesh
  rf = measure_roofline(args, results)
  peers = peers_available(args)
  rows = []
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  for l in lengths:
    config = _run_config(args, size, batch, l)
    built = trainer.build(config, mesh)
    cfg = built.model_cfg
    fl = metrics.train_flops_per_token(cfg, l)
    data = jax.device_put(_batch(cfg, batch, l), trainer.batch_sharding(mesh))

    def add(impl, sec, info=None):
      rows.append(_speed_row("train", impl, size, batch, l, cfg, args.dtype, sec, fl, rf, info))

    compiled, info = compile_fn(built.train_step, built.state, data)
    box = {"state": built.state}

    def step():
      box["state"], m = compiled(box["state"], data)
      return m["loss"]
    add("ours", median_time(step, args.repeats), info)
    del box, built, compiled
    if "torch" in peers:
      import torch
      model = torch_model(cfg, args.dtype).train()
      opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
      tids = torch.tensor(np.asarray(data["input_ids"]), dtype=torch.long)

      def tstep():
        loss = model(tids, labels=tids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
      add("torch", torch_median_time(tstep, args.repeats))
      del model, opt
    if "mamba2-jax" in peers:
      import optax
      _, m = m2jax_model(cfg)
      gd, ps = nnx.split(m)
      tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1))
      opt_state = tx.init(ps)
      ids = data["input_ids"]

      def mstep(ps, opt_state, ids):
        loss, g = jax.value_and_grad(lambda ps: nnx.merge(gd, ps)(ids, labels=ids)["loss"])(ps)
        upd, opt_state = tx.update(g, opt_state, ps)
        return optax.apply_updates(ps, upd), opt_state, loss
      compiled, info = compile_fn(jax.jit(mstep, donate_argnums=(0, 1)), ps, opt_state, ids)
      box = {"s": (ps, opt_state)}

      def mrun():
        p_, o_, loss = compiled(*box["s"], ids)
        box["s"] = (p_, o_)
        return loss
      add("mamba2-jax", median_time(mrun, args.repeats), info)
      del box, compiled
  results.setdefault("rows", []).extend(rows)
  return rows


def bench_decode(args, results, size, contexts, batch):
  from mamba_train.generate import decode_benchmark
  rf = measure_roofline(args, results)
  peers = peers_available(args)
  cfg = _model_cfg(args, size)
  per_tok = roofline.decode_bytes_per_step(cfg, batch) / batch
  new = args.new_tokens
  rows = []

  def add(impl, ctx, tps, extra=None):
    row = {"bench": "decode", "impl": impl, "config": size, "batch": batch, "seq_len": ctx,
           "dtype": args.dtype, "tokens_per_s": tps,
           "bw_util": roofline.bandwidth_utilisation(tps, per_tok, rf["copy_bytes_per_s"]),
           "matvec_util": roofline.bandwidth_utilisation(tps, per_tok, rf["matvec_bytes_per_s"]),
           **(extra or {})}
    rows.append(row)
    log(f"  decode {size} b{batch} ctx {ctx} {impl:16s}: {tps:9.1f} tok/s  bandwidth {100 * row['bw_util']:.0f}%"
        f" of copy, {100 * row['matvec_util']:.0f}% of matvec")

  got = decode_benchmark(cfg, prompt_lens=contexts, batch=batch, new_tokens=new,
                         host_tokens=min(new, 16), recompute_tokens=2, repeats=max(3, args.repeats // 2),
                         log=None)
  for r in got:
    add("ours (device loop)", r["prompt_len"], r["device_tok_s"],
        {"compile_s": r["loop_compile_s"], "prefill_s": r["prefill_s"]})
    add("ours (host loop)", r["prompt_len"], r["host_tok_s"])
    add("ours (recompute)", r["prompt_len"], r["recompute_tok_s"])
  n_peer = max(4, min(new, 16))
  if "torch" in peers:
    import torch
    model = torch_model(cfg, args.dtype).eval()
    for ctx in contexts:
      ids = torch.randint(0, cfg.vocab_size, (batch, ctx))
      gen = lambda k: model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                     use_cache=True, pad_token_id=0)
      with torch.no_grad():
        t1 = torch_median_time(lambda: gen(1), 2)
        tk = torch_median_time(lambda: gen(n_peer), 2)
      add("torch (cached)", ctx, batch * (n_peer - 1) / max(tk - t1, 1e-9))
    del model
  if "mamba2-jax" in peers:
    import mamba2_jax
    mcfg, m = m2jax_model(cfg)
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
  results.setdefault("rows", []).extend(rows)
  return rows


# ----------------------------------------------------------------------------
# Compile time, memory, loader.


def bench_compile(args, results, size):
  """Compile time of forward and train step against depth (flat: layers are
  scanned), and, with libtpu, the 2.7b forward at l=4096 for one TPU v6e chip."""
  from mamba_train import trainer
  from mamba_train.mesh import make_mesh
  rows = []
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  base_cfg = _model_cfg(args, size)
  l, batch = args.seq_len or 512, args.batch or 1
  for depth in sorted({1, 2, 4, base_cfg.n_layer}):
    cfg = base_cfg.replace(n_layer=depth)
    model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)
    ids = jax.ShapeDtypeStruct((batch, l), jnp.int32)
    _, info = compile_fn(jax.jit(lambda p, i: nnx.merge(graphdef, p)(i)), params, ids)
    rows.append({"bench": "compile", "impl": "ours", "program": "forward", "config": size, "n_layer": depth,
                 "batch": batch, "seq_len": l, "target": "cpu", **info})
    config = _run_config(args, size, batch, l)
    config.model.n_layer = depth
    from mamba_train.optim import make_optimizer
    from aot_compile import abstract_train_state, abstract_batch
    opt, sched = make_optimizer(config.optim, config.steps)
    step = trainer.make_train_step(cfg, opt, sched, mesh)
    st = abstract_train_state(cfg, opt, trainer.state_shardings(cfg, opt, mesh))
    _, info = compile_fn(step, st, abstract_batch(batch, l, mesh))
    rows.append({"bench": "compile", "impl": "ours", "program": "train step", "config": size, "n_layer": depth,
                 "batch": batch, "seq_len": l, "target": "cpu", **info})
    for r in rows[-2:]:
      log(f"  compile {r['program']:10s} {size} n_layer {depth:2d}: {r['compile_s']:.2f}s wall, "
          f"{r['compile_cpu_s']:.2f}s cpu")
  if not args.skip_tpu:
    rows += bench_compile_tpu(args)
  results.setdefault("rows", []).extend(rows)
  return rows


def outside_scan_cost(cfg, batch, seq_len):
  """XLA's counts of the embedding, final norm and LM head alone, for one v6e chip."""
  import aot_compile
  from jax.sharding import NamedSharding, PartitionSpec as P
  _, _, devs = aot_compile.tpu_devices("v6e:1x1")
  rep = NamedSharding(jax.sharding.Mesh(np.asarray(devs), ("data",)), P())
  model = nnx.eval_shape(lambda: Mamba2LM(cfg.replace(n_layer=1), rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), params)
  ids = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=rep)
  f = jax.jit(lambda p, i: (lambda m: m.logits(m.embed(i)))(nnx.merge(graphdef, p)))
  return roofline.compiled_cost(f.lower(params, ids).compile())


def bench_compile_tpu(args):
  """2.7b forward at l=4096, batch 1, bf16, for one v6e chip: ours, and the peer with --compare."""
  rows = []
  try:
    import aot_compile
    aot_compile.tpu_devices("v6e:1x1")
  except Exception as e:  # noqa: BLE001
    log(f"  TPU compile skipped: {str(e).splitlines()[0]} (pip install libtpu)")
    return rows
  cfg = config_for("2.7b", compute_dtype="bfloat16")
  with Clock() as c:
    r = aot_compile.compile_forward(cfg, 1, 4096, "v6e:1x1")
  # XLA's cost analysis counts a scanned (while-loop) body once, whatever the
  # depth: add the body (one layer's counts minus the embedding and head alone)
  # n_layer - 1 more times.
  r1 = aot_compile.compile_forward(cfg.replace(n_layer=1), 1, 4096, "v6e:1x1")["cost"]
  r0 = outside_scan_cost(cfg, 1, 4096)
  counts = {k: r1[k] + (cfg.n_layer - 1) * (r1[k] - r0[k]) for k in ("flops", "bytes accessed")}
  chip = roofline.TPU_CHIPS["v6e"]
  rl = roofline.roofline_seconds(counts["flops"], counts["bytes accessed"], chip.peak_flops, chip.hbm_bandwidth)
  row = {"bench": "compile", "impl": "ours", "program": "forward 2.7b l4096 bf16", "target": "TPU v6e (AOT)",
         "n_layer": 64, "seq_len": 4096, "batch": 1, "compile_s": r["compile_s"], "lower_s": r["lower_s"],
         "compile_cpu_s": c.cpu, "xla_flops": counts["flops"], "xla_bytes": counts["bytes accessed"],
         "xla_flops_raw": r["cost"].get("flops"), "model_flops": r["model_flops"],
         "peak_bytes": (r["memory"] or {}).get("peak_bytes"), "roofline": rl}
  rows.append(row)
  log(f"  compile 2.7b fwd l4096 for v6e: {r['compile_s']:.1f}s (+lower {r['lower_s']:.1f}s); XLA "
      f"{counts['flops']:.2e} FLOPs, {counts['bytes accessed']:.2e} bytes -> {rl['bound']}-bound, "
      f"{rl['time_s'] * 1e3:.1f} ms at 918 TF/s, 1.6 TB/s")
  # The scan form of the SSD (ssd_form='scan', the CPU default) compiles far faster;
  # its XLA counts would need the chunk loop's trip count too, so only time it.
  with Clock() as c:
    rs = aot_compile.compile_forward(cfg.replace(ssd_form="scan", scan_chunk_size=256), 1, 4096, "v6e:1x1")
  rows.append({"bench": "compile", "impl": "ours", "program": "forward 2.7b l4096 bf16, scan-form SSD",
               "target": "TPU v6e (AOT)", "n_layer": 64, "seq_len": 4096, "batch": 1,
               "compile_s": rs["compile_s"], "lower_s": rs["lower_s"], "compile_cpu_s": c.cpu})
  log(f"  compile 2.7b fwd l4096 for v6e, scan-form SSD: {rs['compile_s']:.1f}s")
  if args.compare and have_mamba2_jax():
    from jax.sharding import NamedSharding, PartitionSpec as P
    _, _, devs = aot_compile.tpu_devices("v6e:1x1")
    mesh = jax.sharding.Mesh(np.asarray(devs), ("data",))
    import mamba2_jax
    mcfg = mamba2_jax.Mamba2Config(hidden_size=2560, num_hidden_layers=64, vocab_size=50288)
    m = nnx.eval_shape(lambda: mamba2_jax.Mamba2ForCausalLM(mcfg, rngs=nnx.Rngs(0)))
    gd, ps = nnx.split(m)
    rep = NamedSharding(mesh, P())
    ps = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16 if s.dtype == F32 else s.dtype,
                                                     sharding=rep), ps)
    ids = jax.ShapeDtypeStruct((1, 4096), jnp.int32, sharding=rep)
    fwd = jax.jit(lambda ps, ids: nnx.merge(gd, ps)(ids)["logits"])
    with Clock() as c:
      compiled = fwd.lower(ps, ids).compile()
    cost = roofline.compiled_cost(compiled)
    rows.append({"bench": "compile", "impl": "mamba2-jax", "program": "forward 2.7b l4096 bf16",
                 "target": "TPU v6e (AOT)", "n_layer": 64, "seq_len": 4096, "batch": 1,
                 "compile_s": c.wall, "compile_cpu_s": c.cpu, "xla_flops": cost.get("flops"),
                 "xla_bytes": cost.get("bytes accessed")})
    log(f"  mamba2-jax 2.7b fwd l4096 for v6e: {c.wall:.1f}s; {cost.get('flops', 0):.2e} FLOPs, "
        f"{cost.get('bytes accessed', 0):.2e} bytes")
  return rows


def bench_memory(args, results, size, lengths, batch):
  """Peak memory (XLA memory analysis) of forward and train step against length; compile only."""
  from mamba_train import trainer
  from mamba_train.mesh import make_mesh
  from mamba_train.optim import make_optimizer
  from aot_compile import abstract_train_state, abstract_batch
  mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  cfg = _model_cfg(args, size)
  rows = []
  model = nnx.eval_shape(lambda: Mamba2LM(cfg, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  config = _run_config(args, size, batch, lengths[0])
  opt, sched = make_optimizer(config.optim, config.steps)
  step = trainer.make_train_step(cfg, opt, sched, mesh)
  st = abstract_train_state(cfg, opt, trainer.state_shardings(cfg, opt, mesh))
  fwd = jax.jit(lambda p, i: nnx.merge(graphdef, p)(i))
  for l in lengths:
    for program, fn, a in (("forward", fwd, (params, jax.ShapeDtypeStruct((batch, l), jnp.int32))),
                           ("train step", step, (st, abstract_batch(batch, l, mesh)))):
      _, info = compile_fn(fn, *a)
      rows.append({"bench": "memory", "impl": "ours", "program": program, "config": size, "batch": batch,
                   "seq_len": l, "dtype": args.dtype, **info})
      log(f"  memory {program:10s} {size} {batch}x{l}: peak {info.get('peak_bytes', 0) / 2**20:.0f} MiB "
          f"(scratch {info.get('temp_bytes', 0) / 2**20:.0f} MiB)")
  results.setdefault("rows", []).extend(rows)
  results["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return rows


def bench_loader(args, results):
  from mamba_train import data
  d = os.path.join(_ROOT, "data", "default")
  if not os.path.exists(os.path.join(d, "metadata.json")):
    d = data.ensure_default_corpus(os.path.join(_ROOT, "data"))
  l, b = args.seq_len or 2048, args.batch or 8
  tps = data.loader_throughput(d, seq_len=l, batch=b, seconds=3.0)
  row = {"bench": "loader", "impl": "ours", "batch": b, "seq_len": l, "tokens_per_s": tps}
  log(f"  loader {b}x{l}: {tps:.3g} tok/s")
  results.setdefault("rows", []).append(row)
  return [row]


# ----------------------------------------------------------------------------
# Report.


def _fmt(v, kind=""):
  if v is None:
    return ""
  if kind == "pct":
    return f"{100 * v:.1f}%"
  if kind == "x":
    return f"{v:.2f}x"
  if isinstance(v, float):
    if abs(v) >= 100:
      return f"{v:,.0f}"
    return f"{v:.3g}"
  return str(v)


def _key(r):
  return tuple(r.get(k) for k in ("bench", "config", "mode", "batch", "seq_len", "dtype"))


def add_ratios(rows):
  """ratio = our tokens/s over this row's, for rows with the same bench and shape.
  For the SSD our best chunk is compared with each peer row."""
  for r in rows:
    if "tokens_per_s" not in r or r["bench"] in ("loader",):
      continue
    ours = [o for o in rows if _key(o) == _key(r) and o["impl"].startswith("ours")
            and o["impl"] not in ("ours (recompute)", "ours (host loop)")]
    if ours:
      r["ours_over_this"] = max(o["tokens_per_s"] for o in ours) / r["tokens_per_s"]


def markdown(results) -> str:
  rows = results.get("rows", [])
  add_ratios(rows)
  out = [f"# mamba_train benchmarks", "",
         f"{results['date']} · {results['machine']} · jax {jax.__version__} · "
         f"command: `{results['command']}`", ""]
  for p in results.get("parts", []):
    rfp = p.get("roofline") or {}
    out.append(f"- `{p['command']}` ({p['date']}, {p.get('seconds') or 0:.0f} s): matmul "
               f"{rfp.get('matmul_flops', 0) / 1e9:.0f} GFLOP/s, copy {rfp.get('copy_bytes_per_s', 0) / 1e9:.1f} GB/s"
               + (f", matvec read {rfp['matvec_bytes_per_s'] / 1e9:.1f} GB/s" if rfp.get("matvec_bytes_per_s") else ""))
  if results.get("parts"):
    out += ["", "MFU and bandwidth figures of each row use the roofline measured in its own run.", ""]
  rf = results.get("roofline")
  if rf and not results.get("parts"):
    out += ["## Roofline of this device (measured in the same run)", "",
            "| measure | value |", "|---|---|"]
    for k, v in rf.items():
      out.append(f"| {k} | {v / 1e9:.1f} G/s |")
    out.append("")
  sections = [
      ("ssd", "SSD scan alone (b, l, h 24, p 64, n 128)",
       [("impl", ""), ("mode", ""), ("chunk", ""), ("dtype", ""), ("tokens_per_s", ""), ("gflops", ""),
        ("frac_matmul_peak", "pct"), ("compile_s", ""), ("ours_over_this", "x")]),
      ("forward", "Forward (prefill, logits)",
       [("config", ""), ("impl", ""), ("batch", ""), ("seq_len", ""), ("dtype", ""), ("tokens_per_s", ""),
        ("mfu", "pct"), ("compile_s", ""), ("peak_bytes", "mib"), ("ours_over_this", "x")]),
      ("train", "Train step (forward, backward, AdamW)",
       [("config", ""), ("impl", ""), ("batch", ""), ("seq_len", ""), ("dtype", ""), ("tokens_per_s", ""),
        ("mfu", "pct"), ("compile_s", ""), ("compile_cpu_s", ""), ("peak_bytes", "mib"), ("ours_over_this", "x")]),
      ("decode", "Decode (greedy, tokens/s; bytes per token x tokens/s over the copy bandwidth, "
                 "and over the batch-1 matvec read rate)",
       [("config", ""), ("impl", ""), ("batch", ""), ("seq_len", ""), ("tokens_per_s", ""),
        ("bw_util", "pct"), ("matvec_util", "pct"), ("ours_over_this", "x")]),
      ("compile", "Compile time (wall and this process's CPU seconds)",
       [("impl", ""), ("program", ""), ("config", ""), ("n_layer", ""), ("batch", ""), ("seq_len", ""),
        ("target", ""), ("compile_s", ""), ("compile_cpu_s", ""), ("xla_flops", ""), ("xla_bytes", "")]),
      ("memory", "Peak memory (XLA memory analysis: arguments + outputs + scratch - donated)",
       [("program", ""), ("config", ""), ("batch", ""), ("seq_len", ""), ("dtype", ""), ("peak_bytes", "mib"),
        ("temp_bytes", "mib"), ("compile_s", "")]),
      ("loader", "Data loader", [("batch", ""), ("seq_len", ""), ("tokens_per_s", "")]),
  ]
  for bench, title, cols in sections:
    rs = [r for r in rows if r["bench"] == bench]
    if not rs:
      continue
    names = {"tokens_per_s": "tokens/s", "gflops": "GFLOP/s", "frac_matmul_peak": "of matmul peak",
             "mfu": "MFU", "compile_s": "compile s", "compile_cpu_s": "compile cpu s",
             "peak_bytes": "peak MiB", "temp_bytes": "scratch MiB", "ours_over_this": "ours / this",
             "bw_util": "of copy bandwidth", "matvec_util": "of matvec read rate", "xla_flops": "XLA FLOPs", "xla_bytes": "XLA bytes"}
    out += [f"## {title}", "", "| " + " | ".join(names.get(c, c) for c, _ in cols) + " |",
            "|" + "---|" * len(cols)]
    for r in rs:
      cells = []
      for c, kind in cols:
        v = r.get(c)
        if kind == "mib" and v is not None:
          cells.append(f"{v / 2**20:,.0f}")
        else:
          cells.append(_fmt(v, kind))
      out.append("| " + " | ".join(cells) + " |")
    out.append("")
  rl_rows = [r for r in rows if r.get("roofline")]
  for r in rl_rows:
    rl = r["roofline"]
    out.append(f"{r['impl']} {r['program']} on {r['target']}: XLA counts {r['xla_flops']:.3g} FLOPs and "
               f"{r['xla_bytes']:.3g} bytes (scan body scaled by depth), intensity {rl['intensity']:.0f} "
               f"FLOP/byte: {rl['bound']}-bound, {rl['time_s'] * 1e3:.1f} ms at the datasheet peaks "
               f"(compute {rl['compute_s'] * 1e3:.1f} ms, memory {rl['memory_s'] * 1e3:.1f} ms).")
  return "\n".join(out) + "\n"


def plots(results, out_dir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = results.get("rows", [])
  made = []

  def line_plot(bench, fname, ylabel, title, key="tokens_per_s", filt=lambda r: True, label=lambda r: r["impl"]):
    rs = [r for r in rows if r["bench"] == bench and filt(r) and r.get(key) is not None]
    if not rs:
      return
    fig, ax = plt.subplots(figsize=(6, 4))
    for lab in sorted({label(r) for r in rs}):
      pts = sorted((r["seq_len"], r[key]) for r in rs if label(r) == lab)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=lab)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length" if bench != "decode" else "context length")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, fname)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    made.append(path)

  for size in sorted({r.get("config") for r in rows if r.get("config")}):
    for bench in ("forward", "train"):
      line_plot(bench, f"{bench}_{size}.png", "tokens/s", f"{bench} {size}: tokens/s vs length",
                filt=lambda r, s=size: r.get("config") == s)
    line_plot("decode", f"decode_{size}.png", "tokens/s", f"decode {size}: tokens/s vs context",
              filt=lambda r, s=size: r.get("config") == s)
    line_plot("memory", f"memory_{size}.png", "peak bytes (XLA)", f"{size}: peak memory vs length",
              key="peak_bytes", filt=lambda r, s=size: r.get("config") == s, label=lambda r: r["program"])
  return made


# ----------------------------------------------------------------------------


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  ap.add_argument("what", choices=["ssd", "forward", "train", "decode", "compile", "memory", "loader", "all",
                                   "report"], help="report: merge the results.json of --inputs into --out")
  ap.add_argument("--inputs", default="", help="report: comma-separated directories of earlier runs")
  ap.add_argument("--config", default=None, help="model size(s), comma separated: tiny,130m,... "
                  "(default: tiny; 'all' runs tiny,130m)")
  ap.add_argument("--batch", type=int, default=None)
  ap.add_argument("--seq_len", type=int, default=None, help="one length (default: a sweep per bench)")
  ap.add_argument("--lengths", default=None, help="comma-separated lengths for the sweeps")
  ap.add_argument("--chunk_size", type=int, default=None, help="override the config's chunk size")
  ap.add_argument("--chunks", default=None, help="ssd: comma-separated chunk sizes (default 64,128,256)")
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--new_tokens", type=int, default=32, help="decode: tokens per timed loop")
  ap.add_argument("--compare", action="store_true", help="time the peers on the same shapes")
  ap.add_argument("--skip_tpu", action="store_true", help="compile: skip the TPU AOT figure")
  ap.add_argument("--remat", default=None, choices=["none", "full", "save_matmuls"],
                  help="what the backward pass recomputes (default: the config's, none)")
  ap.add_argument("--ssd_form", default="auto", help="auto (the backend's default), scan or parallel; "
                  "ssd also takes 'scan,parallel' to time both")
  ap.add_argument("--roofline_n", type=int, default=None, help="matmul size of the roofline "
                  "(default 2048 on CPU, 8192 on accelerators)")
  ap.add_argument("--roofline_mib", type=int, default=None, help="buffer size of the copy bandwidth "
                  "(default 256 MiB on CPU, 2048 on accelerators)")
  ap.add_argument("--out", default=None, help="write results.json and results.md here")
  ap.add_argument("--plots", action="store_true", help="PNG plots into --out")
  args = ap.parse_args(argv)
  if args.repeats < 1:
    ap.error("--repeats must be >= 1")
  if not set(args.ssd_form.split(",")) <= {"auto", "scan", "parallel"} or (
      "," in args.ssd_form and args.what != "ssd"):
    ap.error(f"--ssd_form must be auto, scan or parallel (ssd also takes 'scan,parallel'), got {args.ssd_form!r}")
  accel = jax.default_backend() != "cpu"
  args.roofline_n = args.roofline_n or (8192 if accel else 2048)
  args.roofline_mib = args.roofline_mib or (2048 if accel else 256)
  args.chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else None
  sizes = (args.config or ("tiny,130m" if args.what == "all" else "tiny")).split(",")
  lengths_arg = [int(x) for x in args.lengths.split(",")] if args.lengths else None

  def lengths(default):
    return [args.seq_len] if args.seq_len else (lengths_arg or default)

  # Shapes per size: (forward lengths, batch), (train lengths, batch), decode contexts.
  # On CPU, what fits a 2-core machine; on an accelerator, batches that fill it.
  defaults = {
      "tiny": dict(fwd=([256, 512, 1024, 2048], 4), train=([256, 512, 1024], 4), ctx=[128, 512, 2048]),
      "130m": dict(fwd=([512, 2048], 1), train=([512], 1), ctx=[128, 1024]),
  } if not accel else {
      "130m": dict(fwd=([2048], 16), train=([2048], 16), ctx=[128, 2048]),
      "370m": dict(fwd=([2048], 16), train=([2048], 8), ctx=[128, 2048]),
      "1.3b": dict(fwd=([2048], 8), train=([2048], 4), ctx=[128, 2048]),
  }
  results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "machine": f"{platform.processor() or platform.machine()}, {CORES} cores, "
                        f"{jax.devices()[0].device_kind}",
             "command": "python scripts/bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
             "rows": []}
  what = args.what
  if what == "report":
    parts = [json.load(open(os.path.join(d, "results.json"))) for d in args.inputs.split(",") if d]
    results["rows"] = [r for p in parts for r in p["rows"]]
    results["roofline"] = parts[0].get("roofline") if parts else None
    results["parts"] = [{"command": p["command"], "date": p["date"], "roofline": p.get("roofline"),
                         "seconds": p.get("seconds")} for p in parts]
  t0 = time.perf_counter()
  if what in ("ssd", "all"):
    bench_ssd(args, results)
  for size in sizes:
    d = defaults.get(size, dict(fwd=([512], 1), train=([512], 1), ctx=[128]))
    if what in ("forward", "all"):
      bench_forward(args, results, size, lengths(d["fwd"][0]), args.batch or d["fwd"][1])
    if what in ("train", "all"):
      bench_train(args, results, size, lengths(d["train"][0]), args.batch or d["train"][1])
    if what in ("decode", "all"):
      bench_decode(args, results, size, lengths(d["ctx"]), args.batch or 1)
    if what in ("memory", "all"):
      bench_memory(args, results, size, lengths([512, 1024, 2048, 4096]), args.batch or 1)
    if what in ("compile", "all"):
      bench_compile(args, results, size)
      args.skip_tpu = True  # the TPU figure once per run
  if what in ("loader", "all"):
    bench_loader(args, results)
  results["seconds"] = time.perf_counter() - t0
  md = markdown(results)
  print(md)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out, "results.md"), "w") as f:
      f.write(md)
    if args.plots:
      for p in plots(results, args.out):
        log(f"wrote {p}")
  return results


if __name__ == "__main__":
  main()
