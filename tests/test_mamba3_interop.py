"""Mamba-3 and mamba_ssm: the test-only PyTorch reference (`mamba3_torch`) against our
scan, mamba_ssm-format directories written from it on random weights loaded with its
logits, exports that give the same files back, and the refusals.

`mamba3_torch` itself was held to mamba_ssm's own MambaLMHeadModel (its GPU kernels
swapped for the references its tests use) by `tests/mamba3_vs_mamba_ssm.py`, run by
hand: that needs a mamba_ssm checkout, which this suite cannot import on CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from mamba_train.ops import ssd3

import mamba3_torch as ref
from helpers import rel


def test_reference_scan_matches_ssd3_sequential():
  """The reference's recurrence is ops/ssd3.py's, float64, MIMO rank 2 over two groups
  (heads map to groups as mamba_ssm repeats them) and SISO."""
  rng = np.random.default_rng(0)
  b, l, h, p, n, g = 2, 7, 4, 3, 5, 2
  for rank in (2, None):
    R = rank or 1
    x = rng.standard_normal((b, l, h, p))
    dt = np.log1p(np.exp(rng.standard_normal((b, l, h)) - 1))
    A = -np.exp(rng.uniform(-1, 1.5, (b, l, h)))
    lam = 1 / (1 + np.exp(-2 * rng.standard_normal((b, l, h))))
    B, C = (rng.standard_normal((b, l, R, g, n)) for _ in range(2))
    D = rng.standard_normal(h)
    xp = rng.standard_normal((h, R, p)) if rank else None
    with jax.enable_x64(True):
      squeeze = (lambda t: t) if rank else (lambda t: t[:, :, 0])
      y, (state, _, _) = jax.jit(ssd3.ssd3_sequential)(
          *map(jnp.asarray, (x, dt, A, lam, squeeze(B), squeeze(C))), D=jnp.asarray(D),
          x_proj=None if xp is None else jnp.asarray(xp))
    T = torch.from_numpy
    per_head = lambda t: T(t).repeat_interleave(h // g, dim=3)
    v = T(x)[:, :, None] * (T(xp).transpose(0, 1) if rank else 1)
    y_ref, state_ref = ref.scan(v, T(dt), T(A), T(lam), per_head(B), per_head(C), T(D))
    y_ref = y_ref if rank else y_ref[:, :, 0]
    assert rel(np.asarray(y), y_ref.numpy()) < 1e-12
    assert rel(np.asarray(state), state_ref.numpy()) < 1e-12
