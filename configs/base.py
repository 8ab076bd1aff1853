"""The documented base of every run config. Other configs start from `get_config()`
here and change what they need; the keys below are the whole contract (outside
scripts read them), and the config is locked, so a misspelt key is an error.

  python train.py --config configs/base.py --workdir runs/base   # (130m shapes, random data)
"""

import ml_collections

from mamba_train import Mamba2Config, Runtime, config_for
from mamba_train.model.runtime import FIELD_ALIASES


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.name = "base"  # a label: default workdir runs/<name>-<time>, W&B run name

  # --- length and size of the run ---
  c.steps = 1000  # optimizer steps
  c.batch_size = 8  # global batch, in sequences (split over data x fsdp x expert devices)
  c.seq_len = 2048  # tokens per sequence
  c.seed = 0  # parameter init and data order

  # --- periodic work (0 turns one off) ---
  c.log_every = 10  # metrics.jsonl, W&B, TensorBoard and progress bar
  c.eval_every = 200  # eval loss on the held-out split
  c.eval_batches = 4  # batches (of batch_size) per evaluation
  c.checkpoint_every = 1000  # Orbax saves to <workdir>/checkpoints/<step> (and at the end)
  c.checkpoint_keep = 3  # keep the newest k checkpoints (0 = keep all)
  # Multi-tier checkpoints (mamba_train/workdir/local_tier.py): also save every local_every
  # steps to local_dir, a directory on each host's own disk (not a bucket), which a
  # restore prefers when it holds a newer step (a host that lost its own takes a peer's
  # replica, else the persistent tier's). '' / 0 = off; both or neither.
  c.checkpoint = ml_collections.ConfigDict(dict(local_dir="", local_every=0))

  # --- the model's architecture: Mamba2Config fields under mamba_ssm's names ---
  # (layer_pattern makes a hybrid: 'M' Mamba-2, '*' attention, '-' MLP, one per layer)
  c.model = ml_collections.ConfigDict(Mamba2Config().to_dict())

  # --- how the model runs (mamba_train/model/runtime.py); changes no weight ---
  # Each field's values and what `auto` picks: docs/performance.md; who runs each operation
  # (ssd_impl, layer_impl, decode_impl, moe_impl, attention, interpret): the selection table,
  # mamba_train/ops/table.py (shown at the end of docs/configuration.md).
  # pallas_interpret: the old name of `interpret`, kept so that command lines naming it still run.
  c.runtime = ml_collections.ConfigDict({**Runtime().to_dict(), **dict.fromkeys(FIELD_ALIASES, False)})

  # --- optimizer (mamba_train/train/optim.py) ---
  c.optim = ml_collections.ConfigDict(dict(
      lr=3e-3,  # peak learning rate
      schedule="cosine",  # cosine | wsd | constant
      warmup_frac=0.1,  # linear warmup, as a fraction of `steps`
      decay_frac=0.2,  # wsd only: final linear decay, as a fraction of `steps`
      final_lr_frac=0.1,  # cosine / wsd end at lr * final_lr_frac
      b1=0.9, b2=0.95, eps=1e-8,
      weight_decay=0.1,  # decoupled; not on biases, norms, A_log, D, dt_bias
      clip_norm=1.0,  # global gradient norm clip (0 = off)
      grad_accum=1,  # micro-batches per step; batch_size must divide over them and the devices
      state_dtype="float32",  # Adam first moment: float32 | bfloat16
      # Stop after this many non-finite steps in a row (each is skipped). -1 = auto:
      # min(20, steps // 4), at least 1, so that a short run cannot pass on skipped steps.
      max_nonfinite_steps=-1,
      # Loss-spike guard (0 = off): a loss above spike_factor x the mean of the previous
      # spike_window losses rolls the run back to its last checkpoint and skips the
      # batches since then (at most 3 times a run). Needs checkpoint_every > 0.
      spike_factor=0.0,
      spike_window=20,
      # Weight guard (on; 0 = off): once weight_guard_window steps have been accepted, a step
      # whose parameter norm after it, or whose update norm, exceeds weight_guard_factor x
      # the largest of the newest weight_guard_window accepted steps' is skipped as a
      # non-finite one is (same streak, same stop; with spike_factor it rolls back).
      # Why 10 cannot trip a healthy run: mamba_train/train/optim.py `guard`.
      weight_guard_factor=10.0,
      weight_guard_window=20,
  ))

  # --- data ---
  c.data = ml_collections.ConfigDict(dict(
      source="synthetic",  # synthetic (a learnable Markov stream, no files) | corpus
      dir="",  # corpus directory ('' = the default byte-level corpus, built offline if absent)
      use_seq_idx=True,  # keep packed documents apart: no state passes between them
      # Weighted mixture of prepared datasets (replaces dir; mamba_train/data/mixture.py):
      # "data/web:0.7,data/code:0.3:epochs=2,data/math:0.1:tokens=5e8" (epochs/tokens cap one)
      mixture="",
      mixture_schedule="",  # new weights from a step on: "9000:0.5,0.5;12000:0.2,0.8"
  ))

  # --- lm-evaluation-harness during training (mamba_train/interop/eval_harness.py) ---
  c.harness = ml_collections.ConfigDict(dict(
      tasks="",  # comma-separated task names ('' = off), logged as harness/<task>/<metric>
      every=0,  # steps between runs (0 = off)
      include_path="",  # a directory of extra task yamls
      limit=0,  # examples per task (0 = all)
      num_fewshot=-1,  # -1 = the task's default
      batch_size="16",  # an int, "auto" or "auto:N", as lm-eval reads --batch_size
      max_batch_size=64,  # the most "auto" tries (lm-eval's default)
  ))

  # --- devices: data x fsdp x expert x sequence x tensor; one axis may be -1 (fills the rest) ---
  # data and fsdp both -1 split the devices between them (mamba_train/parallel/mesh.py).
  # sequence splits each sequence's length over devices (long context:
  # mamba_train/parallel/sequence.py); seq_len must divide over it.
  # Over several hosts or TPU slices, dcn_data / dcn_fsdp / dcn_sequence split that axis
  # across them (slow network) and data / fsdp / sequence / tensor then count devices
  # inside one (fast links): each mesh axis is dcn_<axis> x <axis> (mamba_train/parallel/mesh.py).
  # expert splits mixture-of-experts layers' experts (and, like data, the batch):
  # mamba_train/parallel/experts.py.
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, expert=1, sequence=1, tensor=1, dcn_data=1,
                                          dcn_fsdp=1, dcn_sequence=1))
  # Which mesh axes hold the weights that are not experts (mamba_train/parallel/sharding.py
  # LAYOUTS): 'fsdp' (fsdp only), 'fsdp_expert' (fsdp x expert: ZeRO-3 inside the expert
  # group, Megatron-Core's distributed optimizer; d_model must divide over them), or 'auto'
  # (fsdp_expert for an MoE model at expert > 1 and fsdp 1, such as one 8-GPU host; else fsdp).
  c.layout = "auto"
  # Per-device peak FLOP/s for MFU. 0 = the TPU/GPU table in mamba_train/metrics.py,
  # and for CPUs a nominal 170 GFLOP/s (a 2-core development machine's float32 matmul rate).
  c.peak_flops = 0.0

  # --- Weights & Biases ---
  c.wandb = ml_collections.ConfigDict(dict(
      mode="offline",  # online | offline (no network needed; sync later) | disabled
      project="mamba_train",
      name="",  # '' = the config name and the time
  ))

  # '' = random init; else a workdir, a checkpoint step, a transformers or a mamba_ssm directory,
  # whose architecture the run takes: config.model is a default that init_from's own config
  # replaces (a line says which fields it changed), but for ssd_window, the run's own, and
  # the model fields set on the command line, which must agree with it.
  c.init_from = ""

  # --- TensorBoard and profiles (docs/observability.md) ---
  # Every logged number also as a TensorBoard scalar in <workdir>/tensorboard/, the config
  # in its text and hparams panels (tensorboard --logdir <workdir>/tensorboard).
  c.tensorboard = True
  # A jax.profiler trace of chosen steps into <workdir>/profile/ (TensorBoard's profile
  # plugin, XProf, Perfetto); off unless num_steps > 0.
  c.profile = ml_collections.ConfigDict(dict(
      start_step=5,  # the trace starts after this step (the compile and first steps are not the steady state)
      num_steps=0,  # steps traced; 0 = no trace
      processes="0",  # the processes that trace: indices, comma separated, or 'all'
      python=False,  # also trace every Python call (a hundred thousand events a step)
  ))

  # --- what the run minimises ---
  # lm: cross entropy on the unmasked tokens (pretraining, finetuning, SFT).
  # dpo: DPO on a preference set (prepare_data.py --preference; mamba_train/train/dpo.py),
  #   against the initial weights frozen as the reference (with LoRA: the base).
  c.objective = "lm"
  c.dpo = ml_collections.ConfigDict(dict(
      beta=0.1,  # the strength of the pull towards the reference (KL weight)
      label_smoothing=0.0,  # in [0, 0.5): the share of pairs assumed mislabelled (cDPO)
  ))
  # grpo: GRPO on prompts scored by reward functions (configs/grpo.py; mamba_train/train/grpo.py
  #   for the objective, grpo_loop.py for a step): rollouts on the device, rewards on the host.
  #   `steps` counts GRPO steps (a rollout each, then num_iterations optimizer steps).
  c.grpo = ml_collections.ConfigDict(dict(
      prompts="",  # a .jsonl of {"prompt": ..., other fields} (mamba_train/data/prompts.py)
      eval_fraction=0.0,  # the share of prompts held out for the eval reward (eval_every)
      tokenizer="byte",  # byte | a tokenizer.json path or directory | a transformers name
      # 'pkg.mod:fn*weight,...' (mamba_train/train/rewards.py); quote it in a shell
      reward_funcs="",
      num_generations=8,  # G completions per prompt (a group); >= 2
      prompts_per_step=8,  # prompts a rollout takes: prompts_per_step x G completions
      max_new_tokens=256,  # the completion budget (TRL's max_completion_length)
      temperature=1.0, top_p=1.0, top_k=0,  # the sampler's (top_k 0 = off)
      stop="",  # stop strings, separated by '|' ('' = EOS only); the stop string is kept
      num_iterations=1,  # optimizer steps per rollout batch (mu)
      epsilon_low=0.2, epsilon_high=0.2,  # the ratio's clip range (DAPO: high 0.28)
      beta=0.0,  # KL to the reference (the initial weights; with LoRA the base); 0 = none
      loss_type="dapo",  # grpo | bnpo | dr_grpo | dapo (train/grpo.py)
      scale_rewards="group",  # group | batch | none
      # The sampler's log-probabilities against the trainer's: importance weights per
      # token or per sequence, truncated or masked to [is_min, is_max] (off = none).
      sampler_is="token_truncate", is_min=0.0, is_max=3.0,
      eval_temperature=0.0,  # the eval rollouts' (0 = greedy, one completion per prompt)
  ))

  # --- mixture-of-experts routers (models with 'E' layers; mamba_train/train/balance.py) ---
  # As Megatron-Core trains NemotronH: the aux-loss-free bias update (the correction
  # bias moves by rate * sign(mean load - load) after each step) and a small
  # auxiliary load-balancing loss. 0 turns either off. The bias update applies to sigmoid
  # routers (NemotronH); a softmax router (GraniteMoeHybrid) has no bias, only the aux loss.
  # capacity_factor: 0 is dropless dispatch; cf > 0 (MaxText's and Megatron's capacity
  # factor, e.g. 1.25) lets each expert take at most ceil(cf * seq_len * k / E) of a
  # sequence's assignments and drops the rest (counted in moe_dropped_tokens), which
  # caps the expert-parallel all-to-all's buffers at about cf times the assignments.
  c.moe = ml_collections.ConfigDict(dict(
      aux_loss_coef=1e-4,
      bias_update_rate=1e-3,
      capacity_factor=0.0,
  ))

  # --- LoRA adapters (mamba_train/model/lora.py); rank 0 = off, the whole model trains ---
  # With rank > 0 only the adapters train (and have optimizer state); the base
  # (init_from, or the random init) stays frozen, and checkpoints hold the adapters.
  c.lora = ml_collections.ConfigDict(dict(
      rank=0,
      alpha=16.0,  # the update is (alpha / rank) * A @ B
      dropout=0.0,  # on the adapters' input, training only (peft's lora_dropout; model/lora.py)
      # Glob patterns over in_proj, out_proj, q_proj, k_proj, v_proj, o_proj, up_proj,
      # gate_proj, down_proj and lm_head; names this model lacks are passed over.
      targets="in_proj,out_proj,q_proj,k_proj,v_proj,o_proj,up_proj,gate_proj,down_proj",
      base_dtype="",  # QLoRA: int8 | int4 (qwix) for the frozen adapted weights; '' = as stored
      # The adapters' peak learning rate, in place of optim.lr (a full finetune's) when rank > 0;
      # 0 = optim.lr. Adapters start at zero and take a much higher rate: the SFT and DPO
      # recipes set theirs. A --config.optim.lr given without --config.lora.lr is the rate
      # the run takes, as TRL's one learning_rate (mamba_train/train/run_config.py `learning_rate`).
      lr=0.0,
  ))
  c.lock()  # configs built on this one can change keys, not add them
  return c


# Peak learning rates: 5x GPT-3's at the nearest size (GPT-3 paper, table 2.1:
# 125M 6e-4, 350M 3e-4, 760M 2.5e-4, 1.3B 2e-4, 2.7B 1.6e-4).
MAMBA2_LR = {"130m": 3e-3, "370m": 1.5e-3, "780m": 1.25e-3, "1.3b": 1e-3, "2.7b": 8e-4}


def mamba2_pretrain(size: str) -> ml_collections.ConfigDict:
  """The Mamba-2 recipe at one of the released sizes: 300B tokens of context 2048
  in batches of 0.5M tokens, AdamW (0.9, 0.95), weight decay 0.1, clip 1.0,
  warmup then cosine to 10% of the peak, bfloat16 matmuls with float32 weights,
  parameters and optimizer state sharded over all devices (FSDP)."""
  c = get_config()
  c.name = f"mamba2-{size}"
  c.seq_len = 2048
  c.batch_size = 256  # x 2048 = 0.5M tokens per step
  c.steps = 300_000_000_000 // (c.batch_size * c.seq_len)  # 572,204
  c.log_every, c.eval_every, c.checkpoint_every = 100, 5000, 5000
  c.model.update(config_for(size).to_dict())
  c.runtime.compute_dtype = "bfloat16"
  c.optim.lr = MAMBA2_LR[size.removesuffix("-hybrid")]  # a hybrid: its pure model's
  c.data.source = "corpus"
  # data and fsdp both -1: fsdp takes every device, but on TPU no more than keeps the large
  # weights' pieces at 128 KiB or more, where XLA:TPU gathers them well (parallel/mesh.py
  # split_data_fsdp: 1.3b and 2.7b on v6e-256 data 2 x fsdp 128), data the rest.
  c.mesh.update(data=-1, fsdp=-1, tensor=1)
  return c
