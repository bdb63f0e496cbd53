"""Raw TurboQuant_prod scores of queries against unpacked keys: input checks and the PyTorch reference.

The public ``jetson_tq.turboquant_scores`` runs this or the Triton kernel, chosen by ``jetson_tq.ops``.

score[b, s] = <Pi q_b, codebook[K_idx[s]]> + sqrt(pi/2)/D * gamma[s] * <S_mat q_b, qjl_signs[s]>.
Each query is transformed once (q @ [Pi; S]^T); keys are never reconstructed.
"""

from __future__ import annotations

import math

import torch

from ..errors import DTypeError, ShapeError, expect_rank, expect_same_device, expect_tensor
from ..validate import check_rotation, check_scores_values


def expect_scores_tensors(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook) -> None:
    """Every ``turboquant_scores`` input is a tensor (a named error otherwise): the first of its checks, which
    ``ops.scores`` runs before it picks a backend from Q's device."""
    for name, t in (
        ("Q", Q),
        ("K_idx", K_idx),
        ("qjl_signs", qjl_signs),
        ("gamma", gamma),
        ("Pi", Pi),
        ("S_mat", S_mat),
        ("codebook", codebook),
    ):
        expect_tensor(name, t)


def check_scores_inputs(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook) -> None:
    """Validate shapes, dtypes and devices of ``turboquant_scores`` inputs (named errors)."""
    expect_scores_tensors(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook)
    expect_same_device(Q=Q, K_idx=K_idx, qjl_signs=qjl_signs, gamma=gamma, Pi=Pi, S_mat=S_mat, codebook=codebook)
    expect_rank("Q", Q, (2,))
    expect_rank("K_idx", K_idx, (2,))
    expect_rank("qjl_signs", qjl_signs, (2,))
    expect_rank("gamma", gamma, (1,))
    expect_rank("codebook", codebook, (1,))
    d = Q.shape[1]
    s = K_idx.shape[0]
    if d < 1:
        raise ShapeError("Q: head dim D must be >= 1")
    if K_idx.shape != (s, d) or qjl_signs.shape != (s, d):
        raise ShapeError(
            f"K_idx and qjl_signs: expected [S, {d}], got {tuple(K_idx.shape)} and {tuple(qjl_signs.shape)}"
        )
    if gamma.shape != (s,):
        raise ShapeError(f"gamma: expected [{s}], got {tuple(gamma.shape)}")
    if Pi.shape != (d, d) or S_mat.shape != (d, d):
        raise ShapeError(f"Pi and S_mat: expected [{d}, {d}], got {tuple(Pi.shape)} and {tuple(S_mat.shape)}")
    if not 1 <= codebook.shape[0] <= 256:
        raise ShapeError(f"codebook: expected 1..256 centroids, got {codebook.shape[0]}")
    if K_idx.dtype != torch.uint8:
        raise DTypeError(f"K_idx: expected uint8, got {K_idx.dtype}")
    if qjl_signs.dtype != torch.int8:
        raise DTypeError(f"qjl_signs: expected int8 (+1/-1), got {qjl_signs.dtype}")
    for name, t in (("Q", Q), ("gamma", gamma), ("Pi", Pi), ("S_mat", S_mat), ("codebook", codebook)):
        if not t.is_floating_point():
            raise DTypeError(f"{name}: expected a floating tensor, got {t.dtype}")
    check_scores_values(qjl_signs, gamma, Q=Q, Pi=Pi, S_mat=S_mat, codebook=codebook)
    check_rotation("Pi", Pi)


def turboquant_scores_reference(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook) -> torch.Tensor:
    """PyTorch reference of ``turboquant_scores`` (fp32, CPU or CUDA) -> [B, S]."""
    check_scores_inputs(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook)
    d = Q.shape[1]
    if K_idx.numel() and int(K_idx.max()) >= codebook.shape[0]:
        raise ShapeError(f"K_idx: index {int(K_idx.max())} out of range for a codebook of {codebook.shape[0]}")
    q = Q.float()
    q_rot = q @ Pi.float().T
    q_sketch = q @ S_mat.float().T
    mse = q_rot @ codebook.float()[K_idx.long()].T
    qjl = q_sketch @ qjl_signs.float().T
    return mse + (math.sqrt(math.pi / 2) / d) * gamma.float().unsqueeze(0) * qjl
