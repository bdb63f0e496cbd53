"""What every kernel launcher shares: the compile-time description of a page, cached device constants,
cached workspaces, and the Triton interpreter switch.

Kernels take a page's layout as one ``tl.constexpr`` bundle (``PAGE``: field offsets, bit widths, modes), so one
compiled kernel serves one format; ``format.PageSpec`` (the format's own view of a page) gives those values —
nothing here re-derives a byte count. ``constexpr_bundle`` turns any frozen dataclass of compile-time facts (the
page spec, a kernel's own tile shapes and code paths) into that form: a named tuple of ``tl.constexpr`` values with
the dataclass's field names, which a ``@triton.jit`` function reads as ``PAGE.D`` and hands on to its helpers whole.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from typing import Any

import torch
import triton.language as tl

from ..codec.klt import code_offsets, codes_in_one_byte
from ..codec.kv import KVCodec
from ..codec.mse import TurboQuantMSE
from ..errors import UnsupportedPlatformError
from ..format import (  # noqa: F401 (re-used by kernels)
    KEY_KLT,
    KEY_MSE,
    KEY_PROD,
    KEY_RAW,
    VAL_GROUP,
    VAL_MSE,
    VAL_RAW,
    PagedLayout,
    PageSpec,
    kernel_unsupported_reason,
    next_pow2,
)

#: True when kernels run through Triton's CPU interpreter (``TRITON_INTERPRET=1`` before import).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: Scores are kept in the log2 domain (``exp2``): the query is scaled by softmax_scale * log2(e) once.
LOG2E = 1.4426950408889634


def _patch_interpreter() -> None:
    """Triton 3.6's interpreter calls int() on 1-element arrays, a TypeError since NumPy 2.4
    (triton-lang/triton#9171, fixed upstream after 3.6): convert the one element explicitly."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor
    if getattr(original, "_jetson_tq_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._jetson_tq_fixed = True
    interp._patch_lang_tensor = patched


if INTERPRET:
    _patch_interpreter()


# ------------------------------------------------------------------ compile-time bundles
# Module-level memos of pure functions of immutable inputs (a dataclass type; a layout, format, head dim and dtype):
# no tensors, one small entry per format, the same answer for every plan that asks, so no plan owns them.
_BUNDLE_TYPES: dict[type, type] = {}
_PAGE_SPECS: dict = {}


def constexpr_bundle(facts) -> tuple:
    """A frozen dataclass instance as one kernel ``tl.constexpr``: a named tuple of ``tl.constexpr`` values whose
    field names are the dataclass's (Triton 3.6 takes a named tuple of constexprs as a constexpr argument, reads its
    fields as constexprs and passes it to ``@triton.jit`` helpers whole; a dataclass it refuses). Under the CPU
    interpreter the values stay plain Python ones."""
    cls = type(facts)
    bundle = _BUNDLE_TYPES.get(cls)
    if bundle is None:
        bundle = _BUNDLE_TYPES[cls] = collections.namedtuple(
            cls.__name__ + "Bundle", [f.name for f in dataclasses.fields(cls)]
        )
    if INTERPRET:  # the interpreter runs the kernel as Python: plain values (``int << constexpr`` has no operator)
        return bundle(*(getattr(facts, f) for f in bundle._fields))
    return bundle(*(tl.constexpr(getattr(facts, f)) for f in bundle._fields))


def page_spec(layout: PagedLayout, codec: KVCodec) -> tuple[PageSpec, tuple]:
    """(PageSpec of ``layout`` with ``codec``'s raw dtype, its constexpr bundle), made once per format: launchers
    run every decode step."""
    key = (layout, codec.fmt, codec.head_dim, codec.raw_dtype)
    if key not in _PAGE_SPECS:
        spec = PageSpec.of(layout, codec.raw_dtype)
        _PAGE_SPECS[key] = (spec, constexpr_bundle(spec))
    return _PAGE_SPECS[key]


# ------------------------------------------------------------------ cached device constants / buffers
# Shared by every plan on purpose, so module-level rather than on a plan:
# - _CONSTANTS / _KLT_CONSTANTS: device copies of a codec's matrices and tables, read by every decode, prefill and
#   write plan of that codec: one copy per codec and device, not one per plan and shape;
# - _WORKSPACES: scratch buffers by size class, which every plan of a name views: one set for all layers (a launch
#   writes what it reads; counters are left at zero), where per-shape buffers grew a server's memory by 16.5 GB under
#   ragged load (``workspace``).
_CONSTANTS: dict = {}
_KLT_CONSTANTS: dict = {}
_WORKSPACES: dict = {}


def codec_constants(codec: KVCodec, device: torch.device) -> dict[str, torch.Tensor]:
    """fp32 device copies of the codec's matrices and codebook (made once per codec and device).

    ``qmat``: [Pi; S] (prod), Pi (mse) or I (fp16 keys) — rows transform a query once; ``qmat16``: it as an fp16
    (hi, lo) pair [2, QW, D] for fp16 queries;
    ``pi``, ``s``: rotation and sketch for the write path; ``codebook``/``bounds``: the key centroids and
    their decision boundaries (``codebook_host``: the centroids on the host, for host-side tables); ``kfit``: the
    codebook as c[k] = alpha + beta k + gamma (k >> 1) when it is one (``_linear_codebook_fit``);
    ``hsigns``: the Hadamard rotation's signs (one zero when it is dense).
    mse values (placeholders otherwise): ``vpi`` their own rotation Pi_v (fp32 [D, D], seeded by ``value_seed``),
    ``vwrite`` it as an fp16 (hi, lo) pair for the write kernel, ``vcodebook`` / ``vbounds`` their centroids (at
    least 4 entries) and decision boundaries.
    """
    key = (codec.fmt, codec.head_dim, codec.seed, device)
    if key not in _CONSTANTS:
        d = codec.head_dim
        qmat = codec.query_matrix("cpu")
        out = {"qmat": qmat.float().contiguous().to(device), "qmat16": torch.stack(_split16(qmat.double(), device))}
        if codec.keys is not None:
            out["pi"] = codec.key_rotation.matrix("cpu").float().contiguous().to(device)
        else:
            out["pi"] = torch.eye(d, device=device)
        sketch = getattr(codec.keys, "sketch_matrix", None)
        out["s"] = sketch("cpu").float().contiguous().to(device) if sketch else torch.zeros(1, device=device)
        cb = codec.key_codebook
        if cb is None:
            cb = torch.zeros(2)
        cb = cb.float()
        out["kfit"] = _linear_codebook_fit(cb)
        rot = codec.key_rotation
        hadamard = rot is not None and rot.kind == "hadamard"
        out["hsigns"] = (rot.hadamard_signs().float() if hadamard else torch.zeros(1)).contiguous().to(device)
        out["write_mats"] = _write_matrices(codec, device)
        out["bounds"] = (0.5 * (cb[1:] + cb[:-1]) if cb.numel() > 1 else torch.zeros(1)).contiguous().to(device)
        # at least 4 entries: kernels read c0..c3 unconditionally for their 1-2 bit select paths
        padded = torch.nn.functional.pad(cb, (0, max(0, 4 - cb.numel()))).contiguous()
        out["codebook"] = padded.to(device)
        out["codebook_host"] = padded  # for host-side tables (``nibble_lut_asm``): no device read, no sync, per plan
        out.update(_value_constants(codec, device))
        _CONSTANTS[key] = out
    return _CONSTANTS[key]


@dataclasses.dataclass(frozen=True)
class KltSpec:
    """Compile-time facts of a layer's transform-coded keys (``codec.klt``) that kernels are specialized on, as the
    ``KLT`` bundle: RoPE rotates pairs (i, RH + i) for i < RH; the RR channels past 2 RH are not rotated. Tiles of
    those parts are RHP / RRP wide (powers of two, at least 16: ``tl.dot`` operands). ``ONE_BYTE``: every code lies
    inside one byte (``codec.klt.codes_in_one_byte``): one byte a code. ``SELECT``: a tile's code bytes are loaded
    once as [KCBP, N] and each coefficient's byte picked from them by a one-hot int8 ``tl.dot`` (else: a byte load
    per coefficient and token). ``CUBIC``: every coefficient's levels are a cubic of its centered code
    u = 2c - (2^w - 1) (``KeyTransform.cubic_levels``): the kernels compute them by three FMAs (the constant term
    folded into the mean, ``klt_constants``), with no level table. ``DIAGONAL``: every decode matrix is diagonal
    (``KeyTransform.decode_is_diagonal``): the decode kernel reads each channel's levels, its scale folded into
    them, and adds the mean (no decode product, no decode-matrix operand); prefill keeps the general read."""

    RH: int  # rotary pairs (rotary_dim / 2)
    RHP: int
    RR: int  # channels past the rotary ones
    RRP: int
    ONE_BYTE: bool = False
    CUBIC: bool = False
    KCBP: int = 32  # a key code's bytes padded to a power of two >= 32 (an int8 ``tl.dot``'s K)
    SELECT: bool = True  # code bytes picked by a one-hot int8 product from one [KCBP, N] tile (off: a load each)
    SINK: bool = False  # compressed position 0 reads the layer's calibrated sink (``KeyTransform.sink_key``)
    DIAGONAL: bool = False  # decode matrices diagonal: decode reads channels directly (``klt_constants``' decode_read)

    @staticmethod
    def of(
        rotary_dim: int,
        head_dim: int,
        code_bytes: int,
        one_byte: bool = False,
        cubic: bool = False,
        sink: bool = False,
        diagonal: bool = False,
    ) -> KltSpec:
        rh, rr = rotary_dim // 2, head_dim - rotary_dim
        return KltSpec(
            RH=rh,
            RHP=max(16, next_pow2(max(rh, 1))),
            RR=rr,
            RRP=max(16, next_pow2(max(rr, 1))),
            ONE_BYTE=one_byte,
            CUBIC=cubic,
            KCBP=max(32, next_pow2(code_bytes)),
            SINK=sink,
            DIAGONAL=diagonal,
        )


#: A spec for formats without klt keys (kernels take the bundle whole and ignore it).
NO_KLT = KltSpec(RH=0, RHP=16, RR=0, RRP=16)


def klt_constants(codec: KVCodec, device: torch.device) -> dict:
    """Device copies of a klt codec's transform in the layouts the kernels read (made once per codec and device):

    ``meta`` int32 [H, 2, DP]: each coefficient's first bit in a key's LSB-first code (row 0) and its width (row 1);
    ``levels`` fp32 [H, D, 256]; ``dec`` fp16 [H, DP, DP]: the decode matrix transposed (row = coefficient, column =
    channel), so a tile of levels [N, DP] @ dec[h] is the pre-RoPE keys; ``poly`` fp32 [H, 3, DP]: cubic levels'
    linear, square and cube coefficients (``KltSpec.CUBIC``; their constant terms are in ``mean``; else zero);
    ``enc`` fp32 [H, DP, DP]: the encode matrix transposed, so pre-RoPE keys [N, DP] @ enc[h] are the coefficients;
    ``mid`` fp32 [H, D, 255]: the decision thresholds between used levels (+inf past them); ``mean`` fp32 [H, DP];
    ``turns`` fp64 [RHP]: the RoPE frequencies in turns per position (inv_freq / 2 pi: ``rope_cos_sin`` reduces
    angles exactly); ``scale``: RoPE's attention scaling; ``read``: the read kernels' arguments (meta, levels or with
    ``CUBIC`` poly, dec, mean, turns, scale); ``decode_read``: the decode kernel's, the same but with ``CUBIC`` the
    cubic in y = (c - 2^(w-1)) / 2^(w-1) (``half_code_cubic``): ``vpoly`` fp32 [H, 5, DP] (linear, square and cube
    coefficients, the map (m, k) of x = 1024 + c to y) and ``vmean`` fp32 [H, DP] (the mean with the y-cubic's
    constants folded in); with ``DIAGONAL`` (decode matrices diagonal) the decode kernel's levels (the level
    tables or ``vpoly``) are scaled by the decode matrix's diagonal (each level a key channel's, less the mean);
    ``sink`` fp32 [2, H, D]: the calibrated sink's key and value (``KltSpec.SINK``; else a placeholder), ``sink16``
    the same in fp16 (the prefill workspace); ``bundle``: the ``KltSpec`` as a constexpr bundle. Padding entries
    are zero. A codec without klt keys gets placeholders of the same dtypes and ``NO_KLT``."""
    coder = codec.key_coder
    key = (id(coder), str(device))
    hit = _KLT_CONSTANTS.get(key)
    if hit is not None and hit[0] is coder:
        return hit[1]
    if coder is None:
        one = {dt: torch.zeros(1, dtype=dt, device=device) for dt in (torch.int32, torch.float32, torch.float16)}
        turns0 = torch.zeros(1, dtype=torch.float64, device=device)
        empty: dict[str, Any] = {
            "read": (one[torch.int32], one[torch.float32], one[torch.float16], one[torch.float32], turns0, 1.0),
            "decode_read": (one[torch.int32], one[torch.float32], one[torch.float16], one[torch.float32], turns0, 1.0),
            "sink": one[torch.float32],
            "sink16": one[torch.float16],
            "bundle": constexpr_bundle(NO_KLT),
        }
        _KLT_CONSTANTS[key] = (coder, empty)
        return empty
    t = coder.t.to("cpu")
    h, d = t.num_heads, t.head_dim
    dp = max(16, next_pow2(d))
    bits = t.bits.long()
    meta = torch.zeros(h, 2, dp, dtype=torch.int32)
    meta[:, 0, :d] = code_offsets(bits).int()
    meta[:, 1, :d] = bits.int()

    def padded(m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        full = torch.zeros(h, dp, dp, dtype=torch.float64)
        full[:, :d, :d] = m.double()
        return full.to(dtype).contiguous().to(device)

    cubic = t.cubic_levels()
    diagonal = t.decode_is_diagonal
    scale = torch.diagonal(t.decode.double(), dim1=1, dim2=2)  # [H, D]: each channel's scale when ``diagonal``
    center = t.mean.double()
    poly = torch.zeros(h, 3, dp, dtype=torch.float32)
    vpoly = torch.zeros(h, 5, dp, dtype=torch.float32)
    vcenter = center
    if cubic is not None:
        center = center + torch.einsum("hij,hj->hi", t.decode.double(), cubic[..., 0])
        poly[:, :, :d] = cubic[..., 1:].transpose(1, 2).float()
        vcub, ymap = half_code_cubic(cubic, bits)
        vcenter = vcenter + torch.einsum("hij,hj->hi", t.decode.double(), vcub[..., 0])
        vpoly[:, :3, :d] = (vcub[..., 1:] * (scale[..., None] if diagonal else 1.0)).transpose(1, 2).float()
        vpoly[:, 3:, :d] = ymap.transpose(1, 2).float()
    spec = KltSpec.of(
        t.rotary.rotary_dim,
        d,
        coder.code_bytes,
        one_byte=codes_in_one_byte(bits),
        cubic=cubic is not None,
        sink=t.has_sink,
        diagonal=diagonal,
    )
    sink = torch.zeros(1)
    if t.sink_key is not None and t.sink_value is not None:
        sink = torch.stack([t.sink_key, t.sink_value]).float().contiguous()
    turns = torch.zeros(spec.RHP, dtype=torch.float64)
    turns[: spec.RH] = t.rotary.inv_freq.double() / (2 * math.pi)
    mean = torch.zeros(h, dp, dtype=torch.float32)
    mean[:, :d] = center.float()
    vmean = torch.zeros(h, dp, dtype=torch.float32)
    vmean[:, :d] = vcenter.float()
    out: dict[str, Any] = {
        "meta": meta.to(device),
        "levels": t.levels.float().contiguous().to(device),
        "dec": padded(t.decode.transpose(1, 2), torch.float16),
        "poly": poly.to(device),
        "enc": padded(t.encode.transpose(1, 2), torch.float32),
        "mid": coder.thresholds.to("cpu").float().contiguous().to(device),
        "mean": mean.to(device),
        "turns": turns.to(device),
        "scale": float(t.rotary.attention_scaling),
        "sink": sink.to(device),
        "sink16": sink.half().to(device),
        "spec": spec,
        "bundle": constexpr_bundle(spec),
    }
    levels = out["poly"] if spec.CUBIC else out["levels"]  # what ``_tiles.klt_levels`` reads
    out["read"] = (out["meta"], levels, out["dec"], out["mean"], out["turns"], out["scale"])
    if spec.CUBIC:  # decode computes the cubic in fp16 of y = (c - 2^(w-1)) / 2^(w-1) (``_tiles.klt_levels16``)
        out["vpoly"], out["vmean"] = vpoly.to(device), vmean.to(device)
        out["decode_read"] = (out["meta"], out["vpoly"], out["dec"], out["vmean"], out["turns"], out["scale"])
    elif diagonal:  # level tables in key units: each channel's levels times its scale
        dlevels = (t.levels.double() * scale[..., None]).float().contiguous().to(device)
        out["decode_read"] = (out["meta"], dlevels, out["dec"], out["mean"], out["turns"], out["scale"])
    else:
        out["decode_read"] = out["read"]
    _KLT_CONSTANTS[key] = (coder, out)
    return out


def half_code_cubic(cubic: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cubic levels a + s u + r u^2 + t u^3 of the centered code u = 2c - (2^w - 1) (``KeyTransform.cubic_levels``,
    [H, D, 4] float64) rewritten in y = (c - 2^(w-1)) / 2^(w-1) = (u - 1) / 2^w in [-1, 1): coefficients [H, D, 4]
    (constant, linear, square, cube; all of the levels' own size, so fp16 keeps them normal: in v = c - 2^(w-1) the
    cube's coefficient of an 8-bit code is ~1e-6, an fp16 subnormal, and the levels were off by 6e-2) and the map from
    x = 1024 + c to y = x m - k, (m, k) = (2^(1-w), 2^(11-w) + 1) [H, D, 2] ((1, 1024) at 0 bits: y = 0).
    Why: the decode kernel makes x with no conversion instruction (the fp16 bit pattern 0x6400 | c is 1024 + c), y by
    one exact fp16 FMA, and the cubic's three FMAs run two codes at a time in fp16 (HFMA2)."""
    a, s, r, t = cubic.unbind(-1)
    coded = bits > 0
    h = torch.exp2((bits.double() - 1).clamp_min(0))  # u = 2 h y + 1
    out = torch.stack([a + s + r + t, (2 * s + 4 * r + 6 * t) * h, (4 * r + 12 * t) * h**2, 8 * t * h**3], -1)
    out = torch.where(coded[..., None], out, torch.stack([a, 0 * a, 0 * a, 0 * a], -1))
    m = torch.where(coded, 1 / h, 1.0)
    k = torch.where(coded, 1024 / h + 1, 1024.0)
    return out, torch.stack([m, k], -1)


def _split16(m: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 (hi, lo) with hi + lo = m to ~22 bits (m in float64)."""
    hi = m.to(torch.float16)
    lo = (m - hi.double()).to(torch.float16)
    return hi.contiguous().to(device), lo.contiguous().to(device)


def _write_matrices(codec: KVCodec, device) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """((Pi_hi, Pi_lo), (S_hi, S_lo), (W_hi, W_lo)) in fp16 for the write kernel, W = S Pi^T (sketch of the residual
    = S u - W c)."""
    d = codec.head_dim
    pi = codec.key_rotation.matrix64() if codec.keys is not None else torch.eye(d, dtype=torch.float64)
    sketch = getattr(codec.keys, "sketch_matrix", None)
    s = sketch("cpu", torch.float64) if sketch else torch.zeros(d, d, dtype=torch.float64)
    return _split16(pi, device), _split16(s, device), _split16(s @ pi.T, device)


def _value_constants(codec: KVCodec, device) -> dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """``vpi``, ``vwrite``, ``vcodebook``, ``vbounds`` of ``codec_constants`` (one-element zeros unless values are
    TurboQuant_mse)."""
    values = codec.values
    if codec.fmt.value_mode != "mse" or not isinstance(values, TurboQuantMSE):
        zero = torch.zeros(1, device=device)
        return {"vpi": zero, "vwrite": (zero.half(), zero.half()), "vcodebook": zero, "vbounds": zero}
    pi = values.rotation.matrix64()
    cb = values.codebook.float()
    bounds = values.boundaries.float() if cb.numel() > 1 else torch.zeros(1)
    return {
        "vpi": pi.float().contiguous().to(device),
        "vwrite": _split16(pi, device),
        "vcodebook": torch.nn.functional.pad(cb, (0, max(0, 4 - cb.numel()))).contiguous().to(device),
        "vbounds": bounds.contiguous().to(device),
    }


def _linear_codebook_fit(cb: torch.Tensor) -> tuple[float, float, float] | None:
    """(alpha, beta, gamma) with c[k] = alpha + beta*k + gamma*(k >> 1) exactly, or None.

    Every evenly spaced codebook fits with gamma = 0 (``uniform`` keys, any size), and so does every
    2-entry one; a 4-entry codebook fits with gamma != 0 when c3 - c2 - c1 + c0 = 0, which every
    symmetric (Lloyd-Max) one does. Kernels then score <q, c[idx]> as one or two dots with bit planes
    instead of a per-element lookup.
    """
    c = [float(x) for x in cb]
    tol = 1e-6 * max(abs(x) for x in c)
    step = (c[-1] - c[0]) / max(len(c) - 1, 1)
    if len(c) >= 2 and all(abs(c[k] - c[0] - k * step) <= tol for k in range(len(c))):
        return c[0], step, 0.0
    if len(c) == 4 and abs(c[3] - c[2] - c[1] + c[0]) <= tol:
        return c[0], c[1] - c[0], c[2] + c[0] - 2 * c[1]
    return None


def workspace(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, zeroed: bool = False
) -> torch.Tensor:
    """A scratch tensor of ``shape``: a leading-dim view of a buffer cached by (name, size class, trailing dims,
    dtype, device), the size class being ``shape[0]`` rounded up to a power of two. Allocated on first use of a
    class only, so a launch after warm-up allocates nothing (CUDA-graph capturable), and the buffers of one name
    hold at most twice its largest shape whatever the number of distinct shapes (per-shape buffers grew the H200
    server's memory by 16.5 GB under ragged load). Contents are not preserved, except that a ``zeroed`` one starts
    at zero (kernels that need zeros leave it so)."""
    lead = shape[0] if shape else 1
    size = 1 << max(0, int(lead) - 1).bit_length()
    key = (name, size, tuple(shape[1:]), dtype, str(device))
    buf = _WORKSPACES.get(key)
    if buf is None:
        full = (size, *shape[1:]) if shape else (1,)
        buf = _WORKSPACES[key] = (torch.zeros if zeroed else torch.empty)(full, dtype=dtype, device=device)
    return buf[:lead] if shape else buf.view(())


def workspace_bytes() -> int:
    """Bytes all cached workspaces hold (a test and a diagnostic: it must stay bounded under any load)."""
    return sum(t.numel() * t.element_size() for t in _WORKSPACES.values())


def counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 arrival counters for in-launch reductions. A kernel that counts on them sets each back to 0
    once its last program arrived, so every launch (graph replays too) finds zeros."""
    return workspace("counters", (n,), torch.int32, device, zeroed=True)


def cuda_or_interpreter(t: torch.Tensor) -> None:
    """Raise UnsupportedPlatformError unless ``t`` is on CUDA or the interpreter is on."""
    if t.device.type != "cuda" and not INTERPRET:
        raise UnsupportedPlatformError(
            f"Triton kernels need CUDA tensors (got {t.device}); set TRITON_INTERPRET=1 before importing "
            "triton to run them on the CPU interpreter, or use backend='reference'"
        )
