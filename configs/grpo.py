"""GRPO: a policy samples G completions per prompt, reward functions score them on the host,
and it learns from each completion's reward relative to its group's (mamba_train/train/grpo.py).
Any model init_from takes runs, fully or with LoRA / QLoRA adapters (lora.rank, lora.base_dtype).

The default is the synthetic task (copy the last digit; scripts/grpo_task.py) on a tiny
byte-level model from scratch: the mean reward rises from about 0.05 to about 0.7 in 40 steps on
a CPU (docs/finetuning.md, GRPO).

  python scripts/grpo_task.py --out=data/grpo_task.jsonl
  python train.py --config configs/grpo.py --workdir runs/grpo-task --config.grpo.prompts=data/grpo_task.jsonl

From an SFT'd model, with GSM8K-style prompts ({"prompt": ..., "answer": "42"}) and the
answer after '####' scored, adapters at lora.lr:
  python train.py --config configs/grpo.py --workdir runs/grpo --config.init_from=runs/sft \\
      --config.grpo.prompts=gsm8k.jsonl --config.grpo.tokenizer=EleutherAI/gpt-neox-20b \\
      --config.grpo.reward_funcs='mamba_train.train.rewards:exact_answer' \\
      --config.grpo.max_new_tokens=256 --config.lora.rank=16

metrics.jsonl rows: reward, reward_std and rewards/<function>/mean|std; completions/mean_length,
max_length, clipped_ratio; clip_ratio/low_mean|high_mean|region_mean; kl (beta > 0); entropy
(the sampled tokens' mean surprisal); sampling/sampling_logp_difference/mean|max (sampler against
trainer); zero_std_groups; rollout/tokens_per_s, train/tokens_per_s; goodput/rollout_s,
goodput/reward_s beside goodput/step_s (the optimizer steps). eval_reward every eval_every steps.
"""

from configs import tiny


def get_config():
  c = tiny.get_config()
  c.name = "grpo"
  c.objective = "grpo"
  c.steps = 40  # GRPO steps: a rollout and num_iterations optimizer steps each
  c.log_every, c.eval_every, c.checkpoint_every = 1, 10, 20
  c.model.update(d_model=64, n_layer=2, d_state=16, headdim=16, chunk_size=16)
  c.grpo.update(prompts="data/grpo_task.jsonl", eval_fraction=0.05,
                reward_funcs="mamba_train.train.rewards:closeness",
                num_generations=8, prompts_per_step=8, max_new_tokens=4,
                temperature=1.0, num_iterations=1, loss_type="dapo", beta=0.0)
  # A constant rate after a short warmup; no weight decay (TRL's GRPO default has none).
  c.optim.update(lr=1e-2, schedule="constant", warmup_frac=0.0, weight_decay=0.0)
  # Adapters' rate (lora.rank > 0): TRL's GRPO LoRA examples run at 1e-5 to 1e-4 on real models.
  c.lora.lr = 1e-4
  return c
