"""The SSD scan alone, at the 130m model's head shapes (h 24, p 64, n 128, one
group), forward and forward+backward, over a sweep of chunk sizes.

The chunk is the one knob of the block decomposition, and the form ('scan' or
'parallel') decides how the chunks are combined; this is the benchmark the
runtime's defaults for both were chosen from. The sequential recurrence is the
reference without matmuls. FLOPs are `mamba_train.metrics.ssd_flops_per_token`
for the form timed; the peers' chunked scans pass states as one matrix product,
the parallel form's count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import peers, roofline
from benchmarks.common import F32, add_rows, compile_fn, log, median_time
from mamba_train.metrics import ssd_flops_per_token
from mamba_train.model.runtime import default_form
from mamba_train.ops.ssd import ssd_chunked, ssd_sequential


def bench_ssd(args, results):
  rf = roofline.measure(args, results)
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

  def add(impl, chunk, mode, sec, form="parallel", info=None):
    fl = (ssd_flops_per_token(h, p, n, g, chunk, l, form) * (3 if mode == "fwd+bwd" else 1)
          if chunk else None)  # the recurrence (no chunk) has no matmuls
    row = {"bench": "ssd", "impl": impl, "mode": mode, "chunk": chunk, "batch": b, "seq_len": l,
           "dtype": args.dtype, "tokens_per_s": tokens / sec,
           "gflops": fl * tokens / sec / 1e9 if fl else None,
           "frac_matmul_peak": fl * tokens / sec / rf["matmul_flops"] if fl else None, **(info or {})}
    rows.append(row)
    log(f"  ssd {impl:10s} {mode:8s} chunk {chunk}: {row['tokens_per_s']:9.0f} tok/s"
        + (f"  {row['gflops']:6.1f} GFLOP/s" if row["gflops"] else ""))

  # --ssd_form auto times the backend's default form (labelled plain "ours");
  # "scan,parallel" times both.
  forms = [None] if args.ssd_form == "auto" else args.ssd_form.split(",")
  for label, q in ((f, q) for f in forms for q in chunks):
    form = label or default_form(jax.default_backend())
    impl = "ours" if label is None else f"ours ({label})"
    fwd = jax.jit(lambda x, dt, A, B, C, D, q=q, f=form: ssd_chunked(x, dt, A, B, C, q, D=D, form=f)[0])
    loss = lambda x, dt, A, B, C, D, q=q, f=form: jnp.sum(
        ssd_chunked(x, dt, A, B, C, q, D=D, form=f)[0].astype(F32) * cot)
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))
    for mode, fn in (("fwd", fwd), ("fwd+bwd", bwd)):
      compiled, info = compile_fn(fn, x, dt, A, B, C, D)
      add(impl, q, mode, median_time(lambda: compiled(x, dt, A, B, C, D), args.repeats), form, info)
  seq = jax.jit(lambda x, dt, A, B, C, D: ssd_sequential(x, dt, A, B, C, D=D)[0])
  compiled, info = compile_fn(seq, x, dt, A, B, C, D)
  add("sequential", None, "fwd", median_time(lambda: compiled(x, dt, A, B, C, D), max(2, args.repeats // 2)),
      info=info)

  compared = peers.available(args)
  if "torch" in compared:
    import torch
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
    tdt = getattr(torch, args.dtype)
    tx = torch.tensor(np.asarray(x.astype(F32))).to(tdt)
    tdt_, tA, tD = torch.tensor(np.asarray(dt)), torch.tensor(np.asarray(A)), torch.tensor(np.asarray(D))
    tB, tC = torch.tensor(np.asarray(B.astype(F32))).to(tdt), torch.tensor(np.asarray(C.astype(F32))).to(tdt)
    tcot = torch.tensor(np.asarray(cot))
    for q in chunks:
      with torch.no_grad():
        sec = peers.torch_time(lambda: mamba2_chunk_scan(tx, tdt_, tA, tB, tC, q, D=tD), args.repeats)
      add("torch", q, "fwd", sec)
      ins = [t.clone().requires_grad_(True) for t in (tx, tdt_, tA, tB, tC, tD)]

      def fb():
        for t in ins:
          t.grad = None
        y = mamba2_chunk_scan(*ins[:5], q, D=ins[5])
        (y.float() * tcot).sum().backward()
      add("torch", q, "fwd+bwd", peers.torch_time(fb, args.repeats))
  if "mamba2-jax" in compared:
    from mamba2_jax import ssd_forward
    Bh, Ch = jnp.repeat(B, h // g, axis=2), jnp.repeat(C, h // g, axis=2)  # it takes B, C per head
    zero = jnp.zeros((h,), F32)
    for q in chunks:
      f = lambda x, dt, A, B, C, D, q=q: ssd_forward(x, dt, A, B, C, q, D, zero, 0.0, 1e9)[0]
      fwd = jax.jit(f)
      bwd = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(F32) * cot), argnums=(0, 1, 2, 3, 4, 5)))
      for mode, fn in (("fwd", fwd), ("fwd+bwd", bwd)):
        compiled, info = compile_fn(fn, x, dt, A, Bh, Ch, D)
        add("mamba2-jax", q, mode, median_time(lambda: compiled(x, dt, A, Bh, Ch, D), args.repeats),
            info=info)
  return add_rows(results, rows)
