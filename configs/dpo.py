"""Preference tuning (DPO) of an SFT'd model: the policy starts from the SFT run and learns to
prefer the chosen response of each pair over the rejected one, against the SFT weights
frozen as the reference. Written for a 130m; the run takes init_from's architecture, so
any base runs as it is.

  # 1. Pack the pairs with the SFT run's tokenizer and chat template, one pair a row of seq_len:
  python scripts/prepare_data.py --preference --source='prefs/*.jsonl' --name=prefs \
      --tokenizer=EleutherAI/gpt-neox-20b --seq_len=2048
  # 2. DPO from the SFT run (a workdir, or a transformers / mamba_ssm directory):
  python train.py --config configs/dpo.py --workdir runs/dpo \
      --config.init_from=runs/sft --config.data.dir=data/prefs
  # With LoRA (the reference is then the base with the adapters off: no second copy), at the
  # adapters' rate lora.lr (5e-5; --config.lora.lr to change it):
  python train.py --config configs/dpo.py --workdir runs/dpo-lora \
      --config.init_from=runs/sft --config.data.dir=data/prefs --config.lora.rank=16

metrics.jsonl rows carry the DPO loss as `loss`, and rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracies, logps/chosen and logps/rejected (means over pairs).
A row holds a pair (prompt + chosen, then prompt + rejected), so batch_size counts pairs.
"""

from configs import sft


def get_config():
  c = sft.get_config()
  c.name = "dpo-130m"
  c.objective = "dpo"
  c.steps = 500
  c.batch_size = 32  # pairs
  c.log_every, c.eval_every, c.checkpoint_every = 10, 100, 250
  # Zephyr's DPO recipe: beta 0.1, a rate of 5e-7 for a full finetune, 10% warmup, then
  # linear decay; no weight decay. Adapters take ~100x that (lora.lr, with lora.rank > 0): from
  # a tiny base (configs/tiny.py, 60 steps), rank 4, 8 pairs a step, the loss at step 40 was
  # 0.4936 at 5e-5 and 0.6906 at 5e-7 (log 2 = 0.6931).
  c.dpo.update(beta=0.1, label_smoothing=0.0)
  c.optim.update(lr=5e-7, schedule="wsd", warmup_frac=0.1, decay_frac=0.9, final_lr_frac=0.0,
                 weight_decay=0.0)
  c.lora.lr = 5e-5
  return c
