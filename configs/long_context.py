"""Continued pretraining of a released Mamba-2 at long context (32k-128k tokens),
each sequence split over devices by the `sequence` mesh axis.

Starts from the released weights (transformers or mamba_ssm directory) and trains
on a corpus at 32,768 tokens per sequence with 0.5M tokens per step, a tenth of
the pretraining peak learning rate, full remat and bfloat16 matmuls.

  python train.py --config configs/long_context.py --workdir runs/1.3b-32k \
      --config.init_from=PATH/TO/mamba2-1.3b --config.data.dir=data/long_docs

The override set for the other lengths and sizes (the per-chip memory of each is
in docs/bench/sequence.md; check a slice first with
`python scripts/aot_compile.py --config configs/long_context.py --topology v5p-32`):

  64k:  --config.seq_len=65536  --config.batch_size=8 --config.mesh.sequence=8
  128k: --config.seq_len=131072 --config.batch_size=4 --config.mesh.sequence=16
  2.7b: --config.model.d_model=2560 --config.model.n_layer=64 --config.optim.lr=8e-5

batch_size must divide over data x fsdp (the devices the sequence axis leaves):
on N devices with sequence = s, fsdp = N / s.
"""

from configs import base


def get_config():
  c = base.mamba2_pretrain("1.3b")
  c.name = "long-context-1.3b"
  c.seq_len = 32_768
  c.batch_size = 16  # x 32,768 = 0.5M tokens per step, as in pretraining
  c.steps = 4_000  # 2B tokens
  c.log_every, c.eval_every, c.checkpoint_every = 10, 500, 500
  c.runtime.remat = "full"  # activations grow with the length; recompute them
  c.optim.update(lr=base.MAMBA2_LR["1.3b"] / 10, warmup_frac=0.02, final_lr_frac=0.1)
  c.mesh.update(data=1, fsdp=-1, sequence=4, tensor=1)
  c.init_from = ""  # set on the command line: the released model's directory
  return c
