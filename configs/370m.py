"""Mamba-2 370m pretraining with the released models' recipe (see base.mamba2_pretrain).

  python train.py --config configs/370m.py --workdir runs/370m
"""

from configs import base


def get_config():
  c = base.mamba2_pretrain("370m")
  return c
