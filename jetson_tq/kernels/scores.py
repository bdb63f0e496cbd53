"""``turboquant_scores`` on CUDA: raw TurboQuant_prod scores of B queries against S unpacked keys.

score[b, s] = <Pi q_b, codebook[K_idx[s]]> + sqrt(pi/2)/D * gamma[s] * <S q_b, qjl_signs[s]>

The queries are transformed once (``query_transform``: q @ [Pi; S]^T); each program then takes
BLOCK_S keys, turns their indices into centroids and their signs into +-1 (once, for all B
queries), and scores the whole tile against every query with two tensor-core products (``tf32x3``,
fp32-accurate). Keys are never reconstructed. Any head dim (padded to a power of two, masked).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..codec.scores import check_scores_inputs
from ._common import INTERPRET, cuda_or_interpreter, next_pow2
from ._launch import FastLauncher
from .query_transform import query_transform


@triton.jit
def _scores_kernel(
    # ---- pointers
    qt_ptr,  # fp32 [B, 2 D]: transformed queries (Pi q, S q)
    idx_ptr,  # [S, D]: codebook indices (unpacked)
    sgn_ptr,  # [S, D]: QJL signs (+-1)
    gamma_ptr,  # [S]: residual norms
    cb_ptr,  # fp32 [n_codes]: codebook
    out_ptr,  # fp32 [B, S]: scores
    # ---- sizes, strides, scalars
    n_q,  # B
    n_keys,  # S
    n_codes,  # codebook entries (ids past it clamp)
    stride_is,
    stride_ss,
    stride_ob,
    qjl_scale,  # sqrt(pi / 2) / D
    # ---- compile time
    D: tl.constexpr,  # head dim
    DP: tl.constexpr,  # head dim padded to a power of two
    BLOCK_S: tl.constexpr,  # keys per program
    BLOCK_B: tl.constexpr,  # queries per program
    PRECISION: tl.constexpr,
):  # tl.dot input precision ("tf32x3"; "ieee" in the interpreter)
    # Each program: BLOCK_S keys x BLOCK_B queries; scores are computed transposed, [keys, queries].
    pid_s, pid_b = tl.program_id(0), tl.program_id(1)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    q = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    d = tl.arange(0, DP)
    smask = s < n_keys
    kmask = smask[:, None] & (d[None, :] < D)
    idx = tl.load(idx_ptr + s[:, None].to(tl.int64) * stride_is + d[None, :], mask=kmask, other=0).to(tl.int32)
    cent = tl.load(cb_ptr + tl.minimum(idx, n_codes - 1), mask=kmask, other=0.0)  # out-of-range ids clamp
    sgn = tl.load(sgn_ptr + s[:, None].to(tl.int64) * stride_ss + d[None, :], mask=kmask, other=0).to(tl.float32)
    qmask = (q[None, :] < n_q) & (d[:, None] < D)
    q_rot = tl.load(qt_ptr + q[None, :].to(tl.int64) * (2 * D) + d[:, None], mask=qmask, other=0.0)  # [DP, BLOCK_B]
    q_sk = tl.load(qt_ptr + q[None, :].to(tl.int64) * (2 * D) + D + d[:, None], mask=qmask, other=0.0)
    mse = tl.dot(cent, q_rot, input_precision=PRECISION)
    qjl = tl.dot(sgn, q_sk, input_precision=PRECISION)
    gamma = tl.load(gamma_ptr + s, mask=smask, other=0.0).to(tl.float32)
    res = mse + (qjl_scale * gamma)[:, None] * qjl
    tl.store(out_ptr + q[None, :].to(tl.int64) * stride_ob + s[:, None], res, mask=smask[:, None] & (q[None, :] < n_q))


BLOCK_S = 64
_LAUNCH = FastLauncher(_scores_kernel)


def turboquant_scores_triton(
    Q,
    K_idx,
    qjl_signs,
    gamma,
    Pi,
    S_mat,
    codebook,
    *,
    out: torch.Tensor | None = None,
    block_s: int = BLOCK_S,
    num_warps: int = 4,
) -> torch.Tensor:
    """``codec.scores.turboquant_scores`` as one Triton launch (plus the query transform) -> [B, S] fp32."""
    check_scores_inputs(Q, K_idx, qjl_signs, gamma, Pi, S_mat, codebook)
    cuda_or_interpreter(Q)
    b, d = Q.shape
    s = K_idx.shape[0]
    if out is None:
        out = torch.empty(b, s, dtype=torch.float32, device=Q.device)
    if b == 0 or s == 0:
        return out
    qmat = torch.cat([Pi.float(), S_mat.float()], dim=0).contiguous()
    qt = query_transform(Q.unsqueeze(0), qmat, 1.0, out=torch.empty(b, 2 * d, dtype=torch.float32, device=Q.device))
    K_idx = K_idx if K_idx.stride(-1) == 1 else K_idx.contiguous()
    qjl_signs = qjl_signs if qjl_signs.stride(-1) == 1 else qjl_signs.contiguous()
    block_b = min(64, max(16, next_pow2(b)))
    grid = (triton.cdiv(s, block_s), triton.cdiv(b, block_b))
    precision = "ieee" if INTERPRET else "tf32x3"
    _LAUNCH(
        grid,
        (
            qt,
            K_idx,
            qjl_signs,
            gamma.contiguous(),
            codebook.float().contiguous(),
            out,
            b,
            s,
            codebook.shape[0],
            K_idx.stride(0),
            qjl_signs.stride(0),
            out.stride(0),
            math.sqrt(math.pi / 2) / d,
        ),
        dict(D=d, DP=max(16, next_pow2(d)), BLOCK_S=block_s, BLOCK_B=block_b, PRECISION=precision),
        (d, block_s, block_b, precision),
        num_warps=num_warps,
    )
    return out
