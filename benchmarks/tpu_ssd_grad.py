"""XLA's FLOPs and bytes of the SSD alone, forward and value_and_grad, compiled for
one TPU chip through libtpu (no TPU needed): the XLA form, and the fused Pallas
forms (two kernels, or one pass) with the reference backward (the vjp of the
plain-JAX per-chunk functions, as the kernels had before their Pallas backward)
or with the Pallas backward kernels. `benchmarks.tpu_ssd` counts the forwards.

  env -u XLA_FLAGS python -m benchmarks.tpu_ssd_grad       # 2.7b layer: b1 l4096 h80 p64 g1 n128, chunk 128

libtpu parses XLA_FLAGS and aborts on CPU-only flags, hence the `env -u`. The SSD
has no loop in any of these forms (the parallel XLA form, the Pallas grids), so
XLA's counts cover the whole program.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mamba_train import metrics
from mamba_train.model import ssd, ssd_pallas
from mamba_train.parallel.topology import tpu_devices


@contextlib.contextmanager
def reference_backward():
  """ssd_fused's kernels with the backward they had before the Pallas backward:
  the vjp of `_states_ref` / `_outputs_ref`, recomputing the (t, s) terms in XLA."""
  sp = ssd_pallas
  states = jax.custom_vjp(sp._states_call, nondiff_argnums=(6,))
  states.defvjp(lambda *a: (sp._states_call(*a), a[:6]),
                lambda interp, res, ct: (*jax.vjp(lambda *a: sp._states_ref(*a, res[5]), *res[:5])[1](ct),
                                         None))
  outputs = jax.custom_vjp(sp._outputs_call, nondiff_argnums=(10,))
  outputs.defvjp(lambda *a: (sp._outputs_call(*a), a[:10]),
                 lambda interp, res, ct: (*jax.vjp(lambda *a: sp._outputs_ref(*a, *res[7:]), *res[:7])[1](ct),
                                          None, None, None))
  saved = sp._chunk_states, sp._chunk_outputs
  sp._chunk_states, sp._chunk_outputs = states, outputs
  try:
    yield
  finally:
    sp._chunk_states, sp._chunk_outputs = saved


two = functools.partial(ssd_pallas.ssd_fused, one_pass=False)
one = functools.partial(ssd_pallas.ssd_fused, one_pass=True)
# name -> (SSD fn, context that swaps the backward or None, whether to count the forward too)
FORMS = {
    "xla (ssd_chunked, parallel form)": (functools.partial(ssd.ssd_chunked, form="parallel"), None, True),
    "pallas two kernels, reference backward": (two, reference_backward, False),
    "pallas two kernels, Pallas backward": (two, None, True),
    "pallas one pass, reference backward": (one, reference_backward, False),
    "pallas one pass, Pallas backward": (one, None, True),
}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--topology", default="v6e:1x1")
  ap.add_argument("--seq_len", type=int, default=4096)
  ap.add_argument("--heads", type=int, default=80)
  ap.add_argument("--docs", action="store_true", help="pass seq_idx (packed documents)")
  args = ap.parse_args(argv)
  gen, topo, devices = tpu_devices(args.topology)
  chip = metrics.CHIPS[gen]
  rep = NamedSharding(Mesh(np.array(devices[:1]), ("d",)), P())
  S = lambda s, d=jnp.float32: jax.ShapeDtypeStruct(s, d, sharding=rep)
  b, l, h, p, g, n, q = 1, args.seq_len, args.heads, 64, 1, 128, 128
  bf = jnp.bfloat16
  xs = (S((b, l, h, p), bf), S((b, l, h)), S((h,)), S((b, l, g, n), bf), S((b, l, g, n), bf), S((h,)))
  seq = S((b, l), jnp.int32) if args.docs else None
  print(f"SSD alone, b={b} l={l} h={h} p={p} g={g} n={n} chunk {q}, x/B/C bfloat16, {topo} "
        f"({chip.name}: {chip.peak_flops / 1e12:.0f} TFLOP/s, {chip.hbm_bandwidth / 1e12:.1f} TB/s)")
  print("| form | program | XLA FLOPs | XLA bytes | roofline ms | bound | compile s |")
  print("|---|---|---|---|---|---|---|")
  for name, (fn, ctx, with_fwd) in FORMS.items():
    def run(x, dt, A, B, C, D, seq, fn=fn):
      y, s = fn(x, dt, A, B, C, q, D=D, seq_idx=seq)
      return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s)
    progs = {"forward": jax.jit(run),
             "value_and_grad": jax.jit(jax.value_and_grad(run, argnums=tuple(range(6))))}
    for prog, f in progs.items():
      if prog == "forward" and not with_fwd:
        continue  # the same forward kernels as the row with the Pallas backward
      with ctx() if ctx else contextlib.nullcontext():
        t = time.perf_counter()
        compiled = f.lower(*xs, seq).compile()
        secs = time.perf_counter() - t
      c = metrics.compiled_cost(compiled)
      rl = metrics.roofline_seconds(c["flops"], c["bytes accessed"], chip.peak_flops, chip.hbm_bandwidth)
      print(f"| {name} | {prog} | {c['flops']:.3g} | {c['bytes accessed']:.3g} | "
            f"{rl['time_s'] * 1e3:.2f} | {rl['bound']} | {secs:.0f} |", flush=True)


if __name__ == "__main__":
  main()
