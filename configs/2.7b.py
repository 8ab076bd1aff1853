"""Mamba-2 2.7b pretraining with the released models' recipe (see base.mamba2_pretrain).

  python train.py --config configs/2.7b.py --workdir runs/2.7b
"""

from configs import base


def get_config():
  c = base.mamba2_pretrain("2.7b")
  # Recompute activations in the backward pass, as the counts chose per backend
  # (runtime.default_remat: the in_proj results kept on TPUs, and the fused layer's
  # output with the layers unrolled).
  c.runtime.remat = "auto"
  return c
