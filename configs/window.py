"""Finetune a pretrained Mamba-2 130m into the windowed model (`ssd_window`), at a
context longer than the window, where the window bounds what each position reads.

Choose the window first with the trained model and held-out data (the smallest W
whose loss stays within a tolerance of the exact model's), then finetune with it:

  python scripts/window_search.py --model=PATH/TO/mamba2-130m --data=data/my_corpus \
      --seq_len=4096 --min_window=512 --max_window=2048 --window_step=256
  python train.py --config configs/window.py --workdir runs/window-130m \
      --config.init_from=PATH/TO/mamba2-130m --config.data.dir=data/my_corpus \
      --config.model.ssd_window=1024

A windowed model serves only with mamba_train (transformers and mamba_ssm have no
window: exports are refused). Its decoding cache holds W positions per layer.
"""

from configs import base


def get_config():
  c = base.mamba2_pretrain("130m")
  c.name = "window-130m"
  c.model.ssd_window = 1024  # the search's answer for your model and data
  c.seq_len = 4096
  c.batch_size = 16  # x 4096 = 64k tokens per step
  c.steps = 2000
  c.log_every, c.eval_every, c.checkpoint_every = 10, 200, 500
  c.optim.update(lr=1e-4, warmup_frac=0.05, final_lr_frac=0.1)
  c.init_from = ""  # set on the command line: the exact model the window is learned from
  return c
