"""TurboQuant_mse / _prod / group values / KVCodec: shapes, dtypes, estimators, errors."""

import math

import pytest
import torch

from jetson_tq import FP16_FORMAT, GroupQuantizer, KVCodec, KVFormat, TurboQuantMSE, TurboQuantProd
from jetson_tq.errors import DTypeError, FormatError, ShapeError


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead", [(), (3,), (2, 5, 4)])
def test_mse_and_prod_any_leading_dims_and_dtypes(dtype, lead):
    x = torch.randn(*lead, 64, generator=torch.Generator().manual_seed(len(lead))).to(dtype) * 3
    for q in (TurboQuantMSE(64, 3, seed=1), TurboQuantProd(64, 3, seed=1)):
        code = q.quantize(x)
        xh = q.dequantize(code)
        assert xh.shape == x.shape and xh.dtype == dtype
        rel = float((xh.float() - x.float()).norm() / x.float().norm())
        assert rel < 0.5, (type(q).__name__, rel)


def test_mse_keeps_norm_and_zero_vectors():
    q = TurboQuantMSE(32, 4, seed=0)
    x = torch.randn(100, 32) * 7
    code = q.quantize(x)
    assert torch.allclose(code.norm, x.norm(dim=-1))
    z = q.dequantize(q.quantize(torch.zeros(2, 32)))
    assert torch.equal(z, torch.zeros(2, 32))


def test_prod_dequantize_is_the_papers_estimator():
    q = TurboQuantProd(64, 3, seed=2)
    x = torch.randn(10, 64)
    code = q.quantize(x)
    s = q.sketch_matrix()
    x_mse = q.mse_part(code)
    signs = q.unpack_signs(code)
    expect = x_mse + math.sqrt(math.pi / 2) / 64 * code.rnorm.unsqueeze(-1) * (signs @ s)
    assert torch.allclose(q.dequantize(code), expect, atol=1e-5)
    # residual norm is ||x - x_mse||
    assert torch.allclose(code.rnorm, (x - x_mse).norm(dim=-1), rtol=1e-4, atol=1e-5)


def test_group_values_error_bounded_by_half_step():
    gq = GroupQuantizer(64, 4, 16)
    x = torch.randn(50, 64)
    code = gq.quantize(x)
    xh = gq.dequantize(code)
    step = code.scale.float().repeat_interleave(16, dim=-1)
    assert bool(((xh - x).abs() <= step * 0.5 + 2e-3 * x.abs().max()).all())
    const = gq.dequantize(gq.quantize(torch.full((2, 64), 1.5)))
    assert torch.allclose(const, torch.full((2, 64), 1.5))


@pytest.mark.parametrize(
    "fmt",
    [
        KVFormat(),
        KVFormat(key_mode="mse", key_bits=3),
        KVFormat(key_bits=1),
        KVFormat(value_mode="mse", value_bits=3),
        FP16_FORMAT,
    ],
)
def test_key_scores_equal_inner_products_with_reconstructed_keys(fmt):
    """The hot-path score (rotated query, no reconstruction) equals <q, k~> of the dequantized keys."""
    codec = KVCodec(fmt, 64, seed=3)
    k, v = torch.randn(2, 9, 64), torch.randn(2, 9, 64)
    fields = codec.encode(k, v)
    q = torch.randn(2, 4, 64)
    q_rot, q_sketch = codec.transform_query(q)
    scores = codec.key_scores(q_rot, q_sketch, fields)
    naive = q @ codec.decode_keys(fields).transpose(-1, -2)
    assert scores.shape == (2, 4, 9)
    assert torch.allclose(scores, naive, atol=2e-4, rtol=1e-4)


def test_query_matrix_transforms_once():
    codec = KVCodec(KVFormat(key_mode="prod", key_bits=3), 64, seed=4)  # prod: [Pi; S]
    q = torch.randn(3, 64)
    m = codec.query_matrix()
    q_rot, q_sketch = codec.transform_query(q)
    assert m.shape == (128, 64)
    assert torch.allclose(q @ m.T, torch.cat([q_rot, q_sketch], -1), atol=1e-5)


def test_codec_errors_are_named():
    codec = KVCodec(KVFormat(), 64)
    with pytest.raises(ShapeError):
        codec.encode(torch.randn(3, 32), torch.randn(3, 32))
    with pytest.raises(ShapeError):
        codec.encode(torch.randn(3, 64), torch.randn(4, 64))
    with pytest.raises(DTypeError):
        codec.encode(torch.ones(3, 64, dtype=torch.int64), torch.ones(3, 64, dtype=torch.int64))
    with pytest.raises(FormatError):
        TurboQuantProd(64, 0)
    with pytest.raises(FormatError):
        GroupQuantizer(64, 2, 24)
    with pytest.raises(FormatError):
        KVCodec(KVFormat(value_group=32), 37)  # prime head dim: only groups of 1 fit below the value group 32
