"""The tiny default with Mamba-3 layers ('3333': SISO, mamba_ssm's Mamba3 defaults but
for the tiny sizes), byte level, on the default corpus; minutes on a CPU.

  python train.py --config configs/tiny-mamba3.py --workdir runs/tiny-mamba3
  python train.py --config configs/tiny-mamba3.py --config.model.is_mimo=true --config.model.mimo_rank=2
"""

from configs import tiny
from mamba_train import config_for


def get_config():
  c = tiny.get_config()
  c.name = "tiny-mamba3"
  c.model.update(config_for("tiny-mamba3", vocab_size=257).to_dict())  # bytes + EOS
  return c
