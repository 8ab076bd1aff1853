"""Instruction / chat finetuning of a released model: loss on assistant tokens only. Written
for a Mamba-2 130m; the run takes init_from's architecture, so any base runs as it is.

  # 1. Pack the chat data with the released models' tokenizer (GPT-NeoX; no chat template,
  #    so the built-in one is used) into rows of this config's seq_len:
  python scripts/prepare_data.py --chat --source=chats.jsonl --name=sft \
      --tokenizer=EleutherAI/gpt-neox-20b --seq_len=2048
  # 2. Finetune from a transformers or mamba_ssm directory (e.g. state-spaces/mamba2-130m):
  python train.py --config configs/sft.py --workdir runs/sft \
      --config.init_from=PATH/TO/mamba2-130m --config.data.dir=data/sft

Rows hold whole examples (seq_idx keeps them apart), so batches are in examples' rows;
the mask leaves about the assistant share of the tokens to learn from.
"""

from configs import finetune


def get_config():
  c = finetune.get_config()
  c.name = "sft-130m"
  c.steps = 1000
  c.batch_size = 32  # rows of 2048 tokens
  c.log_every, c.eval_every, c.checkpoint_every = 10, 100, 250
  # A few epochs of a small set at a low rate: 2e-5 is the usual SFT rate for models of
  # this size (Zephyr, Tulu), with 3% warmup and cosine to 10%.
  c.optim.update(lr=2e-5, warmup_frac=0.03, final_lr_frac=0.1, weight_decay=0.0)
  # With adapters (lora.rank > 0) 10x that: the alignment-handbook's QLoRA SFT rate (2e-4),
  # at the top of peft's and TRL's examples' 1e-4 to 2e-4.
  c.lora.lr = 2e-4
  c.data.dir = ""  # set on the command line: a dataset from prepare_data.py --chat
  return c
