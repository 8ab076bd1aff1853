"""Direct preference optimisation (DPO; Rafailov et al. 2023), the sigmoid loss with
label smoothing as TRL's DPOTrainer computes it, and its reward metrics.

A preference batch row holds one pair (data/preference.py): the prompt and chosen
response as example 0, the prompt and rejected response as example 1 (seq_idx keeps
them apart, so no state passes from one to the other), the loss mask on each
response's tokens. A response's log-probability is the sum of its masked tokens'.

  logits = beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r)))
  loss   = -(1 - eps) * log sigmoid(logits) - eps * log sigmoid(-logits)

with eps the label smoothing. The reference is the policy the run started from, frozen:
with LoRA the base with its adapters off (their B at zero: exactly the base, and no
second copy held), else a copy of the initial weights (`TrainState.frozen`). It is
computed per batch, in the same step: a pass over the data beforehand would save one
forward pass a step but store two numbers a pair on disk and tie the data to the
model; for the sizes here the forward is the cheaper of the two to keep simple.

Shapes: b pairs (rows), l length.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp

from mamba_train.model.lm import Mamba2LM
from mamba_train.train.loss import row_cross_entropy

F32 = jnp.float32
# The metrics a DPO step logs beside `loss` (TRL's names), averaged over pairs.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")


@dataclasses.dataclass(frozen=True)
class DpoSpec:
  beta: float = 0.1
  label_smoothing: float = 0.0


def response_weights(batch: Mapping[str, jax.Array]) -> jax.Array:
  """(b, l, 2): the loss mask on the chosen (example 0) and rejected (example 1) tokens."""
  mask = batch["loss_mask"].astype(F32)
  return jnp.stack([mask * (batch["seq_idx"] == 0), mask * (batch["seq_idx"] == 1)], axis=-1)


def pair_logps(model: Mamba2LM, batch: Mapping[str, jax.Array], batch_shards: int = 1) -> jax.Array:
  """(b, 2) float32: the log-probabilities of each row's chosen and rejected response."""
  h, _ = model.backbone(batch["input_ids"], seq_idx=batch["seq_idx"])
  return -row_cross_entropy(*model.head_operands(h), batch["targets"],
                            response_weights(batch), model.config.vocab_size,
                            model.runtime.compute_dtype, batch_shards=batch_shards)


def dpo_terms(policy: jax.Array, reference: jax.Array, spec: DpoSpec) -> dict[str, jax.Array]:
  """Per pair, from (b, 2) log-probabilities (chosen, rejected) of policy and reference:
  the loss and the metrics of METRICS (b,)."""
  chosen = spec.beta * (policy[:, 0] - reference[:, 0])
  rejected = spec.beta * (policy[:, 1] - reference[:, 1])
  logits = chosen - rejected
  eps = spec.label_smoothing
  loss = -(1.0 - eps) * jax.nn.log_sigmoid(logits) - eps * jax.nn.log_sigmoid(-logits)
  return {"loss": loss, "rewards/chosen": chosen, "rewards/rejected": rejected,
          "rewards/margins": logits, "rewards/accuracies": (chosen > rejected).astype(F32),
          "logps/chosen": policy[:, 0], "logps/rejected": policy[:, 1]}


def dpo_sums(policy_model: Mamba2LM, reference_model: Mamba2LM, batch, spec: DpoSpec,
             batch_shards: int = 1):
  """(loss summed over pairs, pair count, {metric: sum over pairs}). Rows without both
  responses (a padding row of an evaluation) count for nothing."""
  policy = pair_logps(policy_model, batch, batch_shards)
  reference = jax.lax.stop_gradient(pair_logps(reference_model, batch, batch_shards))
  terms = dpo_terms(policy, reference, spec)
  weights = response_weights(batch)
  real = jnp.all(jnp.sum(weights, axis=1) > 0, axis=-1).astype(F32)  # (b,)
  sums = {k: jnp.sum(v * real) for k, v in terms.items()}
  return sums.pop("loss"), jnp.sum(real), sums
