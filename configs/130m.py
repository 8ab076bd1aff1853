"""Mamba-2 130m pretraining with the released models' recipe (see base.mamba2_pretrain).

  python train.py --config configs/130m.py --workdir runs/130m
"""

from configs import base


def get_config():
  c = base.mamba2_pretrain("130m")
  return c
