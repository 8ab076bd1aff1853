"""How a layer pattern ('MMM*MMM-' ...) runs as scans, so that compile time
stays flat in depth.

Each layer kind keeps its own parameters stacked over its layers (leading axis:
that kind's count). The pattern's shortest period P (the pattern is P repeated
n / P times) is one scan body, run n / P times with `lax.scan`; inside the body
the period is cut into runs of one kind ('MMM', '*', 'MMM', '-'), and each run of
two or more layers is itself a scan over that kind's slice. XLA therefore
compiles one copy of each run in the period, whatever the depth:

  'M' * 48            period 'M': one scan of 48 (the pure Mamba-2 model, as before)
  'MMMM*MMM' * 6      period of 8 -> runs M4, *, M3: three bodies, scanned 6 times
  'M-M-M*-M-' ...     Nemotron-H style: one body per run of the period

An irregular pattern (no repeat: its period is the whole pattern, such as
Nemotron-3-Nano's 'MEMEM*EMEMEM*...') would compile one body per change of kind,
dozens, growing with depth. It runs instead as one scan over "steps": a fixed
order of its kinds (say 'M*E'), each step running each kind at most once, in
that order, a kind absent from a step skipped by `lax.cond`. Each kind's
parameters and states are gathered into one slot per step (a skipped slot
repeats a neighbour, never read). XLA compiles one body per kind, whatever the
pattern and its depth:

  'MEMEM*EMEM...'     order 'M*E': steps ME, ME, M*E, ME, ... (one body a kind)

The order is the one with the fewest steps (each step's slots cost the
gathered copy and the saved residuals of every kind, taken or skipped). A
periodic pattern keeps the runs above: they are already flat in depth and
skip nothing.

States (a Mamba-2 layer's recurrent state, an attention layer's keys and
values) follow the same layout as the parameters: per kind, stacked over that
kind's layers in pattern order.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

# The name scope of a step's `lax.cond` (see `_run_steps`).
TAKEN_SCOPE = "taken_{taken}_of_{of}"


@dataclasses.dataclass(frozen=True)
class Run:
  kind: str  # the layer kind's character
  start: int  # index of its first layer among this kind's layers in one period
  length: int


@dataclasses.dataclass(frozen=True)
class Steps:
  """An irregular pattern as one scan of steps, each running each kind of
  `order` at most once (see the module docstring)."""
  order: str  # the kinds in the order a step runs them
  taken: dict  # kind -> (n_steps,) bool: whether that step runs the kind
  slot: dict  # kind -> (n_steps,) int: which of the kind's layers the step runs (clamped where skipped)
  step_of: dict  # kind -> (count,) int: the step that runs each of the kind's layers

  @property
  def n_steps(self) -> int:
    return len(next(iter(self.taken.values())))


def _steps(pattern: str, order: str) -> list[str]:
  """The pattern cut greedily into steps, each a subsequence of `order` (greedy
  is shortest: a layer joins the current step whenever its kind comes later in
  `order` than the step's last)."""
  steps = []
  for c in pattern:
    if steps and order.index(c) > order.index(steps[-1][-1]):
      steps[-1] += c
    else:
      steps.append(c)
  return steps


def _plan_steps(pattern: str) -> Steps:
  kinds = sorted(set(pattern))
  order = min(("".join(o) for o in itertools.permutations(kinds)), key=lambda o: len(_steps(pattern, o)))
  steps = _steps(pattern, order)
  taken, slot, step_of = {}, {}, {}
  for k in kinds:
    t, s, of, n = [], [], [], 0
    for i, st in enumerate(steps):
      t.append(k in st)
      s.append(min(n, pattern.count(k) - 1))
      if k in st:
        of.append(i)
        n += 1
    taken[k], slot[k], step_of[k] = tuple(t), tuple(s), tuple(of)
  return Steps(order, taken, slot, step_of)


@dataclasses.dataclass(frozen=True)
class ScanPlan:
  """A pattern as scans: its period, repeated, cut into runs of one kind."""
  period: str  # the shortest repeating unit
  repeats: int  # len(pattern) / len(period)
  runs: tuple[Run, ...]  # the period cut into runs of one kind
  steps: Steps | None = None  # irregular pattern: one scan of steps instead of the runs (not unrolled)

  def per_period(self, kind: str) -> int:
    return self.period.count(kind)


def plan(pattern: str, schedule: str = "auto") -> ScanPlan:
  """schedule: 'runs' (the period's runs), 'steps' (one scan of steps, whenever
  the pattern has more than one kind), or 'auto': steps where the runs would
  compile more bodies than there are kinds and the pattern does not repeat
  (there the runs grow with depth; a repeating period is flat already)."""
  n = len(pattern)
  p = next(p for p in range(1, n + 1) if n % p == 0 and pattern == pattern[:p] * (n // p))
  period, runs, seen = pattern[:p], [], {}
  i = 0
  while i < p:
    j = i
    while j < p and period[j] == period[i]:
      j += 1
    kind = period[i]
    runs.append(Run(kind, seen.get(kind, 0), j - i))
    seen[kind] = seen.get(kind, 0) + j - i
    i = j
  kinds = set(pattern)
  if schedule not in ("auto", "runs", "steps"):
    raise ValueError(f"schedule {schedule!r}: one of 'auto', 'runs', 'steps'")
  use_steps = len(kinds) > 1 and (schedule == "steps" or (
      schedule == "auto" and n // p == 1 and len(runs) > len(kinds)))
  return ScanPlan(period, n // p, tuple(runs), _plan_steps(pattern) if use_steps else None)


def _slice(tree, start, length):
  return jax.tree.map(lambda a: a[start:start + length], tree)


def run(pl: ScanPlan, fns: dict[str, Callable], params: dict[str, Any], states: dict[str, Any], h,
        unroll: bool = False, remat: Callable | None = None):
  """Apply every layer in pattern order (every scan unrolled when `unroll`: XLA's
  cost analysis then counts each layer, not one loop body).

  fns[kind](p, h, state) -> (h, state) is one layer (state may be None for a
  stateless kind); params[kind] and states[kind] are stacked over that kind's
  layers (states[kind] may be None). Returns h and the new states, stacked
  alike (None where the kind has no state).

  remat(fn, prevent_cse) -> fn: how a layer recomputes in the backward pass
  (`jax.checkpoint` with a policy), or None. Applied here, where it is known
  whether the layer runs inside a loop: in a rolled scan the forward and backward
  passes are separate loops, so `prevent_cse=False` costs nothing and lets XLA
  optimise the body; in straight-line code (a run of one layer, an unrolled scan)
  XLA would merge the backward's recomputation with the forward's ops, keeping
  the forward's activations alive (the memory remat exists to save) and dropping
  the recompute from the counts (`tools/aot.py` counts every layer from unrolled
  programs), so there it is `prevent_cse=True`.
  """
  wrap = (lambda fn, looped: fn) if remat is None else (lambda fn, looped: remat(fn, not looped))

  def period_body(h, xs, looped):
    outs = {k: [] for k in xs}
    for r in pl.runs:
      p_k, s_k = xs[r.kind]
      p_run = _slice(p_k, r.start, r.length)
      s_run = None if s_k is None else _slice(s_k, r.start, r.length)
      fn = wrap(fns[r.kind], looped or (r.length > 1 and not unroll))
      if r.length == 1:
        h, s = fn(jax.tree.map(lambda a: a[0], p_run), h,
                  None if s_run is None else jax.tree.map(lambda a: a[0], s_run))
        s = None if s is None else jax.tree.map(lambda a: a[None], s)
      else:
        h, s = jax.lax.scan(lambda h, x, fn=fn: fn(x[0], h, x[1]), h, (p_run, s_run), unroll=unroll or 1)
      outs[r.kind].append(s)
    new = {k: (None if not v or v[0] is None else
               jax.tree.map(lambda *a: jnp.concatenate(a, 0), *v)) for k, v in outs.items()}
    return h, new

  kinds = sorted(set(pl.period))
  xs = {k: (params[k], states.get(k)) for k in kinds}
  if pl.steps is not None and not unroll:
    return _run_steps(pl.steps, {k: wrap(fns[k], True) for k in kinds}, xs, h)
  if pl.repeats == 1:
    return period_body(h, xs, looped=False)
  if len(pl.period) == 1:  # one kind throughout: a plain scan over its stack
    k = pl.period
    fn = wrap(fns[k], not unroll)
    h, s = jax.lax.scan(lambda h, x: fn(x[0], h, x[1]), h, xs[k], unroll=unroll or 1)
    return h, {k: s}
  r = pl.repeats
  fold = lambda a: a.reshape(r, a.shape[0] // r, *a.shape[1:])
  unfold = lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
  h, new = jax.lax.scan(functools.partial(period_body, looped=not unroll), h, jax.tree.map(fold, xs),
                        unroll=unroll or 1)
  return h, jax.tree.map(unfold, new)


def _run_steps(st: Steps, fns: dict[str, Callable], xs: dict[str, Any], h):
  """One scan over `st`'s steps; each kind's parameters and states gathered to one
  slot a step, its new states gathered back to one per layer."""
  def gather(tree, idx):
    idx = np.asarray(idx, np.int32)
    # A kind every step runs, in order, is its own stack: XLA keeps such a gather (and
    # its transpose, a scatter-add of the layers' gradients) as a copy of the stack.
    in_order = np.array_equal(idx, np.arange(len(idx)))
    return jax.tree.map(lambda a: a if in_order and a.shape[0] == len(idx) else jnp.take(a, idx, axis=0), tree)

  slots = {k: gather(xs[k], st.slot[k]) for k in st.order}
  taken = {k: jnp.asarray(np.asarray(st.taken[k])) for k in st.order}
  # What a skipped kind returns as its state: zeros shaped like a run's (its
  # input state when it has one, else what the layer makes: keys and values,
  # router statistics), never read once gathered back.
  one = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)
  out_shape = {k: jax.eval_shape(fns[k], one(slots[k][0]), h, one(slots[k][1]))[1] for k in st.order}

  def body(h, x):
    outs = {}
    for k in st.order:
      (p, s), t = x[k]
      if all(st.taken[k]):  # every step runs it: no cond
        h, outs[k] = fns[k](p, h, s)
        continue
      skip = lambda p, h, s, k=k: (h, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out_shape[k]))
      # The scope's name tells a count of the compiled program how many trips take
      # the layer (`tools/hlo.py`'s `branch_shares` reads it): XLA's cost analysis counts a
      # conditional at its costliest branch, as if every step ran the layer.
      with jax.named_scope(TAKEN_SCOPE.format(taken=sum(st.taken[k]), of=st.n_steps)):
        h, outs[k] = jax.lax.cond(t, fns[k], skip, p, h, s)
    return h, outs

  h, ys = jax.lax.scan(body, h, {k: (slots[k], taken[k]) for k in st.order})
  return h, {k: (None if ys[k] is None else gather(ys[k], st.step_of[k])) for k in sorted(ys)}
