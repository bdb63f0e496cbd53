"""The Triton kernels at the default preset's fitted value groups (64 -> 40 at D=80, 48 at 96, 56 at 112, 40 at 160),
and with mse values at head dims whose padded tiles are the widest or oddest (50: 7-coordinate value chunks; 160:
a dense value rotation padded to 256; 256: the Hadamard one, prefill's rotation back in four column blocks).

The presets' value group of 64 does not divide these head dims; the format fits it
(``KVFormat.value_group_for``), and compress-on-write, hybrid decode and chunked prefill must
agree with the reference at those non-power-of-two group sizes (checks shared with the other
kernel test modules, same tolerances).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_compress import _check as check_compress
from test_kernels_decode import _check as check_decode
from test_kernels_prefill import _check as check_prefill

from tests.helpers.kernel_cases import fresh_seed

pytestmark = pytest.mark.kernel

DIMS = [80, 96, 112, 160]
MSE_VALUE_DIMS = [50, 160, 256]


@pytest.mark.parametrize("d", DIMS)
def test_compress_write_fitted_groups(d):
    check_compress("mse_k4v3", d, [13, 4], torch.float16, exact_signs=True)


@pytest.mark.parametrize("d", DIMS)
def test_decode_fitted_groups(d):
    check_decode("mse_k4v3", d, 4, [37, 9], [5, 0], torch.float16, 2, fresh_seed())


@pytest.mark.parametrize("d", DIMS)
def test_prefill_fitted_groups(d):
    check_prefill("mse_k4v3", d, 4, [30], [3], 6, torch.float16, fresh_seed())


@pytest.mark.parametrize("d", MSE_VALUE_DIMS)
def test_mse_values_at_head_dims(d):
    seed = fresh_seed()
    check_compress("mse_k4v3+vmse3", d, [13, 4], torch.float16, exact_signs=True)
    check_decode("mse_k4v3+vmse3", d, 4, [37, 9], [5, 0], torch.float16, 2, seed)
    check_prefill("mse_k4v3+vmse3", d, 4, [30], [3], 6, torch.float16, seed)
