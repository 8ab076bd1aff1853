"""The default run: a 4-layer, d_model 256 Mamba-2 that trains in a few minutes on a CPU.

  python train.py                      # this config, into runs/tiny-<time>
  python train.py --config configs/tiny.py --workdir runs/tiny --config.steps=200
"""

from configs import base
from mamba_train.config import config_for


def get_config():
  c = base.get_config()
  c.name = "tiny"
  c.steps = 100
  c.batch_size = 8
  c.seq_len = 256
  c.log_every = 10
  c.eval_every = 50
  c.eval_batches = 2
  c.model.update(config_for("tiny").to_dict())
  c.optim.lr = 3e-3
  return c
