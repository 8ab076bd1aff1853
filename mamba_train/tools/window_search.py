"""Choosing the SSD window (`Mamba2Config.ssd_window`) for a trained model.

For each candidate W the validation loss of the model with that window is measured
against the exact model's, with the same weights:

  * overall: every Mamba-2 layer windowed (the model `ssd_window=W` builds);
  * per layer: that one layer windowed, the others exact. The config holds one
    window for all layers (the layers are one scanned stack, and a window is part of
    the compiled program's shape), so the per-layer losses come from running the
    layers one by one here, each with its own config; they say which layers need a
    long horizon, and the overall W is what a run can use.

The smallest W whose loss is within `tolerance` (nats per token, absolute) of the
exact loss is reported. A window at least the evaluated length is the exact model,
so candidates must be shorter than seq_len to mean anything.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mamba_train.model import mamba2
from mamba_train.model.config import MAMBA, Mamba2Config
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.params import unstack
from mamba_train.model.runtime import Runtime
from mamba_train.train.loss import linear_cross_entropy
from mamba_train.train.step import loss_sums

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class WindowReport:
  tolerance: float  # nats per token
  tokens: int  # validation tokens the losses average over
  exact: float  # the exact model's loss
  overall: dict[int, float]  # W -> loss with every layer windowed
  per_layer: list[dict[int, float]]  # per Mamba-2 layer: W -> loss with it alone windowed

  def smallest(self, losses: Mapping[int, float]) -> int | None:
    """The smallest W whose loss is within the tolerance of the exact one (None: none is)."""
    ok = [w for w, loss in sorted(losses.items()) if loss - self.exact <= self.tolerance]
    return ok[0] if ok else None

  def to_dict(self) -> dict:
    return {"tolerance": self.tolerance, "tokens": self.tokens, "exact": self.exact,
            "overall": {str(w): v for w, v in self.overall.items()},
            "smallest_overall": self.smallest(self.overall),
            "per_layer": [{str(w): v for w, v in d.items()} for d in self.per_layer],
            "smallest_per_layer": [self.smallest(d) for d in self.per_layer]}

  def table(self) -> str:
    ws = sorted(self.overall)
    rows = [["", "smallest W"] + [f"W={w}" for w in ws],
            ["overall", str(self.smallest(self.overall))] + [f"{self.overall[w] - self.exact:+.4f}" for w in ws]]
    for i, d in enumerate(self.per_layer):
      rows.append([f"layer {i}", str(self.smallest(d))] + [f"{d[w] - self.exact:+.4f}" for w in ws])
    width = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [f"exact loss {self.exact:.4f} nats/token over {self.tokens} tokens; loss - exact "
             f"below; tolerance {self.tolerance}"]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, width)) for r in rows]
    return "\n".join(lines)


def check_candidates(cfg: Mamba2Config, windows: Iterable[int], seq_len: int) -> list[int]:
  """The candidates sorted, refused with the fix when a window cannot be used."""
  ws = sorted(set(int(w) for w in windows))
  if not ws:
    raise ValueError("give at least one candidate window")
  small = [w for w in ws if w < cfg.chunk_size]
  if small:
    raise ValueError(f"windows {small} are shorter than the model's chunk_size ({cfg.chunk_size}); "
                     f"a window must be at least the chunk")
  long = [w for w in ws if w >= seq_len]
  if long:
    raise ValueError(f"windows {long} are at least seq_len ({seq_len}), where the windowed model "
                     f"is the exact one; evaluate longer sequences (seq_len) or smaller windows")
  return ws


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _overall_sums(params, batch, cfg: Mamba2Config, rt: Runtime, window: int):
  return loss_sums(params, batch, cfg.replace(ssd_window=window), rt)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _one_layer_sums(params, batch, cfg: Mamba2Config, rt: Runtime, layer: int, window: int):
  """loss_sums with Mamba-2 layer `layer` alone windowed: the layers run one by one."""
  model = Mamba2LM.from_params(cfg, params, rt)
  seq = batch["seq_idx"]
  h = model.embed(batch["input_ids"])
  for i, p in enumerate(unstack(model.layer_params(MAMBA), cfg.count(MAMBA))):
    h, _ = mamba2.block(p, h, cfg.replace(ssd_window=window) if i == layer else cfg, rt, seq_idx=seq)
  mask = batch["loss_mask"].astype(F32)
  total = linear_cross_entropy(model.final_norm(h), model.head_weight(), batch["targets"], mask,
                               cfg.vocab_size, rt.compute_dtype)
  return total, jnp.sum(mask)


def _mean(fn, batches) -> tuple[float, int]:
  total = count = 0.0
  for batch in batches:
    t, c = fn(batch)
    total, count = total + float(t), count + float(c)
  return total / count, int(count)


def search(model: Mamba2LM, batches: list[dict], windows: Iterable[int], *, tolerance: float = 0.01,
           per_layer: bool = True) -> WindowReport:
  """Losses of `model` with each candidate window over `batches` (dicts of
  input_ids, targets, seq_idx, loss_mask (b, l), as the eval loader gives them).
  Per layer only for a pure Mamba-2 model (a hybrid's layers are not one stack)."""
  cfg, rt = model.config.replace(ssd_window=0), model.runtime
  seq_len = int(np.shape(batches[0]["input_ids"])[1])
  ws = check_candidates(cfg, windows, seq_len)
  if per_layer and cfg.pattern != MAMBA * cfg.n_layer:
    raise ValueError("the per-layer search runs pure Mamba-2 models; pass per_layer=False "
                     "(--noper_layer) for a hybrid's overall window")
  params = model.params()
  batches = [jax.tree.map(jnp.asarray, {k: b[k] for k in ("input_ids", "targets", "seq_idx", "loss_mask")})
             for b in batches]
  exact, tokens = _mean(lambda b: _overall_sums(params, b, cfg, rt, 0), batches)
  overall = {w: _mean(lambda b, w=w: _overall_sums(params, b, cfg, rt, w), batches)[0] for w in ws}
  layers = []
  if per_layer:
    for i in range(cfg.count(MAMBA)):
      layers.append({w: _mean(lambda b, w=w, i=i: _one_layer_sums(params, b, cfg, rt, i, w), batches)[0]
                     for w in ws})
  return WindowReport(tolerance, tokens, exact, overall, layers)
