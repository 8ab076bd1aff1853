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
import json
import math
import os
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
# The computation a fusion instruction runs: `... fusion(...), kind=kLoop, calls=%name`.
_FUSION_CALLS = re.compile(r"\sfusion\(.*?\bcalls=%([\w.\-]+)")
_TOKEN = re.compile(r"[A-Za-z_]\w*")
# The estimate a TPU Pallas (Mosaic) custom call carries: XLA:TPU counts the kernel by it.
_COST_ESTIMATE = re.compile(r'"cost_estimate":(\{[^{}]*\})')


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
  for (_, line), fused in body_lines_named(hlo):
    yield line, fused


def body_lines_named(hlo: str) -> Iterator[tuple[tuple[str | None, str], bool]]:
  """`body_lines` with each line's computation name: ((computation, line), fused).
  A fusion's body is any computation a fusion calls, whatever its name: XLA:TPU nests
  fusions in fusions (`%copy_fusion`, `%bitcast_fusion.12` inside a GEMM's fusion), and
  the ops in them are the outer fusion's, not launched (or counted) on their own."""
  called = set(_FUSION_CALLS.findall(hlo))
  fused, comp = False, None
  for line in hlo.splitlines():
    if line and not line[0].isspace():  # a computation's header
      m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)", line)
      comp = m.group(1) if m else None
      fused = comp in called or line.lstrip("%").startswith(_FUSED)
      continue
    yield (comp, line), fused


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


def _custom_call_shapes(line: str) -> tuple[list, list] | None:
  """(result shapes, operand shapes) of a custom call's HLO line, the operands read from
  its operand_layout_constraints (its operand list names them without shapes); None
  without them."""
  head, tail = line.split("custom-call(", 1)
  if "operand_layout_constraints={" not in tail:
    return None
  return shapes(head), shapes(tail.split("operand_layout_constraints={", 1)[1].split("}}, ", 1)[0])


def ragged_dot_cost(line: str) -> tuple[float, float] | None:
  """(FLOPs, bytes) of one of tokamax's ragged-dot Triton kernels from its custom
  call's HLO line, which carries no cost estimate: 2 m k n for m rows (the padded
  rows, an upper bound on sum(group_sizes)) of width k into n, each expert's rows
  against its own matrix; bytes its two operands and its result once each. The
  forward and the rows' gradient are (m, k) x (g, k, n) -> (m, n); the weights'
  gradient (m, k)^T x (m, n) -> (g, k, n). None if the line is not one of them."""
  if "TritonRaggedDot" not in line:  # tokamax 0.0.12's PallasTritonRaggedDot, 0.0.17's TritonRaggedDot
    return None
  found = _custom_call_shapes(line)
  if found is None or len(found[0]) != 1:
    return None
  res, operands = found[0], found[1][:2]  # lhs, rhs
  if len(operands) < 2 or len(operands[0][1]) != 2:
    return None
  (m, k), n = operands[0][1], res[0][1][-1]
  return 2.0 * m * k * n, float(sum(e * math.prod(d) for e, d in (res[0], *operands)))


def flash_attention_cost(line: str) -> tuple[float, float] | None:
  """(FLOPs, bytes) of one of tokamax's flash-attention Triton kernels (`ops/attention_gpu.py`)
  from its custom call's HLO line, which carries no cost estimate: bytes its operands
  (queries, keys, values, the document mask, and the backward's output, cotangent and row
  statistics) and its results once each, the floor a kernel that keeps the scores on chip
  reads (a layer's keys and values, 1 MB on the Nano recipe, are re-read by every block
  of queries, from L2); FLOPs of the causal half of the scores: the forward's two
  products 2 l s h e (4 l s h e, halved), the backward's five (recompute, dP, dV, dQ, dK)
  5 l s h e, for queries (.., l, h, e) and keys (.., s, k, e). None if the line is not one."""
  if "PallasTritonFlashAttention" not in line:
    return None
  found = _custom_call_shapes(line)
  if found is None or not found[0]:
    return None
  res, operands = found
  if len(operands) < 2 or len(operands[0][1]) < 3 or len(operands[1][1]) < 3:
    return None
  q, s = operands[0][1], operands[1][1][-3]
  per = 5.0 if "FlashAttentionVjp" in line else 2.0
  return per * math.prod(q) * s, float(sum(e * math.prod(d) for e, d in (*res, *operands)))


def _kernel_line_cost(line: str, found: dict[str, list]) -> tuple[float, float, float] | None:
  """(FLOPs, bytes, transcendentals) of one custom call's HLO line: the cost estimate a
  Mosaic (TPU) kernel carries in its backend config, else the estimate of the Pallas
  call it is (matched by kernel name, then result shapes, in `found`, from
  `kernel_estimates`), or tokamax's ragged dot's `ragged_dot_cost` and its flash
  attention's `flash_attention_cost`; None for any other line."""
  if "custom-call(" not in line:
    return None
  mosaic = _COST_ESTIMATE.search(line)
  if mosaic:
    est = json.loads(mosaic.group(1))
    return tuple(float(est.get(k, 0)) for k in ("flops", "bytes_accessed", "transcendentals"))
  ragged = ragged_dot_cost(line)
  if ragged is None:
    ragged = flash_attention_cost(line)
  if ragged is not None:
    return ragged[0], ragged[1], 0.0
  names = [t for t in set(_TOKEN.findall(line)) if t in found]
  if not names:
    return None
  cands = found[max(names, key=len)]
  result = tuple(d for _, d in shapes(line.split("custom-call(")[0]))
  est = next((e for sh, e in cands if sh == result), cands[0][1])
  return est.flops, est.bytes_accessed, est.transcendentals


def kernel_costs(compiled, jaxpr, *, trip_counts: bool = False) -> dict[str, float]:
  """The cost estimates of the Pallas calls XLA kept in a compiled program (or its
  optimised HLO text), counted as XLA counts its own ops (a loop body once:
  `aot.every_layer_cost` scales it), or with `trip_counts` each call as often as the
  loops around it run (`loop_multiplicities`, as `trip_scaled_cost` counts XLA's ops):
  each custom call of the optimised module matched by kernel name (and result
  shapes) to its estimate in the traced program, and tokamax's ragged dots (the GPU
  experts), which carry no estimate, by `ragged_dot_cost`. From the compiled
  module, not the jaxpr: XLA drops a recomputation a remat policy made dead (the
  forward kernel, when its output and states are saved), which the jaxpr still
  holds."""
  total = dict.fromkeys(COUNTS, 0.0)
  found = kernel_estimates(jaxpr)
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  times = loop_multiplicities(text) if trip_counts else {}
  for (comp, line), fused in body_lines_named(text):
    c = None if fused else _kernel_line_cost(line, found)  # fusion bodies hold no calls of ours
    if c is not None:
      n = times.get(comp, 1)
      total = {k: total[k] + n * v for k, v in zip(COUNTS, c)}
  return total


_CALLED = re.compile(r"\b(?:to_apply|calls|body|condition|branch_computations|called_computations)="
                     r"\{?([%\w.\-, ]+)\}?")


# A `lax.cond` under the name scope `model.pattern.TAKEN_SCOPE` (a hybrid's scan of
# steps skipping a layer kind) says how many of its loop's trips take the layer.
_TAKEN = re.compile(r'op_name="[^"]*/taken_(\d+)_of_(\d+)/cond"')
_BRANCHES = re.compile(r"\bbranch_computations=\{([%\w.\-, ]+)\}")


def branch_shares(line: str) -> dict[str, float] | None:
  """The share of its trips each branch of a conditional runs, for a `lax.cond` whose
  scope says how many trips take it (branch 1: JAX lowers `cond(pred, taken, skip)`
  to branches (skip, taken)); None for any other instruction."""
  taken, b = _TAKEN.search(line), _BRANCHES.search(line)
  if not (taken and b and " conditional(" in line):
    return None
  names = [n.strip().lstrip("%") for n in b.group(1).split(",")]
  n, of = int(taken.group(1)), int(taken.group(2))
  if len(names) != 2 or not 0 <= n <= of:
    return None
  return {names[0]: (of - n) / of, names[1]: n / of}


def loop_multiplicities(text: str) -> dict[str, float]:
  """How many times each non-fused computation of an optimised module runs in one run
  of its entry: a while body its loop's trip count (`_trips`) times its caller's, a
  called computation (call, conditional branch, async wrapper) its caller's, a branch
  of a conditional whose scope says how often it is taken (`branch_shares`) that share
  of its caller's. A computation reached twice takes the larger count, the bound
  `trip_scaled_cost`'s rule agrees with for the programs here (each layer body one loop)."""
  comps, entry = _computation_lines(text)
  times: dict[str, float] = {}

  def visit(name: str, n: int):
    if name not in comps or times.get(name, 0) >= n:
      return
    times[name] = n
    for line in comps[name]:
      w = _WHILE.search(line)
      if w:
        cond, body = w.groups()
        visit(body, n * _trips(line, comps.get(cond, [])))
        visit(cond, n)
        continue
      shares = branch_shares(line)
      if shares:
        for branch, share in shares.items():
          visit(branch, n * share)
        continue
      for group in _CALLED.findall(line):
        for callee in group.split(","):
          visit(callee.strip().lstrip("%"), n)

  visit(entry, 1)
  return times


# ---------------------------------------------------------------------------
# Every loop body counted as many times as it runs.
#
# XLA's cost analysis counts a while loop's body once. `trip_scaled_cost` runs the same
# analysis (through the CPU client, as `gpu_hlo_cost`) on the optimised module with each
# loop body made the entry computation in turn, and adds each body trip - 1 more times:
# every layer of a scanned model counted from the one compile, where `tools/aot.py`'s
# differencing needs two or more smaller ones (each a full backend compile of a layer).
# jaxlib parses an HloModuleProto but exposes no class to edit one; the entry's two fields
# are rewritten in the protobuf wire format below (fields of xla/service/hlo.proto).

_MODULE_ENTRY_NAME, _MODULE_COMPUTATIONS, _MODULE_ENTRY_ID = 2, 3, 6  # HloModuleProto
# What names the old entry's parameters and outputs, which a loop body's do not match:
# input_output_alias, dynamic_parameter_binding, cross_program_prefetches,
# spmd_output_sharding, spmd_parameters_shardings, buffer_donor.
_MODULE_ENTRY_ONLY = frozenset({8, 9, 10, 12, 14, 18})
_COMPUTATION_NAME, _COMPUTATION_INSTRUCTIONS, _COMPUTATION_ID = 1, 2, 5  # HloComputationProto
_INSTRUCTION_OPCODE, _INSTRUCTION_OPERANDS = 2, 36  # HloInstructionProto
_WHILE = re.compile(r"\bwhile\(.*?condition=%?([\w.\-]+).*?body=%?([\w.\-]+)")
_KNOWN_TRIPS = re.compile(r"known_trip_count\D+(\d+)")
_INT_CONSTANT = re.compile(r"[su](?:32|64)\[\]\S*\s+constant\((\d+)\)")


def _varint(b: bytes, i: int) -> tuple[int, int]:
  v = shift = 0
  while True:
    x = b[i]
    i += 1
    v |= (x & 0x7F) << shift
    shift += 7
    if x < 0x80:
      return v, i


def _encode_varint(v: int) -> bytes:
  out = bytearray()
  while True:
    x, v = v & 0x7F, v >> 7
    out.append(x | (0x80 if v else 0))
    if not v:
      return bytes(out)


def _proto_fields(b: bytes) -> Iterator[tuple[int, bytes, bytes | int]]:
  """(field number, the field's raw bytes, its value: bytes or an integer)."""
  i = 0
  while i < len(b):
    key, j = _varint(b, i)
    field, wire = key >> 3, key & 7
    if wire == 0:
      value, k = _varint(b, j)
    elif wire == 2:
      n, j = _varint(b, j)
      k = j + n
      value = b[j:k]
    elif wire in (1, 5):
      k = j + (8 if wire == 1 else 4)
      value = b[j:k]
    else:
      raise ValueError(f"unexpected protobuf wire type {wire}")
    yield field, b[i:k], value
    i = k


def _with_entry(proto: bytes, name: str, cid: int) -> bytes:
  out = bytearray()
  for field, raw, _ in _proto_fields(proto):
    if field == _MODULE_ENTRY_NAME:
      out += _encode_varint(_MODULE_ENTRY_NAME << 3 | 2) + _encode_varint(len(name.encode())) + name.encode()
    elif field == _MODULE_ENTRY_ID:
      out += _encode_varint(_MODULE_ENTRY_ID << 3) + _encode_varint(cid)
    elif field in _MODULE_ENTRY_ONLY:
      continue
    else:
      out += raw
  return bytes(out)


def _packed(value: bytes | int) -> list[int]:
  if isinstance(value, int):  # an unpacked repeated field: one value a field
    return [value]
  out, i = [], 0
  while i < len(value):
    v, i = _varint(value, i)
    out.append(v)
  return out


def _field(number: int, value: bytes) -> bytes:
  return _encode_varint(number << 3 | 2) + _encode_varint(len(value)) + value


def _one_operand_async_updates(instruction: bytes) -> bytes:
  fields = list(_proto_fields(instruction))
  if next((v for f, _, v in fields if f == _INSTRUCTION_OPCODE), b"") != b"async-update":
    return instruction
  ids = [i for f, _, v in fields if f == _INSTRUCTION_OPERANDS for i in _packed(v)]
  if len(ids) <= 1:
    return instruction
  out = [raw for f, raw, _ in fields if f != _INSTRUCTION_OPERANDS]
  return b"".join(out) + _field(_INSTRUCTION_OPERANDS, _encode_varint(ids[0]))


def _readable(proto: bytes) -> bytes:
  """The module with each `async-update` given its one operand, the async op it updates.
  XLA:TPU's multi-chip programs (v5p's and v6e's gather and scatter offloads) give
  theirs more, which jaxlib's reader refuses ("async-update instruction should have 1
  operands"); the others only order it, and the cost analysis counts an update as nothing."""
  out = bytearray()
  for field, raw, value in _proto_fields(proto):
    if field != _MODULE_COMPUTATIONS:
      out += raw
      continue
    comp = b"".join(_field(f, _one_operand_async_updates(v)) if f == _COMPUTATION_INSTRUCTIONS else r
                    for f, r, v in _proto_fields(value))
    out += _field(_MODULE_COMPUTATIONS, comp)
  return bytes(out)


def _computation_ids(proto: bytes) -> dict[str, int]:
  ids = {}
  for field, _, value in _proto_fields(proto):
    if field == _MODULE_COMPUTATIONS:
      parts = {f: v for f, _, v in _proto_fields(value) if f in (_COMPUTATION_NAME, _COMPUTATION_ID)}
      ids[parts[_COMPUTATION_NAME].decode()] = parts[_COMPUTATION_ID]
  return ids


def _computation_lines(text: str) -> tuple[dict[str, list[str]], str]:
  """name -> its instruction lines, and the entry computation's name."""
  comps, entry, cur = {}, None, None
  for line in text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)", line)
      if m:
        cur = m.group(2)
        comps[cur] = []
        entry = cur if m.group(1) else entry
        continue
    if cur is not None:
      comps[cur].append(line)
  return comps, entry


def _trips(line: str, condition: list[str]) -> int:
  """A while loop's trip count: XLA's `known_trip_count` where it kept it, else the bound
  of a loop condition (counter < N from 0: its one integer constant; s32 for a scan, u32
  for XLA:TPU's windowed einsums)."""
  known = _KNOWN_TRIPS.search(line)
  if known:
    return int(known.group(1))
  bounds = {int(c) for l in condition for c in _INT_CONSTANT.findall(l)}
  if len(bounds) != 1:
    raise ValueError(f"cannot read a trip count from a loop condition with constants {sorted(bounds)}")
  return bounds.pop()


def dumped_module_proto(dump_dir: str) -> bytes:
  """The HloModuleProto of the optimised module XLA dumped last into `dump_dir` (the
  compile option `xla_dump_to` with `xla_dump_hlo_as_proto`).
  XLA:TPU's multi-chip programs cannot be read from the executable: jaxlib reads its
  module back and refuses their SparseCore offloads' `async-update`s (more than one
  operand), where the dumped protobuf reads once `_readable` has rewritten them."""
  paths = [os.path.join(dump_dir, n) for n in os.listdir(dump_dir) if n.endswith(".after_optimizations.hlo.pb")]
  if not paths:
    raise ValueError(f"no optimised module in {dump_dir}")
  with open(max(paths, key=os.path.getmtime), "rb") as f:  # a folder kept across runs: the latest
    hlo_proto = f.read()
  return next(v for field, _, v in _proto_fields(hlo_proto) if field == 1)  # HloProto.hlo_module


def optimised_text(compiled, proto: bytes | None = None) -> str:
  """The optimised module's HLO text: from `proto` (`dumped_module_proto`) where the
  executable's module cannot be read back (XLA:TPU's multi-chip programs), else the
  compiled program's own."""
  if proto is None:
    return compiled.as_text()
  from jax._src.lib import xla_client  # pylint: disable=import-outside-toplevel
  return xla_client.hlo.HloModule.from_serialized_hlo_module_proto(_readable(proto)).to_string()


def trip_scaled_cost(compiled, proto: bytes | None = None) -> dict:
  """XLA's FLOP and byte counts of a compiled program with every while-loop body (nested
  ones too) counted trip-count times: {"flops", "bytes accessed", "transcendentals",
  "once": the same analysis with each body once, "loops": [(body, trips)]}. XLA's HLO
  cost analysis through the CPU client on the optimised module (private jaxlib entry
  points, as `gpu_hlo_cost`); on TPUs its bytes follow the CPU's rules, not XLA:TPU's own.
  Loops of the entry computation and of loop bodies are scaled (a scanned model's layers,
  forward and backward); one inside a `call` or `conditional` branch is counted once. A
  `conditional` counts its costliest branch each trip (XLA's rule), but one whose scope
  says how many trips take it (`branch_shares`: a hybrid's layer scan skipping a kind)
  counts each branch in its share of the trips. The analysis counts a custom call (a Pallas kernel) as nothing,
  on TPUs too: `kernel_costs(..., trip_counts=True)` counts those. `proto`: the module's
  HloModuleProto where the executable's cannot be read back (`dumped_module_proto`)."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  from jax._src.lib import _jax, xla_client  # pylint: disable=import-outside-toplevel
  if proto is None:
    proto = compiled.runtime_executable().hlo_modules()[0].as_serialized_hlo_module_proto()
  proto = _readable(proto)
  ids = _computation_ids(proto)
  comps, entry = _computation_lines(xla_client.hlo.HloModule.from_serialized_hlo_module_proto(proto).to_string())
  cpu = xla_bridge.get_backend("cpu")
  once_cache, total_cache, loops = {}, {}, []

  def once(name):
    if name not in once_cache:
      sub = xla_client.hlo.HloModule.from_serialized_hlo_module_proto(_with_entry(proto, name, ids[name]))
      c = _jax.hlo_module_cost_analysis(cpu, sub)
      once_cache[name] = {k: float(c.get(k, 0.0)) for k in COUNTS}
    return once_cache[name]

  def total(name):
    if name not in total_cache:
      t = dict(once(name))
      for line in comps[name]:
        w = _WHILE.search(line)
        if w:
          cond, body = w.groups()
          n = _trips(line, comps[cond])
          loops.append((body, n))
          # The analysis counted the body once (its own loops' bodies once too): the rest.
          t = {k: t[k] + n * total(body)[k] - once(body)[k] for k in t}
          continue
        shares = branch_shares(line)
        if shares:  # XLA counted the costliest branch (each count apart): each its share
          costs = [once(b) for b in shares]
          t = {k: t[k] + sum(s * c[k] for s, c in zip(shares.values(), costs)) - max(c[k] for c in costs)
               for k in t}
      total_cache[name] = t
    return total_cache[name]

  return {**total(entry), "once": once(entry), "loops": loops}
