"""Mamba-2 780m pretraining with the released models' recipe (see base.mamba2_pretrain).

  python train.py --config configs/780m.py --workdir runs/780m
"""

from configs import base


def get_config():
  c = base.mamba2_pretrain("780m")
  c.runtime.remat = "full"  # recompute activations in the backward pass: memory before speed
  return c
