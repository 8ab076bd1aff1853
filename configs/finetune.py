"""Finetune a pretrained Mamba-2 on a corpus: lower, shorter learning rate. Written for a
130m; the run takes init_from's architecture, so any base runs as it is.

  python train.py --config configs/finetune.py --workdir runs/ft \
      --config.init_from=PATH/TO/mamba2-130m --config.data.dir=data/my_corpus
"""

from configs import base


def get_config():
  c = base.mamba2_pretrain("130m")
  c.name = "finetune-130m"
  c.steps = 2000
  c.batch_size = 32
  c.log_every, c.eval_every, c.checkpoint_every = 10, 200, 500
  c.optim.update(lr=1e-4, warmup_frac=0.05, final_lr_frac=0.1)
  c.init_from = ""  # set on the command line: a pretrained checkpoint directory
  return c
