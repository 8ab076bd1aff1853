"""A quick smoke test of the benchmarks (`python -m benchmarks`) on tiny shapes:
it runs, times ours, measures the roofline, and writes JSON, the markdown table
and plots."""

import json

from benchmarks.__main__ import main


def test_bench_smoke(tmp_path):
  out = tmp_path / "bench"
  common = ["--repeats", "1", "--out", str(out), "--roofline_n", "256", "--roofline_mib", "8"]
  res = main(["ssd", "--batch", "1", "--seq_len", "96", "--chunks", "32", *common])
  ssd = {(r["impl"], r["mode"]) for r in res["rows"]}
  assert {("ours", "fwd"), ("ours", "fwd+bwd"), ("sequential", "fwd")} <= ssd
  res = main(["train", "--config", "tiny", "--batch", "2", "--seq_len", "64", "--plots", *common])
  (row,) = [r for r in res["rows"] if r["bench"] == "train"]
  # MFU is only positive here: the smoke test's 256x256 roofline matmul (and the
  # suite's fast-compile XLA flags) make the measured peak too rough to bound it.
  assert row["tokens_per_s"] > 0 and row["mfu"] > 0 and row["compile_s"] > 0
  assert res["roofline"]["matmul_flops"] > 0 and res["roofline"]["copy_bytes_per_s"] > 0
  saved = json.loads((out / "results.json").read_text())
  assert saved["rows"][0]["bench"] == "train"
  md = (out / "results.md").read_text()
  assert "## Train step" in md and "| ours |" in md.replace("| tiny | ours |", "| ours |")
  assert (out / "train_tiny.png").stat().st_size > 0
  assert res["roofline"]["matvec_bytes_per_s"] > 0


def test_compiled_module_counts():
  """`benchmarks.decode`'s counts over a compiled module's text: an elementwise op
  moves its input and output once; a loop's body counts once per trip."""
  import jax
  import jax.numpy as jnp

  from benchmarks.decode import executed_kernels, hbm_bytes
  x = jax.ShapeDtypeStruct((1000,), jnp.float32)
  text = jax.jit(lambda a: jnp.sin(a) * 2.0).lower(x).compile().as_text()
  assert hbm_bytes(text) == 2 * 4000
  assert executed_kernels(text)["fusions"] + executed_kernels(text)["other"] >= 1

  def looped(n):
    f = lambda a: jax.lax.fori_loop(0, n, lambda i, c: jnp.sin(c) * c + i, a)
    k = executed_kernels(jax.jit(f).lower(x).compile().as_text())
    return k["fusions"] + k["other"]

  c3, c5, c9 = looped(3), looped(5), looped(9)
  assert c5 > c3 and c9 - c5 == 2 * (c5 - c3)


def test_hlo_op_bytes():
  """`tools/hlo.py`, the one HLO reader of the AOT report and the byte benchmarks
  (`layer_bytes`, `gpu_bytes`): an op's bytes are its result's plus its operands',
  a fusion's body and the ops that move nothing (parameters, tuples) are not
  counted, and element sizes follow the type's bits."""
  import jax
  import jax.numpy as jnp

  from mamba_train.tools import hlo
  x = jax.ShapeDtypeStruct((1000,), jnp.float32)
  text = jax.jit(lambda a: jnp.sin(a) * 2.0).lower(x).compile().as_text()
  ((b, _, kind, result),) = hlo.top_ops(text, 5)
  assert (b, kind, result) == (8000, "fusion", "f32[1000]")
  assert [e for e, _ in hlo.shapes("(bf16[2], pred[3], f8e4m3fn[4], s64[], c64[1], s4[8])")] == [2, 1, 1, 8, 8, 1]
  assert hlo.shape_bytes("(f32[2,3]{1,0}, s32[])") == 28
  text = "\n".join([
      "%fused_computation (p: f32[4]) -> f32[4] {",
      "  %p = f32[4]{0} parameter(0)",
      "  ROOT %e = f32[4]{0} exponential(%p)",
      "}",
      "ENTRY %main (a: f32[4], b: bf16[8]) -> (f32[4], f32[8]) {",
      "  %a = f32[4]{0} parameter(0)",
      "  %b = bf16[8]{0} parameter(1)",
      "  %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation",
      "  %c = f32[8]{0} convert(%b)",
      "  ROOT %t = (f32[4]{0}, f32[8]{0}) tuple(%f, %c)",
      "}"])
  assert [(op.name, op.kind, op.bytes) for op in hlo.ops(text)] == [("f", "fusion", 32), ("c", "convert", 48)]
  # A fusion nested in a fusion (XLA:TPU's `%copy_fusion` inside a GEMM's fusion): its
  # body is the outer fusion's too, whatever the computation's name.
  nested = text.replace("  ROOT %e = f32[4]{0} exponential(%p)",
                        "  ROOT %e = f32[4]{0} fusion(%p), kind=kLoop, calls=%copy_fusion")
  nested = "\n".join(["%copy_fusion (q: f32[4]) -> f32[4] {", "  %q = f32[4]{0:T(8)} parameter(0)",
                      "  ROOT %k = f32[4]{0:T(16)} copy(%q)", "}", nested])
  assert [(op.name, op.kind, op.bytes) for op in hlo.ops(nested)] == [("f", "fusion", 32), ("c", "convert", 48)]
