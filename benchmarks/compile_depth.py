"""Compile time against depth for an irregular hybrid: the tiny-width MoE hybrid
with Nemotron-3-Nano's pattern (its first n_layer layers), its train step (full
remat, as the Nano recipe) compiled under both schedules of `model/pattern.py`:
'runs' (one scan per run of one kind: a body per change of kind) and 'steps'
(one scan of steps: a body per kind). Compile only; CPU seconds (the process's,
all threads), as the host is shared. Results: docs/bench/compile_depth.md.

  python -m benchmarks.compile_depth [--depths 8 16 32 52] [--remat full]
"""

from __future__ import annotations

import argparse
import functools
import json
from unittest import mock

import jax

from benchmarks.common import compile_fn, log
from mamba_train.model import pattern as pattern_lib
from mamba_train.model.config import SIZES, config_for
from mamba_train.model.runtime import Runtime
from mamba_train.parallel.mesh import make_mesh
from mamba_train.train import balance, optim, state as train_state, step as trainer

NANO = SIZES["nemotron3-nano"]["layer_pattern"]


def tiny_nano(n_layer: int):
  """Nano's architecture at tiny width, its pattern's first n_layer layers."""
  return config_for("nemotron3-nano", d_model=64, n_layer=n_layer, layer_pattern=NANO[:n_layer],
                    vocab_size=256, d_state=16, headdim=16, mamba_num_heads=8, ngroups=2, chunk_size=16,
                    attn_num_heads=4, attn_num_heads_kv=2, attn_head_dim=16, n_routed_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)


def compile_step(cfg, rt, schedule: str, batch: int, seq_len: int) -> dict:
  ocfg = dict(lr=1e-3, schedule="constant", warmup_frac=0.0, decay_frac=0.0, final_lr_frac=0.1, b1=0.9,
              b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0, state_dtype="float32")
  tx, sched = optim.make_optimizer(ocfg, 10)
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  with mock.patch.object(pattern_lib, "plan", functools.partial(pattern_lib.plan, schedule=schedule)):
    step = trainer.make_train_step(cfg, rt, tx, sched, mesh, moe=balance.MoeSpec(1e-4, 1e-3))
    state = train_state.abstract_train_state(cfg, tx, mesh)
    _, info = compile_fn(step, state, trainer.abstract_batch(batch, seq_len, mesh))
  return info


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 52])
  ap.add_argument("--remat", default="full")
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seq_len", type=int, default=64)
  ap.add_argument("--out", default="")
  args = ap.parse_args()
  rt = Runtime(remat=args.remat).resolve("cpu")
  rows = []
  for n in args.depths:
    cfg = tiny_nano(n)
    for schedule in ("runs", "steps"):
      pl = pattern_lib.plan(cfg.pattern, schedule)
      bodies = len(set(cfg.pattern)) if pl.steps else len(pl.runs)
      info = compile_step(cfg, rt, schedule, args.batch, args.seq_len)
      rows.append({"n_layer": n, "schedule": schedule, "bodies": bodies, "remat": args.remat, **info})
      log(f"n_layer {n:2d} {schedule:5s} ({bodies:2d} bodies): {info['compile_cpu_s']:.1f} s cpu, "
          f"{info['compile_s']:.1f} s wall, temp {info.get('temp_bytes', 0) / 2**20:.2f} MiB")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
