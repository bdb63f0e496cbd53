"""Fused hybrid decode, the klt keys' steps (``@triton.jit`` helpers of ``hybrid_decode``'s kernel).

Coded keys (``KLT``, ``_common.KltSpec``) are scored without rebuilding a key: the query's rotary halves and its
unrotated channels are read once (``_klt_query_operands``), this KV head's code-reading and decoding operands and the
RoPE cos, sin of a tile's token offsets are made once per program (``_klt_read_operands``), and each tile's codes are
decoded, turned and scored by three tensor-core products (``_klt_scores``). Diagonal decode matrices
(``KltSpec.DIAGONAL``: no transform) skip the decode product: each channel's scaled levels plus its mean are the key.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import klt_keys, klt_keys_diagonal, klt_levels, klt_levels16, klt_operands, mma, rope_cos_sin


@triton.jit
def _klt_query_operands(qt_ptr, qrow, gmask, scale, CFG: tl.constexpr, KLT: tl.constexpr):
    """klt keys: the query's rotary first halves and second halves times RoPE's attention ``scale`` (fp32 [RHP, GP]:
    ``_klt_scores`` turns them by each tile's base angle) and its unrotated channels as an fp16 B operand [RRP, GP]."""
    ia = tl.arange(0, KLT.RHP)
    ir = tl.arange(0, KLT.RRP)
    rows = qt_ptr + qrow[None, :] * CFG.QW
    qa = tl.load(rows + ia[:, None], mask=gmask[None, :] & (ia[:, None] < KLT.RH), other=0.0)
    qb = tl.load(rows + KLT.RH + ia[:, None], mask=gmask[None, :] & (ia[:, None] < KLT.RH), other=0.0)
    qr = tl.load(rows + 2 * KLT.RH + ir[:, None], mask=gmask[None, :] & (ir[:, None] < KLT.RR), other=0.0)
    return qa * scale, qb * scale, qr.to(tl.float16)


@triton.jit
def _klt_read_operands(
    h, meta_ptr, lv_ptr, dec_ptr, mean_ptr, turns_ptr, PAGE: tl.constexpr, CFG: tl.constexpr, KLT: tl.constexpr
):
    """klt keys: this KV head's code-reading and decoding bundles (``klt_operands``), the RoPE frequencies [RHP] and
    cos, sin [RHP, BLOCK_N] of the angle offsets t theta of a tile's tokens t from its first, made once per program:
    every tile's keys turn by them, its base angle goes to the query (``_klt_scores``)."""
    turns = tl.load(turns_ptr + tl.arange(0, KLT.RHP))
    ct, st = rope_cos_sin(tl.arange(0, CFG.BLOCK_N)[None, :], turns[:, None])
    if KLT.DIAGONAL and KLT.CUBIC:  # the keys are turned in fp16 (``klt_keys_diagonal``)
        ct, st = ct.to(tl.float16), st.to(tl.float16)
    cops, dops = klt_operands(h, meta_ptr, lv_ptr, dec_ptr, mean_ptr, PAGE, KLT, KLT.CUBIC, KLT.DIAGONAL)
    return cops, dops, turns, ct, st


@triton.jit
def _klt_scores(page, off, nmask, n0, qk, kops, PAGE: tl.constexpr, CFG: tl.constexpr, KLT: tl.constexpr):
    """Log2-domain scores [BLOCK_N, GP] of one tile of klt keys (positions n0 + t): q . R_(n0 + t) k =
    (R_n0^T q) . (R_t k), so the keys are decoded and turned by their offsets t from the tile's start alone
    (``klt_levels``, ``klt_keys`` with the program's cos, sin tiles) and the query by the tile's base angle n0, then
    three products with the query's parts."""
    cops, dops, turns, ct, st = kops
    rows = page + PAGE.OFF_KCODE + off * PAGE.KCB
    if KLT.DIAGONAL:  # no transform: the scaled levels plus the mean are the channels (no decode product)
        ka, kb, kr = klt_keys_diagonal(rows, nmask, ct, st, cops, dops, PAGE, KLT, CFG.INTERP)
    else:
        if KLT.CUBIC:  # fp16 levels of v = c - 2^(w-1) (``_common.klt_constants``' decode_read)
            z = klt_levels16(rows, nmask, cops, PAGE, KLT, CFG.INTERP)
        else:
            z = klt_levels(rows, nmask, cops, PAGE, KLT, CFG.INTERP)
        ka, kb, kr = klt_keys(z, ct, st, dops, KLT, CFG.INTERP)
    cb, sb = rope_cos_sin(n0 + tl.zeros([KLT.RHP], tl.int32), turns)
    qa = (qk[0] * cb[:, None] + qk[1] * sb[:, None]).to(tl.float16)
    qb = (qk[1] * cb[:, None] - qk[0] * sb[:, None]).to(tl.float16)
    s = mma(tl.trans(ka.to(tl.float16)), qa, tl.zeros([CFG.BLOCK_N, CFG.GP], tl.float32), CFG.INTERP)
    s = mma(tl.trans(kb.to(tl.float16)), qb, s, CFG.INTERP)
    if KLT.RR > 0:
        s = mma(tl.trans(kr.to(tl.float16)), qk[2], s, CFG.INTERP)
    return s
