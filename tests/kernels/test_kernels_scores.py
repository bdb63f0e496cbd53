"""``turboquant_scores`` kernel (``kernels.scores``) against ``codec.scores.turboquant_scores_reference``.

Tolerance: relative L2 error 1e-5. Both products run as ``tf32x3`` on the tensor cores (three tf32
passes, ~fp32 accurate: measured ~3e-7), so the result matches the fp32 reference to rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from jetson_tq import turboquant_scores
from jetson_tq.codec.codebook import lloyd_max_codebook
from jetson_tq.codec.rotation import Rotation, qjl_matrix
from jetson_tq.codec.scores import turboquant_scores_reference
from jetson_tq.kernels.scores import turboquant_scores_triton
from tests.helpers.kernel_cases import DEVICE, GPU, fresh_seed, rel_err

pytestmark = pytest.mark.kernel

# (B queries, S keys, D, codebook size)
SMALL = [(3, 100, 128, 16), (5, 37, 50, 4), (1, 1, 100, 8), (20, 70, 64, 2), (2, 10, 256, 256), (17, 65, 80, 16)]
LARGE = [(32, 32768, 128, 16), (7, 5000, 50, 4), (64, 3000, 100, 8), (1, 1, 128, 16), (33, 999, 256, 256)]


@pytest.mark.parametrize("b,s,d,c", LARGE if GPU else SMALL)
def test_scores_match_reference(b, s, d, c):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=gen)
    idx = torch.randint(0, c, (s, d), dtype=torch.uint8, generator=gen)
    signs = (torch.randint(0, 2, (s, d), generator=gen) * 2 - 1).to(torch.int8)
    gamma = torch.rand(s, generator=gen)
    pi = Rotation(d, "dense", seed % 1000).matrix()
    sk = qjl_matrix(d, seed % 997)
    cb = lloyd_max_codebook(d, int(math.log2(c)))
    args = [t.to(DEVICE) for t in (q, idx, signs, gamma, pi, sk, cb)]
    ref = turboquant_scores_reference(*args)
    out = turboquant_scores_triton(*args, out=torch.full_like(ref, float("nan")))
    assert rel_err(out, ref) <= 1e-5, f"seed={seed} B={b} S={s} D={d} C={c}"
    if GPU:  # the public entry point routes CUDA inputs to the kernel
        assert rel_err(turboquant_scores(*args), ref) <= 1e-5
