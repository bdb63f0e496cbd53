"""The recorder's specialization keys follow Triton 3.6's own rules (``native_specialize_impl``, what
``JITFunction.run`` keys its kernel cache on), so a recorded set is the set of compiles on the GPU."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from jetson_tq.errors import ConfigError
from jetson_tq.kernels import specializations

libtriton = pytest.importorskip("triton._C.libtriton")
compiler = pytest.importorskip("triton.backends.compiler")

_T = torch.zeros(64, dtype=torch.float16)
VALUES = [0, 1, 2, 15, 16, 17, 48, -1, -16, 2**31 - 1, 2**31, 2**32 + 16, 2**63, True, False, 0.5, None]
TENSORS = [_T, _T[1:], _T[8:], torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.bfloat16)]


@pytest.mark.parametrize("arg", VALUES + TENSORS + [(1, 16, _T[1:])], ids=repr)
def test_argument_keys_match_triton(arg):
    want = libtriton.native_specialize_impl(compiler.BaseBackend, arg, False, True, True)
    assert specializations.arg_specialization(arg) == want


def test_recorder_keys_a_launch_and_names_what_differs():
    def kernel(x_ptr, n, BLOCK: tl.constexpr):  # the annotation Triton reads
        pass

    with specializations.record(launch=False) as rec:
        rec.add(specializations.spec_key(kernel, (_T, 32), {"BLOCK": 64}, {"num_warps": 4}))
        rec.add(specializations.spec_key(kernel, (_T, 48), {"BLOCK": 64}, {"num_warps": 4}))  # same class
        other = specializations.spec_key(kernel, (_T[1:], 33), {"BLOCK": 64}, {"num_warps": 4})
    assert specializations.active() is None and len(rec.keys) == 1
    text = specializations.describe_missing([other], rec.keys)
    assert "x_ptr: ('*fp16', '') vs ('*fp16', 'D')" in text and "n: ('i32', '') vs ('i32', 'D')" in text
    with pytest.raises(ConfigError, match="no argument for parameter n"):
        specializations.spec_key(kernel, (_T,), {"BLOCK": 64}, {})
