"""turboquant_scores: the challenge entry point (worked example, naive agreement, odd D, errors)."""

import math

import pytest
import torch

from jetson_tq import lloyd_max_codebook, turboquant_scores
from jetson_tq.codec.rotation import Rotation, qjl_matrix
from jetson_tq.errors import DeviceError, DTypeError, ShapeError


def test_worked_example_exact():
    out = turboquant_scores(
        torch.tensor([[1.0, 2.0]]),
        torch.tensor([[0, 1], [2, 3]], dtype=torch.uint8),
        torch.tensor([[1, 1], [1, -1]], dtype=torch.int8),
        torch.tensor([0.2, 0.4]),
        torch.eye(2),
        torch.tensor([[1.0, 1.0], [1.0, -1.0]]),
        torch.tensor([-0.75, -0.25, 0.25, 0.75]),
    )
    assert out.dtype == torch.float32 and out.shape == (1, 2)
    assert out.tolist()[0] == pytest.approx([-0.999337, 2.752651], abs=1e-6)


@pytest.mark.parametrize("d", [1, 50, 100, 128])
def test_matches_reconstruct_then_matmul(d):
    g = torch.Generator().manual_seed(d)
    b, s, c = 4, 33, 16
    q = torch.randn(b, d, generator=g)
    idx = torch.randint(0, c, (s, d), generator=g).to(torch.uint8)
    signs = (torch.randint(0, 2, (s, d), generator=g) * 2 - 1).to(torch.int8)
    gamma = torch.rand(s, generator=g)
    pi = Rotation(d, "dense", 1).matrix()
    smat = qjl_matrix(d, 1)
    cb = lloyd_max_codebook(max(d, 2), 4)
    keys = cb[idx.long()] @ pi + math.sqrt(math.pi / 2) / d * gamma[:, None] * (signs.float() @ smat)
    assert torch.allclose(turboquant_scores(q, idx, signs, gamma, pi, smat, cb), q @ keys.T, atol=1e-4)


def test_bad_inputs_raise_named_errors():
    q, idx = torch.randn(2, 8), torch.zeros(5, 8, dtype=torch.uint8)
    signs, gamma, eye, cb = torch.ones(5, 8, dtype=torch.int8), torch.ones(5), torch.eye(8), torch.zeros(4)
    with pytest.raises(ShapeError):
        turboquant_scores(q[0], idx, signs, gamma, eye, eye, cb)
    with pytest.raises(ShapeError):
        turboquant_scores(q, idx[:, :4], signs, gamma, eye, eye, cb)
    with pytest.raises(DTypeError):
        turboquant_scores(q, idx.long(), signs, gamma, eye, eye, cb)
    with pytest.raises(DTypeError):
        turboquant_scores(q, idx, signs.float(), gamma, eye, eye, cb)
    with pytest.raises(ShapeError):
        turboquant_scores(q, idx + 7, signs, gamma, eye, eye, cb)  # index 7 with 4 centroids
    with pytest.raises(ShapeError):
        turboquant_scores(q, idx, signs, gamma, eye, eye, torch.zeros(300))
    if torch.cuda.is_available():
        with pytest.raises(DeviceError):
            turboquant_scores(q.cuda(), idx, signs, gamma, eye, eye, cb)
