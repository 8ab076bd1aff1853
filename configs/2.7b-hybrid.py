"""A Mamba-2-Hybrid at 2.7b: the pure model's width and depth with one attention
layer in eight ('MMMM*MMM' repeated; NVIDIA's hybrid used about 8%), no MLPs,
on the Mamba-2 recipe (see base.mamba2_pretrain).

  python train.py --config configs/2.7b-hybrid.py --workdir runs/2.7b-hybrid
  python scripts/aot_compile.py --config configs/2.7b-hybrid.py --topology v6e:2x2
"""

from configs import base


def get_config():
  c = base.mamba2_pretrain("2.7b-hybrid")
  c.runtime.remat = "full"  # recompute activations in the backward pass: memory before speed
  return c
