"""LoRA's two paths without dropout, side by side: merged into each layer's weight
(W + scale A B, the weight gradient formed per layer) against separate
(x W + scale x A B beside it), on the same model, batch and adapters. Reports the
compiled train step's XLA memory (scratch), FLOPs and bytes (the layer scan's body
counted once, as XLA counts it: the ratio is what the comparison reads), and the
median step time.

  python -m benchmarks.lora_path --config tiny --batch 8 --seq_len 256
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np

from benchmarks.common import log, median_time
from mamba_train.model import lora as lora_lib
from mamba_train.model.config import config_for
from mamba_train.model.lm import Mamba2LM
from mamba_train.model.params import weight_names
from mamba_train.model.runtime import Runtime
from mamba_train.train import step as steps


@dataclasses.dataclass(frozen=True)
class Separate(lora_lib.LoraSpec):
  """The spec with the separate path forced at dropout 0 (no masks: no key is given)."""

  @property
  def separate(self) -> bool:
    return True


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default="tiny")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq_len", type=int, default=256)
  ap.add_argument("--rank", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=5)
  a = ap.parse_args()
  cfg = config_for(a.config, vocab_size=257)
  rt = Runtime().resolve()
  base = Mamba2LM(cfg, rngs=__import__("flax").nnx.Rngs(0)).params()
  spec = lora_lib.make_spec(a.rank, 2.0 * a.rank, 0.0, lora_lib.DEFAULT_TARGETS, "", weight_names(cfg))
  ad = lora_lib.init_adapters(base, spec, jax.random.PRNGKey(0))
  ad = jax.tree.map(lambda x: x + 0.01, ad)
  rng = np.random.RandomState(0)
  ids = rng.randint(0, cfg.vocab_size, (a.batch, a.seq_len + 1)).astype(np.int32)
  batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:], "seq_idx": np.zeros((a.batch, a.seq_len), np.int32),
           "loss_mask": np.ones((a.batch, a.seq_len), np.float32)}
  rows = {}
  for name, s in (("merged", spec), ("separate", Separate(**dataclasses.asdict(spec)))):
    f = jax.jit(lambda ad, base, batch, s=s: jax.value_and_grad(
        lambda p: steps.loss_sums(p, batch, cfg, rt, frozen=base, lora=s)[0])(ad))
    c = f.lower(ad, base, batch).compile()
    mem, cost = c.memory_analysis(), c.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    t = median_time(lambda: c(ad, base, batch), a.repeats)
    rows[name] = (mem.temp_size_in_bytes, cost["flops"], cost["bytes accessed"], t)
    log(f"{name}: scratch {mem.temp_size_in_bytes / 2**20:.1f} MiB, {cost['flops']:.3e} FLOPs, "
        f"{cost['bytes accessed']:.3e} bytes, step {t * 1e3:.1f} ms")
  m, s = rows["merged"], rows["separate"]
  log("separate / merged: " + ", ".join(f"{k} {b / a_:.2f}" for k, a_, b in
                                          zip(("scratch", "FLOPs", "bytes", "time"), m, s)))


if __name__ == "__main__":
  main()
