"""Compress-on-write, the per-field encoders of ``compress_write._compress_write_kernel`` (``@triton.jit`` helpers).

Key path (``_encode_keys``: norm, rotation, codebook search, QJL signs; ``_encode_klt_keys`` for klt keys), value
path (``_quantize_values``: per-group min/max quantization, or ``_encode_values`` for TurboQuant_mse values), the
planar packing (``_store_packed``) and the store checks' fault record (``_record_fault``). Each takes the ``PAGE``
and ``CFG`` bundles whole.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import K_MSE, K_PROD, mma, rope_cos_sin
from .compress_checks import _max_nan, _min_nan

TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny, the reference norm clamp
ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + it (0 <= x < 2^22) holds round-half-even(x) in its low bits


@triton.jit
def _bucketize(y, bnd_ptr, KB: tl.constexpr):
    """Number of codebook boundaries strictly below y (torch.bucketize, right=False)."""
    idx = tl.zeros(y.shape, tl.int32)
    if KB <= 3:
        for i in tl.static_range((1 << KB) - 1):
            idx += (y > tl.load(bnd_ptr + i)).to(tl.int32)
    else:
        for bit in tl.static_range(KB):
            cand = idx + (1 << (KB - 1 - bit))
            idx = tl.where(y > tl.load(bnd_ptr + cand - 1), cand, idx)
    return idx


@triton.jit
def _split16(x):
    """fp32 tile x as an fp16 (hi, lo) pair, hi + lo = x to ~22 bits: the operands of ``_dot3``."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _dot3(a, m, rows, d, mask, D: tl.constexpr, INTERP: tl.constexpr):
    """a @ M[rows, :]^T (fp32 [T, rows]) with a and M split into fp16 hi + lo parts (three tensor-core dots,
    ~22-bit accurate: quantization decisions match the fp32 reference). ``a``: the (hi, lo) tiles (``_split16``);
    ``m``: the (hi, lo) pointers of the [D, D] matrix M."""
    a_hi, a_lo = a
    m_hi_ptr, m_lo_ptr = m
    off = rows[None, :] * D + d[:, None]
    m_hi = tl.load(m_hi_ptr + off, mask=mask, other=0.0)
    m_lo = tl.load(m_lo_ptr + off, mask=mask, other=0.0)
    acc = mma(a_hi, m_hi, tl.zeros([a_hi.shape[0], rows.shape[0]], tl.float32), INTERP)
    acc = mma(a_hi, m_lo, acc, INTERP)
    return mma(a_lo, m_hi, acc, INTERP)


@triton.jit
def _chunk_code(code, inside, byte, codes, c, FULL: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr):
    """Chunk ``c``'s codes [T, CWP] into the packing state -> (the codes, padding coordinates as 0 unless ``FULL``;
    ``byte``: one run (W1 == 0), the codes OR-ed in at bit c * W0; ``codes``: else the tuple for ``_store_packed``,
    the chunk's codes appended)."""
    if not FULL:
        code = tl.where(inside, code, 0)  # padding coordinates pack as 0
    if W1 == 0:
        byte |= code << (c * W0)
    else:
        codes = codes + (code,)
    return code, byte, codes


@triton.jit
def _search_symmetric(acc, rs, bnd_ptr, KB: tl.constexpr):
    """torch.bucketize(acc / rs, bounds) for a codebook symmetric about 0 (bounds[m] = 0, bounds[m + j] =
    -bounds[m - j]): count the 2^(KB-1) - 1 positive bounds times rs (per row) below |acc| and mirror by the sign.
    Differs from the division only where acc / rs is within rounding of a bound (ties, which the tests allow).
    The count is a float sum of 1.0/0.0 compares (FSET.BF + FADD per bound on sm_90; integer counts compiled to
    predicate moves, 3 instructions per bound); at 4 bits the middle bound first picks the half whose 3 bounds are
    counted (11 instructions instead of 13; a full binary search spilled predicates, a guess-and-check with one
    gathered bound spilled registers)."""
    HALF: tl.constexpr = (1 << (KB - 1)) - 1
    mag = tl.abs(acc)
    if KB == 4:
        up = mag > (tl.load(bnd_ptr + 11) * rs)[:, None]
        cf = tl.where(up, 4.0, 0.0)
        for j in tl.static_range(3):
            t = tl.where(up, (tl.load(bnd_ptr + 12 + j) * rs)[:, None], (tl.load(bnd_ptr + 8 + j) * rs)[:, None])
            cf += tl.where(mag > t, 1.0, 0.0)
    else:
        cf = tl.zeros(acc.shape, tl.float32)
        for j in tl.static_range(HALF):
            cf += tl.where(mag > (tl.load(bnd_ptr + HALF + 1 + j) * rs)[:, None], 1.0, 0.0)
    return cf.to(tl.int32) ^ tl.where(acc > 0, HALF + 1, HALF)  # HALF - count below 0, HALF + 1 + count above


@triton.constexpr_function
def _whole_chunk(c, gi, CW, CWP, GROUP, D):
    """Value chunk c lies inside group gi with no padding columns (no masks needed); compile-time."""
    return CW == CWP and gi * GROUP <= c * CW and (c + 1) * CW <= min((gi + 1) * GROUP, D)


@triton.constexpr_function
def _overlaps(c, gi, CW, GROUP):
    """Value chunk c has columns of group gi; compile-time."""
    return c * CW < (gi + 1) * GROUP and (c + 1) * CW > gi * GROUP


@triton.jit
def _store_run(
    codes,
    ptrs,
    mask,
    RUN_OFF: tl.constexpr,
    LOW: tl.constexpr,
    W: tl.constexpr,
    CH: tl.constexpr,
    CW: tl.constexpr,
    NCH: tl.constexpr,
):
    """Store one planar run (bits [LOW, LOW+W) of every code) at byte offset RUN_OFF of the field."""
    WMIN: tl.constexpr = CW // CH
    for k in tl.static_range(W // WMIN):  # piece k of the run = bytes [k*CW, (k+1)*CW)
        byte = tl.zeros(codes[0].shape, tl.int32)
        for c in tl.static_range(NCH):
            if (c * WMIN) % W == k * WMIN:
                byte |= ((codes[c] >> LOW) & ((1 << W) - 1)) << (((c * WMIN) // W) * W)
        tl.store(ptrs + RUN_OFF + k * CW, byte.to(tl.uint8), mask=mask)


@triton.jit
def _store_packed(
    codes,
    ptrs,
    mask,
    CH: tl.constexpr,
    CW: tl.constexpr,
    NCH: tl.constexpr,
    W0: tl.constexpr,
    W1: tl.constexpr,
    W2: tl.constexpr,
):
    """Pack per-chunk codes (a tuple of NCH [T, CWP] int32 tiles) into planar runs and store them."""
    if W0 > 0:
        _store_run(codes, ptrs, mask, 0, 0, W0, CH, CW, NCH)
    if W1 > 0:
        _store_run(codes, ptrs, mask, CH * W0, W0, W1, CH, CW, NCH)
    if W2 > 0:
        _store_run(codes, ptrs, mask, CH * (W0 + W1), W0 + W1, W2, CH, CW, NCH)


@triton.jit
def _token_offsets(t, t64, row_tokens, stride_b, stride_t, ROWS: tl.constexpr):
    """Element offsets [T, 1] of tokens ``t`` of the launch: token t * stride_t of a flat [N, H, D] input, or with
    ROWS token t % row_tokens of row t // row_tokens of an [R, T, H, D] one (a cache append's rows, read in place)."""
    if ROWS:
        r = t // row_tokens
        off = r.to(tl.int64) * stride_b + (t - r * row_tokens).to(tl.int64) * stride_t
        out = off[:, None]
    else:
        out = t64[:, None] * stride_t
    return out


@triton.jit
def _encode_keys(kin, page, off, valid, d, keys, sqrt_d, PAGE: tl.constexpr, CFG: tl.constexpr):
    """Keys kin [BLOCK_T, DP] -> norm, codebook indices (packed) and, for prod keys, the QJL signs and residual
    norm, stored at the tokens' page offsets. Returns the norms (fp32, before rounding to the stored dtype).
    ``keys``: the key path's constants (the kernel's ``keys``: rotation, sketch and W = S Pi^T (hi, lo) pointers,
    codebook, boundaries, sign matrix)."""
    pi, s, w, cb_ptr, bnd_ptr, mt_ptr = keys
    NORM_T: tl.constexpr = tl.float32 if PAGE.NORM_F32 else tl.float16
    NB: tl.constexpr = 4 if PAGE.NORM_F32 else 2
    KFULL: tl.constexpr = PAGE.KCW == CFG.KCWP and PAGE.KCH * PAGE.KCW == PAGE.D  # no padding key chunk columns
    kc = tl.arange(0, CFG.KCWP)
    if CFG.SIGN_MMA == 1 and PAGE.KEY_MODE == K_MSE:
        # every chunk's k . M_i first: ||M k||^2 = D ||k||^2 gives the norm with no fp32 copy of k
        accs = ()
        for c in tl.static_range(PAGE.KCH):
            row = c * PAGE.KCW + kc
            m = tl.load(
                mt_ptr + d[:, None] * PAGE.D + row[None, :],
                mask=(kc[None, :] < PAGE.KCW) & (row[None, :] < PAGE.D),
                other=0.0,
            )
            accs = accs + (mma(kin, m, tl.zeros([CFG.BLOCK_T, CFG.KCWP], tl.float32), CFG.INTERP),)
        sq = tl.sum(accs[0] * accs[0], 1)
        for c in tl.static_range(1, PAGE.KCH):
            sq += tl.sum(accs[c] * accs[c], 1)
        nrm = tl.sqrt_rn(sq * (1.0 / PAGE.D))
    else:
        k = kin.to(tl.float32)
        nrm = tl.sqrt_rn(tl.sum(k * k, 1))
    if CFG.SIGN_MMA != 1 or PAGE.KEY_MODE == K_PROD:
        unit = k / tl.maximum(nrm, TINY)[:, None]
        u = _split16(unit)
        # ||r||^2 = ||unit||^2 - 2 <Pi unit, c> + ||c||^2 (Pi orthogonal): no residual tile is ever formed
        r2 = tl.sum(unit * unit, 1)
    if CFG.SIGN_MMA == 1:
        rs = nrm * sqrt_d  # (k . M_i) / rs = (Pi u)_i, M = sqrt(D) Pi = H diag(s) (entries +-1, exact in k's dtype)
    elif CFG.SIGN_MMA == 2:
        rs = tl.zeros_like(nrm) + sqrt_d  # fp32 input: the unit vector split hi + lo, each product exact
    codes = ()
    cents = ()
    cents_lo = ()
    kbyte = tl.zeros([CFG.BLOCK_T, CFG.KCWP], tl.int32)
    for c in tl.static_range(PAGE.KCH):
        row = c * PAGE.KCW + kc  # rows of Pi that give this chunk's rotated coordinates (planar chunk c)
        inside = (kc[None, :] < PAGE.KCW) & (row[None, :] < PAGE.D)
        if CFG.SIGN_MMA > 0:
            if CFG.SIGN_MMA == 1 and PAGE.KEY_MODE == K_MSE:
                acc = accs[c]
            else:
                m = tl.load(
                    mt_ptr + d[:, None] * PAGE.D + row[None, :],
                    mask=(kc[None, :] < PAGE.KCW) & (row[None, :] < PAGE.D),
                    other=0.0,
                )
            if CFG.SIGN_MMA == 1 and PAGE.KEY_MODE == K_PROD:
                acc = mma(kin, m, tl.zeros([CFG.BLOCK_T, CFG.KCWP], tl.float32), CFG.INTERP)
            elif CFG.SIGN_MMA == 2:
                acc = mma(u[1], m, mma(u[0], m, tl.zeros([CFG.BLOCK_T, CFG.KCWP], tl.float32), CFG.INTERP), CFG.INTERP)
            if CFG.SYM_SEARCH:
                code = _search_symmetric(acc, rs, bnd_ptr, PAGE.KB)
            else:
                code = _bucketize(acc * (1.0 / tl.maximum(rs, TINY))[:, None], bnd_ptr, PAGE.KB)
            if PAGE.KEY_MODE == K_PROD:
                y = acc * (1.0 / tl.maximum(rs, TINY))[:, None]
        else:
            y = _dot3(u, pi, row, d, inside & (d[:, None] < PAGE.D), PAGE.D, CFG.INTERP)
            code = _bucketize(y, bnd_ptr, PAGE.KB)
        code, kbyte, codes = _chunk_code(code, inside, kbyte, codes, c, KFULL, PAGE.KW0, PAGE.KW1)
        if PAGE.KEY_MODE == K_PROD:
            cent = tl.where(inside, tl.load(cb_ptr + code), 0.0)
            r2 += tl.sum(cent * (cent - 2.0 * y), 1)
            c_hi = cent.to(tl.float16)
            cents = cents + (c_hi,)
            if CFG.SPLIT_SKETCH:
                cents_lo = cents_lo + ((cent - c_hi.to(tl.float32)).to(tl.float16),)
    kptrs = (page + PAGE.OFF_KIDX + off * (PAGE.CH * PAGE.KB))[:, None] + kc[None, :]
    if PAGE.KB > 0:
        if PAGE.KW1 == 0:
            tl.store(kptrs, kbyte.to(tl.uint8), mask=valid[:, None] & (kc[None, :] < PAGE.KCW))
        else:
            _store_packed(
                codes,
                kptrs,
                valid[:, None] & (kc[None, :] < PAGE.KCW),
                PAGE.CH,
                PAGE.KCW,
                PAGE.KCH,
                PAGE.KW0,
                PAGE.KW1,
                PAGE.KW2,
            )
    tl.store((page + PAGE.OFF_KNORM + off * NB).to(tl.pointer_type(NORM_T)), nrm.to(NORM_T), mask=valid)
    if PAGE.KEY_MODE == K_PROD:
        _qjl_signs(u, cents, cents_lo, page, off, valid, d, s, w, PAGE, CFG)
        rn = nrm * tl.sqrt_rn(tl.maximum(r2, 0.0))
        tl.store((page + PAGE.OFF_KRNORM + off * NB).to(tl.pointer_type(NORM_T)), rn.to(NORM_T), mask=valid)
    return nrm


@triton.jit
def _encode_klt_keys(
    krow, pos, code_rows, valid, h, klt, scale, PAGE: tl.constexpr, CFG: tl.constexpr, KLT: tl.constexpr
):
    """Post-RoPE keys at element pointers ``krow`` [BLOCK_T, 1] and positions ``pos`` [BLOCK_T] -> transform codes
    (``KeyTransformCoder.quantize``), stored at byte pointers ``code_rows`` [BLOCK_T]: the centered pre-RoPE key
    x = R_p^-1 k / s - m as three tiles (rotary pairs' first halves a, second halves b [BLOCK_T, RHP], channels past
    them [BLOCK_T, RRP]: neither rotated nor scaled, as transformers' partial RoPE), then z = A x KLT_CW coefficients
    at a time (fp32-accurate products with the row blocks of head h's transposed encode matrix), each coefficient's
    nearest level, its code routed into the token's stream bytes. ``klt``: the kernel's klt constants (meta, enc,
    mid, mean, turns)."""
    meta_ptr, enc_ptr, mid_ptr, mean_ptr, turns_ptr = klt
    h64 = h.to(tl.int64)
    ia = tl.arange(0, KLT.RHP)
    ir = tl.arange(0, KLT.RRP)
    mrow = mean_ptr + h64 * PAGE.DP
    if KLT.RH > 0:  # a' = (a cos + b sin) / s, b' = (b cos - a sin) / s, angles reduced in fp64 (``rope_cos_sin``)
        amask = valid[:, None] & (ia < KLT.RH)[None, :]
        a = tl.load(krow + ia[None, :], mask=amask, other=0.0).to(tl.float32)
        b = tl.load(krow + KLT.RH + ia[None, :], mask=amask, other=0.0).to(tl.float32)
        cos, sin = rope_cos_sin(pos[:, None], tl.load(turns_ptr + ia)[None, :])
        s = tl.zeros_like(a) + scale
        xa = tl.math.div_rn(a * cos + b * sin, s) - tl.load(mrow + ia, mask=ia < KLT.RH, other=0.0)[None, :]
        xb = tl.math.div_rn(b * cos - a * sin, s) - tl.load(mrow + KLT.RH + ia, mask=ia < KLT.RH, other=0.0)[None, :]
    if KLT.RR > 0:
        xr = tl.load(krow + 2 * KLT.RH + ir[None, :], mask=valid[:, None] & (ir < KLT.RR)[None, :], other=0.0)
        xr = xr.to(tl.float32) - tl.load(mrow + 2 * KLT.RH + ir, mask=ir < KLT.RR, other=0.0)[None, :]
    cc = tl.arange(0, CFG.KLT_CW)
    meta = meta_ptr + h64 * (2 * PAGE.DP)
    stream = tl.zeros([CFG.BLOCK_T, CFG.KCBP], tl.float32)  # the codes' bytes, summed piece by piece
    STEPS: tl.constexpr = (PAGE.D + CFG.KLT_CW - 1) // CFG.KLT_CW
    for c in range(STEPS):  # a loop, not unrolled: one step's encode block and thresholds live at a time
        col = c * CFG.KLT_CW + cc
        erow = enc_ptr + h64 * (PAGE.DP * PAGE.DP) + col[None, :]  # enc[h][channel, col]: channel-major rows
        z = tl.zeros([CFG.BLOCK_T, CFG.KLT_CW], tl.float32)
        if KLT.RH > 0:
            ea = tl.load(erow + ia[:, None] * PAGE.DP, mask=(ia < KLT.RH)[:, None], other=0.0)
            z = tl.dot(xa, ea, z, input_precision=CFG.KLT_DOT)
            eb = tl.load(erow + (KLT.RH + ia[:, None]) * PAGE.DP, mask=(ia < KLT.RH)[:, None], other=0.0)
            z = tl.dot(xb, eb, z, input_precision=CFG.KLT_DOT)
        if KLT.RR > 0:
            er = tl.load(erow + (2 * KLT.RH + ir[:, None]) * PAGE.DP, mask=(ir < KLT.RR)[:, None], other=0.0)
            z = tl.dot(xr, er, z, input_precision=CFG.KLT_DOT)
        idx = _nearest_level(z, mid_ptr + (h64 * PAGE.D + tl.where(col < PAGE.D, col, 0)) * 255, CFG.KLT_STEPS)
        stream = _route_code_bytes(idx, tl.load(meta + col), tl.load(meta + PAGE.DP + col), stream, CFG)
    q = tl.arange(0, CFG.KCBP)
    tl.store(
        code_rows[:, None] + q[None, :],
        stream.to(tl.int32).to(tl.uint8),
        mask=valid[:, None] & (q < PAGE.KCB)[None, :],
    )


@triton.jit
def _nearest_level(z, rows, STEPS: tl.constexpr):
    """Per coefficient of z [N, C] the number of its thresholds below it (rows [C]: each coefficient's sorted
    thresholds, +inf past the used ones): a binary search of STEPS steps (2^STEPS - 1 thresholds reachable), as
    ``KeyTransformCoder._nearest_level``; NaN counts none, +inf every used one."""
    idx = tl.zeros(z.shape, tl.int32)
    for s in tl.static_range(STEPS):
        cand = idx + (1 << (STEPS - 1 - s))
        idx = tl.where(tl.load(rows[None, :] + (cand - 1)) < z, cand, idx)
    return idx


@triton.jit
def _route_code_bytes(codes, bo, w, stream, CFG: tl.constexpr):
    """``stream`` [N, KCBP] (fp32 byte values) plus codes [N, C] packed LSB-first (coefficient i: ``w[i]`` bits from
    stream bit ``bo[i]``; w = 0: nothing). A code spans at most two bytes and the pieces in one byte hold disjoint
    bits, so a byte is the sum of its pieces: two products with 0/1 matrices that route each code's low and high
    piece to its byte (fp16 integers <= 255, fp32 sums: exact)."""
    shifted = tl.where((w > 0)[None, :], codes, 0) << (bo & 7)[None, :]  # < 2^15
    q = tl.arange(0, CFG.KCBP)
    byte = (bo >> 3)[:, None]
    stream = mma((shifted & 255).to(tl.float16), (byte == q[None, :]).to(tl.float16), stream, CFG.INTERP)
    return mma((shifted >> 8).to(tl.float16), (byte + 1 == q[None, :]).to(tl.float16), stream, CFG.INTERP)


@triton.jit
def _qjl_signs(u, cents, cents_lo, page, off, valid, d, s, w, PAGE: tl.constexpr, CFG: tl.constexpr):
    """Store the signs of the residual's sketch S r = S unit - (S Pi^T) c, one bit plane per chunk of CH sketch rows
    (8 planes), from the unit keys ``u`` (hi, lo) and their centroids (``cents``, + lo parts when SPLIT_SKETCH);
    ``s``, ``w``: the (hi, lo) pointers of S and W = S Pi^T."""
    s_hi_ptr = s[0]
    w_hi_ptr, w_lo_ptr = w
    kc = tl.arange(0, CFG.KCWP)
    sc = tl.arange(0, CFG.CHP)
    sbyte = tl.zeros([CFG.BLOCK_T, CFG.CHP], tl.int32)
    for c in tl.static_range(8):
        row = c * PAGE.CH + sc
        # exact (default): hi+lo split products, ~22 bits, so a sign differs from the fp32 reference
        # only where (S r)_i is within ~1e-6 of 0. Fast (KB <= 2 only): one fp16 product per term.
        smask = (sc[None, :] < PAGE.CH) & (row[None, :] < PAGE.D) & (d[:, None] < PAGE.D)
        if CFG.SPLIT_SKETCH:
            sk = _dot3(u, s, row, d, smask, PAGE.D, CFG.INTERP)
        else:
            s_hi = tl.load(s_hi_ptr + row[None, :] * PAGE.D + d[:, None], mask=smask, other=0.0)
            sk = mma(u[0], s_hi, tl.zeros([CFG.BLOCK_T, CFG.CHP], tl.float32), CFG.INTERP)
        for c2 in tl.static_range(PAGE.KCH):
            kr = c2 * PAGE.KCW + kc  # W^T block: rows = chunk c2 coordinates, cols = sketch rows of chunk c
            wmask = (
                (kc[:, None] < PAGE.KCW) & (kr[:, None] < PAGE.D) & (sc[None, :] < PAGE.CH) & (row[None, :] < PAGE.D)
            )
            w_off = row[None, :] * PAGE.D + kr[:, None]
            w_hi = tl.load(w_hi_ptr + w_off, mask=wmask, other=0.0)
            sk = mma(cents[c2], -w_hi, sk, CFG.INTERP)
            if CFG.SPLIT_SKETCH:
                w_lo = tl.load(w_lo_ptr + w_off, mask=wmask, other=0.0)
                sk = mma(cents[c2], -w_lo, sk, CFG.INTERP)
                sk = mma(cents_lo[c2], -w_hi, sk, CFG.INTERP)
        sbyte |= ((sk >= 0) & (row[None, :] < PAGE.D)).to(tl.int32) << c
    tl.store(
        (page + PAGE.OFF_KSGN + off * PAGE.CH)[:, None] + sc[None, :],
        sbyte.to(tl.uint8),
        mask=valid[:, None] & (sc[None, :] < PAGE.CH),
    )


@triton.jit
def _encode_values(v, page, off, valid, d, values, PAGE: tl.constexpr, CFG: tl.constexpr):
    """TurboQuant_mse values v [BLOCK_T, DP] (padding columns zero) -> norm and the codebook indices of the rotated
    unit vector Pi_v v / ||v|| (values' own rotation and codebook), stored packed at the tokens' page offsets. Each
    value chunk's rotated coordinates come from hi+lo split products with the chunk's rows of Pi_v (the dense key
    path's ``_dot3``, ~22 bits, for both rotation kinds), so a code differs from the reference only where the
    coordinate is within rounding of a boundary. Returns the norms (fp32, before rounding to the stored dtype).
    ``values``: (Pi_v's (hi, lo) pointers, the value codebook's decision boundaries)."""
    vpi, vbnd_ptr = values
    NORM_T: tl.constexpr = tl.float32 if PAGE.NORM_F32 else tl.float16
    NB: tl.constexpr = 4 if PAGE.NORM_F32 else 2
    VFULL: tl.constexpr = PAGE.VCW == CFG.VCWP and PAGE.VCH * PAGE.VCW == PAGE.D  # no padding chunk columns
    vf = v.to(tl.float32)
    nrm = tl.sqrt_rn(tl.sum(vf * vf, 1))
    u = _split16(vf / tl.maximum(nrm, TINY)[:, None])
    vc = tl.arange(0, CFG.VCWP)
    codes = ()
    vbyte = tl.zeros([CFG.BLOCK_T, CFG.VCWP], tl.int32)
    for c in tl.static_range(PAGE.VCH):
        row = c * PAGE.VCW + vc  # rows of Pi_v that give this chunk's rotated coordinates (planar chunk c)
        inside = (vc[None, :] < PAGE.VCW) & (row[None, :] < PAGE.D)
        y = _dot3(u, vpi, row, d, inside & (d[:, None] < PAGE.D), PAGE.D, CFG.INTERP)
        code, vbyte, codes = _chunk_code(
            _bucketize(y, vbnd_ptr, PAGE.VB), inside, vbyte, codes, c, VFULL, PAGE.VW0, PAGE.VW1
        )
    vptrs = (page + PAGE.OFF_VIDX + off * (PAGE.CH * PAGE.VB))[:, None] + vc[None, :]
    vmask = valid[:, None] & (vc[None, :] < PAGE.VCW)
    if PAGE.VW1 == 0:
        tl.store(vptrs, vbyte.to(tl.uint8), mask=vmask)
    else:
        _store_packed(codes, vptrs, vmask, PAGE.CH, PAGE.VCW, PAGE.VCH, PAGE.VW0, PAGE.VW1, PAGE.VW2)
    tl.store((page + PAGE.OFF_VNORM + off * NB).to(tl.pointer_type(NORM_T)), nrm.to(NORM_T), mask=valid)
    return nrm


@triton.jit
def _quantize_values(vsrc, h, valid, page, off, PAGE: tl.constexpr, CFG: tl.constexpr):
    """Group-quantize and store values from the packing's chunk tiles [BLOCK_T, VCWP] (loaded once, no re-layout):
    min/max across whole chunks, one reciprocal per row and group instead of a division per element, and
    round-half-even by adding 1.5 * 2^23 (codes differ from the reference only at ties). Returns per token (CHECK)
    bit 0: a group's |minimum| or, with a V_ABS bound, |maximum| past its bound, bit 1: a group scale past VALUE_GROUP;
    under CHECK the minimum and maximum carry NaN, so a non-finite value sets one of them (0 without CHECK).
    ``vsrc``: the values' (pointer, token offsets [BLOCK_T, 1], head stride), KV head ``h``."""
    v_ptr, voff, stride_vh = vsrc
    LEVELS: tl.constexpr = (1 << PAGE.VB) - 1
    vc = tl.arange(0, CFG.VCWP)
    vt = ()
    for c in tl.static_range(PAGE.VCH):
        col = c * PAGE.VCW + vc
        vt = vt + (
            tl.load(
                v_ptr + voff + h * stride_vh + col[None, :],
                mask=valid[:, None] & (vc[None, :] < PAGE.VCW) & (col[None, :] < PAGE.D),
                other=0.0,
            ).to(tl.float32),
        )
    inv = ()
    zinv = ()
    srow = (page + PAGE.OFF_VSCALE + off * (2 * PAGE.NG)).to(tl.pointer_type(tl.float16))
    zrow = (page + PAGE.OFF_VZERO + off * (2 * PAGE.NG)).to(tl.pointer_type(tl.float16))
    gbad = tl.zeros([CFG.BLOCK_T], tl.int32)
    NAN: tl.constexpr = tl.PropagateNan.ALL if CFG.CHECK else tl.PropagateNan.NONE
    for gi in tl.static_range(PAGE.NG):
        lo2 = tl.full([CFG.BLOCK_T, CFG.VCWP], float("inf"), tl.float32)
        hi2 = tl.full([CFG.BLOCK_T, CFG.VCWP], float("-inf"), tl.float32)
        for c in tl.static_range(PAGE.VCH):
            if _whole_chunk(c, gi, PAGE.VCW, CFG.VCWP, PAGE.GROUP, PAGE.D):
                lo2 = tl.minimum(lo2, vt[c], propagate_nan=NAN)
                hi2 = tl.maximum(hi2, vt[c], propagate_nan=NAN)
            elif _overlaps(c, gi, PAGE.VCW, PAGE.GROUP):
                col = c * PAGE.VCW + vc
                ing = ((col // PAGE.GROUP == gi) & (vc < PAGE.VCW) & (col < PAGE.D))[None, :]
                lo2 = tl.minimum(lo2, tl.where(ing, vt[c], float("inf")), propagate_nan=NAN)
                hi2 = tl.maximum(hi2, tl.where(ing, vt[c], float("-inf")), propagate_nan=NAN)
        if CFG.CHECK:
            lo = tl.reduce(lo2, 1, _min_nan)
            hi = tl.reduce(hi2, 1, _max_nan)
            gbad |= tl.where(
                ~(tl.abs(lo) <= CFG.VALUE_GROUP) | ~(tl.abs(lo) <= CFG.V_ABS) | ~(tl.abs(hi) <= CFG.V_ABS), 1, 0
            )
            gbad |= tl.where(
                ~(tl.math.div_rn(hi - lo, tl.zeros([CFG.BLOCK_T], tl.float32) + LEVELS) <= CFG.VALUE_GROUP), 2, 0
            )
            zero = lo.to(tl.float16)
        else:
            zero = tl.min(lo2, 1).to(tl.float16)
            hi = tl.max(hi2, 1)
        scale = tl.math.div_rn(hi - zero.to(tl.float32), tl.zeros([CFG.BLOCK_T], tl.float32) + LEVELS)
        scale = scale.to(tl.float16)
        tl.store(srow + gi, scale, mask=valid)
        tl.store(zrow + gi, zero, mask=valid)
        r = 1.0 / tl.where(scale > 0, scale.to(tl.float32), 1.0)  # the reference divides by the scale (1 if 0)
        inv = inv + (r,)
        zinv = zinv + (zero.to(tl.float32) * r,)
    vcodes = ()
    for c in tl.static_range(PAGE.VCH):
        col = c * PAGE.VCW + vc
        if _whole_chunk(c, (c * PAGE.VCW) // PAGE.GROUP, PAGE.VCW, CFG.VCWP, PAGE.GROUP, PAGE.D):
            pos = vt[c] * inv[(c * PAGE.VCW) // PAGE.GROUP][:, None] - zinv[(c * PAGE.VCW) // PAGE.GROUP][:, None]
        else:
            cg = (col // PAGE.GROUP)[None, :]
            r2d = tl.zeros([CFG.BLOCK_T, CFG.VCWP], tl.float32)
            z2d = tl.zeros([CFG.BLOCK_T, CFG.VCWP], tl.float32)
            for gi in tl.static_range(PAGE.NG):
                r2d = tl.where(cg == gi, inv[gi][:, None], r2d)
                z2d = tl.where(cg == gi, zinv[gi][:, None], z2d)
            pos = vt[c] * r2d - z2d
        if not CFG.V_FP16:  # fp16 values: zero is their exact minimum, so v - zero >= 0 (no lower clamp)
            pos = tl.maximum(pos, 0.0)
        pos = tl.minimum(pos, LEVELS)
        q = (pos + ROUND_MAGIC).to(tl.int32, bitcast=True) & LEVELS  # + 1.5 * 2^23 rounds half to even
        vcodes = vcodes + (tl.where(((vc < PAGE.VCW) & (col < PAGE.D))[None, :], q, 0),)
    _store_packed(
        vcodes,
        (page + PAGE.OFF_VCODES + off * (PAGE.CH * PAGE.VB))[:, None] + vc[None, :],
        valid[:, None] & (vc[None, :] < PAGE.VCW),
        PAGE.CH,
        PAGE.VCW,
        PAGE.VCH,
        PAGE.VW0,
        PAGE.VW1,
        PAGE.VW2,
    )
    return gbad
