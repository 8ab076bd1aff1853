"""What a compiled program moves and computes, read from XLA's optimised HLO text:
the bytes of its typed shapes, the ops of its non-fused computations (an op's
bytes its operands' plus its result's, the rule XLA's cost analysis counts a
fusion by), and its counts: XLA's own, and the Pallas kernels' cost estimates
where XLA counts a custom call as nothing (on GPUs).

One parser for the AOT report (`tools/aot.py`) and the benchmarks that break a
program's bytes down by op (`benchmarks/layer_bytes.py`, `benchmarks/gpu_bytes.py`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterator

from jax.extend import core as jax_core

from mamba_train import metrics

# ---------------------------------------------------------------------------
# HLO text: shapes, computations, ops.

# A typed shape as HLO prints it: f32[8,128], bf16[], pred[4], f8e4m3fn[2,2], s4[16].
SHAPE = re.compile(r"\b(pred|[sufc]\d+|bf16|f8\w*)\[([0-9,]*)\]")
_BITS = re.compile(r"(\d+)")
# `%name = <result shape> <op kind>(<operands>), <attributes>`, ROOT or not.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
# Ops that move no bytes of their own (views, tuples, control flow).
MOVES_NOTHING = frozenset({"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "while", "call",
                           "conditional", "copy-done", "async-done", "after-all", "partition-id",
                           "replica-id"})
_FUSED = ("fused", "horizontally_fused", "wrapped")
_TOKEN = re.compile(r"[A-Za-z_]\w*")


def itemsize(dtype: str) -> int:
  """Bytes per element of an HLO element type (at least 1: an s4 array is counted
  as bytes, as XLA stores it unpacked by default)."""
  bits = 8 if dtype == "pred" else (16 if dtype == "bf16" else int(_BITS.search(dtype).group(1)))
  return max(1, bits // 8)


def shapes(text: str) -> list[tuple[int, tuple[int, ...]]]:
  """(bytes per element, dims) of each typed shape in a piece of HLO text."""
  return [(itemsize(dtype), tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims in SHAPE.findall(text)]


def shape_bytes(text: str) -> int:
  """Bytes of every typed shape in a piece of HLO text (a result's tuple: the sum)."""
  return sum(e * math.prod(d) for e, d in shapes(text))


def body_lines(hlo: str) -> Iterator[tuple[str, bool]]:
  """(line, inside a fusion's body) for each line of the module's computations but
  their headers. What a fusion body holds stays on chip; its ops are not launched."""
  fused = False
  for line in hlo.splitlines():
    if line and not line[0].isspace():  # a computation's header
      fused = line.lstrip("%").startswith(_FUSED)
      continue
    yield line, fused


@dataclasses.dataclass(frozen=True)
class Op:
  name: str
  kind: str  # "fusion", "custom-call", "copy", ...
  bytes: int  # its result's plus its operands' sizes (an upper bound where it reads a slice)
  result: str  # the result's typed shapes: "f32[8,128] s32[]"
  line: str


def ops(hlo: str) -> Iterator[Op]:
  """The ops of every non-fused computation that move bytes of their own, in order."""
  sizes = {}
  for line, fused in body_lines(hlo):
    m = INSTRUCTION.match(line)
    if not m:
      continue
    name, shape, kind, rest = m.groups()
    res = shape_bytes(shape)
    sizes[name] = res
    if fused or kind in MOVES_NOTHING:
      continue
    args = rest.split("), ")[0]
    operands = sum(sizes.get(a, 0) for a in re.findall(r"%([\w.\-]+)", args))
    yield Op(name, kind, res + operands, " ".join(f"{t}[{d}]" for t, d in SHAPE.findall(shape)), line)


def top_ops(hlo: str, n: int) -> list[tuple[int, str, str, str]]:
  """[(bytes, name, kind, result shape)] of the `n` ops that move the most, largest first."""
  return sorted(((op.bytes, op.name, op.kind, op.result) for op in ops(hlo)), reverse=True)[:n]


# ---------------------------------------------------------------------------
# A compiled program's counts.

COUNTS = ("flops", "bytes accessed", "transcendentals")


def gpu_hlo_cost(compiled) -> dict[str, float]:
  """XLA's HLO cost analysis of a program compiled for GPUs, through the CPU client
  (the CUDA plugin implements no `cost_analysis()`): the optimised module's
  fusions, GEMM fusions included; custom calls (Pallas kernels) count nothing.
  A private jaxlib entry point, guarded: empty where it is missing."""
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    from jax._src.lib import _jax  # pylint: disable=import-outside-toplevel
    module = compiled.runtime_executable().hlo_modules()[0]
    c = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
  except Exception:  # noqa: BLE001 - another jaxlib: report no counts rather than fail
    return {}
  return {k: float(c[k]) for k in COUNTS if k in c}


def xla_cost(compiled, platform: str) -> dict[str, float]:
  """XLA's counts of a compiled program: its own analysis, or `gpu_hlo_cost` on GPUs."""
  return gpu_hlo_cost(compiled) if platform == "gpu" else metrics.compiled_cost(compiled)


def _subjaxprs(value):
  if isinstance(value, jax_core.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jax_core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _subjaxprs(v)


def kernel_estimates(jaxpr) -> dict[str, list]:
  """{kernel name: [(result shapes, pl.CostEstimate)]} of the Pallas calls in a traced
  program (`jax.jit(f).trace(*args).jaxpr`), nested jaxprs included."""
  found: dict[str, list] = {}

  def walk(jx):
    for eqn in jx.eqns:
      if eqn.primitive.name == "pallas_call":
        est = eqn.params.get("cost_estimate")
        info = eqn.params.get("name_and_src_info")
        name = getattr(info, "name", None) or eqn.params.get("name")
        if est is not None and name:
          found.setdefault(str(name), []).append((tuple(tuple(v.aval.shape) for v in eqn.outvars), est))
        continue
      for v in eqn.params.values():
        for j in _subjaxprs(v):
          walk(j)

  walk(jaxpr.jaxpr if isinstance(jaxpr, jax_core.ClosedJaxpr) else jaxpr)
  return found


def ragged_dot_cost(line: str) -> tuple[float, float] | None:
  """(FLOPs, bytes) of one of tokamax's ragged-dot Triton kernels from its custom
  call's HLO line, which carries no cost estimate: 2 m k n for m rows (the padded
  rows, an upper bound on sum(group_sizes)) of width k into n, each expert's rows
  against its own matrix; bytes its two operands and its result once each. The
  forward and the rows' gradient are (m, k) x (g, k, n) -> (m, n); the weights'
  gradient (m, k)^T x (m, n) -> (g, k, n). None if the line is not one of them."""
  if "TritonRaggedDot" not in line:  # tokamax 0.0.12's PallasTritonRaggedDot, 0.0.17's TritonRaggedDot
    return None
  head, tail = line.split("custom-call(", 1)
  res = shapes(head)
  if "operand_layout_constraints={" not in tail or len(res) != 1:
    return None
  operands = shapes(tail.split("operand_layout_constraints={", 1)[1])[:2]  # lhs, rhs
  if len(operands) < 2 or len(operands[0][1]) != 2:
    return None
  (m, k), n = operands[0][1], res[0][1][-1]
  return 2.0 * m * k * n, float(sum(e * math.prod(d) for e, d in (res[0], *operands)))


def kernel_costs(compiled, jaxpr) -> dict[str, float]:
  """The cost estimates of the Pallas calls XLA kept in a compiled program, counted
  as XLA counts its own ops (a loop body once: `aot.every_layer_cost` scales it):
  each custom call of the optimised module matched by kernel name (and result
  shapes) to its estimate in the traced program, and tokamax's ragged dots (the GPU
  experts), which carry no estimate, by `ragged_dot_cost`. From the compiled
  module, not the jaxpr: XLA drops a recomputation a remat policy made dead (the
  forward kernel, when its output and states are saved), which the jaxpr still
  holds."""
  total = dict.fromkeys(COUNTS, 0.0)
  found = kernel_estimates(jaxpr)
  for line, fused in body_lines(compiled.as_text()):
    if fused or "custom-call(" not in line:  # fusion bodies hold no calls of ours
      continue
    ragged = ragged_dot_cost(line)
    if ragged is not None:
      total["flops"] += ragged[0]
      total["bytes accessed"] += ragged[1]
      continue
    names = [t for t in set(_TOKEN.findall(line)) if t in found]
    if not names:
      continue
    cands = found[max(names, key=len)]
    result = tuple(d for _, d in shapes(line.split("custom-call(")[0]))
    est = next((e for sh, e in cands if sh == result), cands[0][1])
    total["flops"] += est.flops
    total["bytes accessed"] += est.bytes_accessed
    total["transcendentals"] += est.transcendentals
  return total
