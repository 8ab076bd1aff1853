"""Mixture of experts against the same dense hybrid: train-step tokens/s and MFU
(active parameters only) on this CPU (not a test).

  python -m benchmarks.moe

Two hybrids of the same pattern, width and depth: 'MEM*ME' with 'E' layers of
--experts squared-ReLU experts (top --top_k, one shared expert), and 'M-M*M-'
whose MLPs have the hidden units a token meets in an 'E' layer (top_k experts plus
the shared one), so both do the same matmul FLOPs per token
(`metrics.train_flops_per_token`, which counts the MoE layers' active experts
only). The MoE step's extra cost is the router, the sort and the scatter of the
dropless dispatch, against the dense MLP's plain matmuls. Medians after warm-up;
compile time apart. Prints a markdown table (docs/bench/moe.md keeps the dated results).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from benchmarks.common import compile_fn, log, median_time
from mamba_train import Mamba2Config, Runtime, metrics
from mamba_train.data import SyntheticLoader
from mamba_train.parallel.mesh import make_mesh
from mamba_train.train import balance, optim, state as train_state, step as trainer


def configs(experts: int, top_k: int, f: int) -> dict[str, Mamba2Config]:
  base = dict(d_model=256, n_layer=6, d_state=64, headdim=32, chunk_size=64, vocab_size=512,
              attn_num_heads=4, attn_num_heads_kv=2, attn_head_dim=64)
  moe = Mamba2Config(**base, layer_pattern="MEM*ME", n_routed_experts=experts, num_experts_per_tok=top_k,
                     moe_intermediate_size=f, moe_shared_expert_intermediate_size=f)
  dense = Mamba2Config(**base, layer_pattern="M-M*M-", d_intermediate=(top_k + 1) * f)
  return {"moe": moe, "dense": dense}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--experts", type=int, default=16)
  ap.add_argument("--top_k", type=int, default=2)
  ap.add_argument("--f", type=int, default=256)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq_len", type=int, default=256)
  ap.add_argument("--repeats", type=int, default=5)
  a = ap.parse_args()
  rt = Runtime().resolve("cpu")
  ocfg = dict(lr=1e-3, schedule="constant", warmup_frac=0.0, decay_frac=0.0, final_lr_frac=0.1,
              b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0, state_dtype="float32")
  tx, schedule = optim.make_optimizer(ocfg, 100)
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  peak = metrics.peak_flops_per_device(jax.devices()[0])
  rows = []
  for name, cfg in configs(a.experts, a.top_k, a.f).items():
    state = train_state.init_train_state(cfg, tx, mesh, seed=0)
    n = sum(x.size for x in jax.tree.leaves(state.params))
    step = trainer.make_train_step(cfg, rt, tx, schedule, mesh, moe=balance.MoeSpec(1e-4, 1e-3))
    batch = trainer.to_global(next(SyntheticLoader(vocab_size=cfg.vocab_size, seq_len=a.seq_len,
                                                   global_batch_size=a.batch, seed=0)), mesh)
    compiled, info = compile_fn(step, state, batch)
    box = [state]

    def run():
      box[0], m = compiled(box[0], batch)
      return m["loss"]

    t = median_time(run, a.repeats, warmup=2)
    tok_s = a.batch * a.seq_len / t
    flops = metrics.train_flops_per_token(cfg, rt, a.seq_len)
    rows.append({"model": name, "pattern": cfg.pattern, "params_M": n / 1e6,
                 "active_M": (n - metrics.inactive_params(cfg)) / 1e6, "train_GFLOP_tok": flops / 1e9,
                 "tokens_s": tok_s, "mfu": metrics.mfu(tok_s, flops, peak, 1), "compile_s": info["compile_s"]})
    log(rows[-1])
  ratio = rows[0]["tokens_s"] / rows[1]["tokens_s"]
  print(f"\n{a.batch} x {a.seq_len} tokens a step, {a.experts} experts top-{a.top_k}, f={a.f}; "
        f"peak {peak / 1e9:.0f} GFLOP/s (metrics' nominal CPU figure)\n")
  print("| model | pattern | params (M) | active (M) | train GFLOP/token | tokens/s | MFU | compile (s) |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['model']} | `{r['pattern']}` | {r['params_M']:.2f} | {r['active_M']:.2f} | "
          f"{r['train_GFLOP_tok']:.4f} | {r['tokens_s']:.0f} | {r['mfu']:.1%} | {r['compile_s']:.1f} |")
  print(f"\nMoE / dense tokens/s: {ratio:.2f}")
  np.testing.assert_allclose(rows[0]["train_GFLOP_tok"], rows[1]["train_GFLOP_tok"], rtol=0.05)


if __name__ == "__main__":
  main()
