"""Mamba-2 1.3b pretraining with the released models' recipe (see base.mamba2_pretrain).

  python train.py --config configs/1.3b.py --workdir runs/1.3b
"""

from configs import base


def get_config():
  c = base.mamba2_pretrain("1.3b")
  # Recompute activations in the backward pass, as the counts chose per backend
  # (runtime.default_remat: the in_proj results kept on TPUs, and the fused layer's
  # output with the layers unrolled).
  c.runtime.remat = "auto"
  return c
