"""Finetune NVIDIA's Nemotron-3-Nano-30B-A3B (Mamba-2 + attention + MoE) from its
transformers directory: experts split over the 'expert' axis, everything else
sharded over fsdp, bfloat16 matmuls, full remat.

  python train.py --config configs/nemotron3-nano.py --workdir runs/nano-ft \\
      --config.init_from=PATH/TO/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 --config.data.dir=data/my_sft
  python scripts/aot_compile.py --config configs/nemotron3-nano.py --topology v5p-128 --trip_counts
  python scripts/aot_compile.py --config configs/nemotron3-nano.py --topology v6e-256 \\
      --config.batch_size=128 --config.seq_len=2048 --config.mesh.sequence=2 \\
      --config.mesh.expert=128 --config.layout=fsdp_expert --trip_counts
  python scripts/aot_compile.py --config configs/nemotron3-nano.py --topology v5p-64 --trip_counts
  python scripts/aot_compile.py --config configs/nemotron3-nano.py --topology v6e-64 \\
      --config.batch_size=128 --config.seq_len=2048 --trip_counts

Dispatch has a capacity (moe.capacity_factor 1.25, MaxText's and Megatron's usual
value): each expert takes at most 1.25 x an even share of a sequence's
assignments, the rest dropped and counted (moe_dropped_tokens). Dropless dispatch
(capacity_factor=0) sizes the expert all-to-all's buffers for the worst case and
did not fit either slice; at 1.25 both fit. On H100s (--config.runtime.attention=tokamax:
tokamax's flash attention, which compiles without a GPU where cuDNN's, the GPU default, does
not; =xla, the plain form, moves 6.7e10 more bytes a GPU): one 8-GPU host takes a full
finetune at 8 x 2048 in the layout
config.layout='auto' picks there (fsdp 1, expert 8: 'fsdp_expert', the non-expert
weights, their gradients and moments split over the 8 GPUs of the expert group as well,
ZeRO-3; with 'fsdp' they are whole on every GPU and the state alone is 65.7 GiB), and
LoRA (--config.lora.rank=16: the frozen experts held in bf16). On GPUs unroll the layers
(--config.runtime.unroll_layers=True): the scanned hybrid moves more bytes and memory
there; unrolled, --config.runtime.remat=save_moe keeps the MoE layers' expert rows across
remat (2 GiB more a GPU; no dispatch or expert kernel rerun in the backward). The TPU
slices keep the scan, and a full finetune fits each at the recipe's tokens a step
(megablox experts); v5p and v6e-64 keep 'fsdp' (fsdp 4 to 16). v6e-256 at 128 x 2048
(1,024 tokens a chip) takes one expert a chip, expert 128 x sequence 2 with the non-expert
weights over all 128 of the group ('fsdp_expert'): no expert weight is gathered, and it
moves fewer bytes and holds less a chip than fsdp 16 x expert 8 (docs/bench/moe.md).
What each target counts and holds a chip: the README's performance table and
docs/bench/moe.md.

  python scripts/aot_compile.py --config configs/nemotron3-nano.py --topology h100-8 \
      --config.batch_size=8 --config.seq_len=2048 --config.runtime.attention=tokamax \
      --config.runtime.unroll_layers=True --config.runtime.remat=save_moe

The router keeps NemotronH's
balancing in finetuning: the correction bias moves at 1e-3 a step and a 1e-4
auxiliary loss (config.moe; 0 turns either off).
"""

from configs import base
from mamba_train import config_for


def get_config():
  c = base.get_config()
  c.name = "nemotron3-nano-ft"
  c.model.update(config_for("nemotron3-nano").to_dict())
  # 64 x 4096 = 262k tokens a step, one 4096-token row a v5p chip (docs/bench/moe.md).
  c.seq_len = 4096
  c.batch_size = 64
  c.optim.grad_accum = 1
  c.moe.capacity_factor = 1.25
  c.steps = 2000
  c.log_every, c.eval_every, c.checkpoint_every = 10, 200, 500
  c.optim.update(lr=1e-5, warmup_frac=0.05, final_lr_frac=0.1, weight_decay=0.1)
  c.runtime.compute_dtype = "bfloat16"
  c.runtime.remat = "full"
  c.data.source = "corpus"
  # 128 experts over 8 devices (16 each); fsdp fills the rest of the slice.
  c.mesh.update(data=1, fsdp=-1, expert=8, tensor=1)
  c.init_from = ""  # set on the command line: the transformers directory
  return c
