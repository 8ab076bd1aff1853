"""Not a test of the suite: a check, run by hand, that `mamba3_torch` computes what
mamba_ssm's own MambaLMHeadModel computes with ssm_cfg.layer = "Mamba3".

mamba_ssm's Mamba3 runs only as GPU kernels (Triton, TileLang), so this builds its
model on CPU from its source and swaps each kernel for the pure-PyTorch reference that
mamba_ssm's own tests hold it to (`mamba3_siso_fwd_ref`, `mamba3_MIMO_chunk_ref`,
`rms_norm_ref`), loaded from its test files at run time. It needs a checkout of
state-spaces/mamba (MAMBA_SRC, with mamba_ssm/ and tests/ in it) and, to import its
modules, `einops` and `triton` (no GPU: nothing of Triton runs):

  MAMBA_SRC=/path/to/mamba python tests/mamba3_vs_mamba_ssm.py

Each line prints the relative difference of the logits on random weights; the refs
compute in float32 internally, so about 1e-7 is agreement (docs/mamba3-interop.md
records a run).
"""

import math
import os
import sys
from pathlib import Path

import torch

SRC = Path(os.environ["MAMBA_SRC"])
# mamba_ssm's test files, for their reference functions, beside its package.
sys.path[:0] = [str(SRC), str(Path(__file__).parent), str(SRC / "tests/ops/triton"),
                str(SRC / "tests/ops/tilelang")]

import mamba3_torch as ref  # noqa: E402
import mamba_ssm.models.mixer_seq_simple as mss  # noqa: E402
import mamba_ssm.modules.mamba3 as m3  # noqa: E402
import mamba_ssm.ops.triton.layer_norm as ln  # noqa: E402
import mamba_ssm.ops.triton.layernorm_gated as lng  # noqa: E402
import test_mamba3_mimo as mimo_refs  # noqa: E402  (mamba_ssm's tests/ops/tilelang)
import test_mamba3_siso as siso_refs  # noqa: E402  (mamba_ssm's tests/ops/triton)

lng.RMSNorm.forward = lambda self, x, z=None: lng.rms_norm_ref(
    x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
    norm_before_gate=self.norm_before_gate)
ln.RMSNorm.forward = lambda self, x, **_: ln.rms_norm_ref(x, self.weight, None, eps=self.eps)


def siso(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, chunk_size, Input_States,
         return_final_states, cu_seqlens):
  return siso_refs.mamba3_siso_fwd_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=D, Z=Z,
                                       dtype=Q.dtype)[0]


def mimo(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z, chunk_size,
         rotary_dim_divisor, dtype, return_state, cu_seqlens, fuse_pregate_headwise_rms_norm,
         outproj_norm_weight, outproj_norm_eps):
  # The kernel's own preprocessing, as its wrapper does it: in-chunk decay sums
  # (inclusive forward, exclusive reverse) and the cumulative angle.
  b, h, l = ADT.shape
  a = torch.nn.functional.pad(ADT, (0, (-l) % chunk_size)).reshape(b, h, -1, chunk_size)
  cs = torch.cumsum(a, -1)
  rev = cs[..., -1:] - cs
  cs, rev = cs.reshape(b, h, -1)[..., :l], rev.reshape(b, h, -1)[..., :l]
  ang = torch.cumsum(torch.tanh(Angles) * math.pi * DT.transpose(1, 2)[..., None], dim=1)
  return mimo_refs.mamba3_MIMO_chunk_ref(
      Q, K, V, Q_bias, K_bias, MIMO_V, MIMO_Out, Z, MIMO_Z, ang, cs, rev, DT, Trap, D,
      chunk_size=chunk_size, rotary_dim_divisor=rotary_dim_divisor, dtype=Q.dtype,
      rotate_pairwise=False, contract_mimo_out=MIMO_Out is not None,
      fused_norm=fuse_pregate_headwise_rms_norm, outproj_norm_weight=outproj_norm_weight,
      outproj_norm_eps=outproj_norm_eps)[0]


m3.mamba3_siso_combined = siso
m3.mamba3_mimo_combined = mimo

CASES = [dict(ngroups=2), dict(is_outproj_norm=True, rope_fraction=1.0),
         dict(is_mimo=True, mimo_rank=2, chunk_size=4),
         dict(is_mimo=True, mimo_rank=4, is_outproj_norm=True, ngroups=2, chunk_size=4),
         dict(is_mimo=True, mimo_rank=2, is_outproj_norm=True, fuse_pregate_headwise_norm=False,
              rope_fraction=1.0, chunk_size=4)]

for case in CASES:
  cfg = ref.lm_config(d_model=32, n_layer=2, vocab_size=50, d_intermediate=100, d_state=16,
                      headdim=8, **case)
  cfg["fused_add_norm"] = False  # the Triton add+norm; the plain path is the same function
  sd = ref.random_state_dict(cfg, seed=3)
  # float64 where mamba_ssm's own code allows it (its unfused MIMO out-norm path
  # mixes a .float() with the weights' dtype).
  dtype = torch.float32 if case.get("fuse_pregate_headwise_norm") is False else torch.float64
  model = mss.MambaLMHeadModel(mss.MambaConfig(**cfg)).to(dtype)
  model.load_state_dict({k: v.to(dtype) for k, v in sd.items()})
  ids = torch.randint(0, 50, (2, 19), generator=torch.Generator().manual_seed(0))
  with torch.no_grad():
    theirs = model(ids).logits.double()
  mine = ref.logits(cfg, sd, ids)
  print(case, dtype, "relative difference", ((theirs - mine).norm() / mine.norm()).item())
