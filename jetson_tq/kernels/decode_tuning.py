"""Fused hybrid decode, the launch knobs (``DecodeTuning``) and what they size: the split count, a format's fast paths.

Defaults from the H200 sweep per format; ``choose_splits``: one full wave of programs; ``value_subchunks``,
``fast_key_planes``, ``fused_query``: which code paths a format takes. Host code only; ``hybrid_decode_plan`` turns
these into a plan."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ._common import KEY_KLT, KEY_MSE, KEY_RAW, VAL_GROUP, PageSpec

# Launch defaults from benchmarks/sweep_decode.py on the H200 (docs/benchmarks.md): small programs
# (32 tokens, 2 warps, no software pipelining) and ~16 of them per SM hide the load -> unpack -> MMA
# latency chain better than fewer, larger ones (occupancy, not instruction count, was the limit);
# formats with 3-4 bit key indices do best with 16-token, 1-warp programs, whether the indices go through a
# codebook lookup (Lloyd-Max: 693 vs 800 us) or one bit plane (uniform: 502 vs 566 us).
BLOCK_N = 32
NUM_WARPS = 2
WIDE_BLOCK_N = 16
WIDE_NUM_WARPS = 1
# and a cap of 128 registers per thread (16 one-warp programs per SM, one full wave of WAVES programs:
# mse_k4v3u 526 -> 349 us, mse_k4v3 740 -> 594 us at B=8/64k against 167 registers = 12 programs = 1.33 waves)
WIDE_MAXNREG = 128
NUM_STAGES = 1
# klt keys: 32-token two-warp programs against 64 x 4 (H100, CUDA graphs, kl52 calibrated transform): 8 x 64k
# 1,630 -> 1,474 us dense, 1,281 -> 1,110 us diagonal; 1 x 128k 450 -> 420, 356 -> 325 us
KLT_BLOCK_N = 32
KLT_NUM_WARPS = 2
# one-warp programs of 3/4-bit keys pipeline their tile loads (num_stages=2: the next tile's key and value bytes go
# to shared memory by cp.async while this one is scored: 345 -> 308 us at B=8/64k, 109 -> 90.5 at B=1/128k)
WIDE_NUM_STAGES = 2
BLOCK_R = 16  # recent-buffer tokens per step: 64 set the register count (252 -> 167 per thread for mse_k4v3, sm_90)
MERGE_ELEMS = 2048  # partial-output elements merged per step in the in-launch reduction (SPB * GP * DP)
WAVES = 16.0  # programs per SM when no GPU can tell (offline compiles, interpreter); on CUDA the split count aims
# at the compiled kernel's resident programs per SM (``programs_per_sm``): 16 for 1-warp programs at 128 registers


@dataclass(frozen=True)
class DecodeTuning:
    """Launch knobs of the decode (results do not depend on them). None: the format's default, the best of the H200
    sweep (benchmarks/sweep_decode.py); ``for_format`` fills those in."""

    block_n: int | None = None  # compressed tokens per tile: 16 for 3/4-bit keys, else 32
    num_warps: int | None = None  # 1 for 3/4-bit keys, else 2
    num_stages: int | None = None  # software pipelining of the tile loads: 2 for one-warp 3/4-bit programs, else 1
    maxnreg: int | None = None  # register cap per thread, 0 for none: 128 for one-warp 3/4-bit programs
    block_r: int = BLOCK_R  # recent-buffer tokens per step
    num_splits: int | None = None  # splits per (sequence, KV head); None: from the SMs, one full wave
    waves: float | None = None  # programs per SM the split count aims for; None: what the compiled kernel keeps
    fused_reduce: bool = False  # merge the splits inside the decode launch (one launch per call: ~25 us less host
    # time per eager call, but 2-38 % more device time on the H200, so not the default)
    fast_keys: bool = True  # score affine-codebook keys from index bit planes (off: the centroid lookup)
    prmt_keys: bool = True  # 4-bit symmetric codebooks by byte permutes (off: the warp-shuffle gather)
    fold_values: bool = True  # fold value scales into P, codes as subnormal planes (off: dequantize per element)
    fuse_query: bool = True  # rotate the query inside the launch when it can (off: ``query_transform`` first)
    klt_select: bool = True  # klt keys: code bytes picked by a one-hot int8 product (off: a byte load each)

    def for_format(self, spec: PageSpec) -> DecodeTuning:
        """These knobs with every None that has a per-format default filled in (``num_splits``, ``waves`` stay)."""
        wide = spec.KB >= 3  # 3/4-bit keys (lookup or one wide plane): 16-token one-warp programs measured best
        if spec.KEY_MODE == KEY_KLT:  # code reading and RoPE per tile (and a [BLOCK_N, D] x [D, D] product if dense)
            return replace(
                self,
                block_n=self.block_n or KLT_BLOCK_N,
                num_warps=self.num_warps or KLT_NUM_WARPS,
                maxnreg=self.maxnreg if self.maxnreg is not None else 0,
                num_stages=self.num_stages if self.num_stages is not None else NUM_STAGES,
            )
        num_warps = self.num_warps or (WIDE_NUM_WARPS if wide else NUM_WARPS)
        one_warp_wide = wide and num_warps == WIDE_NUM_WARPS
        return replace(
            self,
            block_n=self.block_n or (WIDE_BLOCK_N if wide else BLOCK_N),
            num_warps=num_warps,
            maxnreg=self.maxnreg if self.maxnreg is not None else WIDE_MAXNREG if one_warp_wide else 0,
            num_stages=self.num_stages
            if self.num_stages is not None
            else WIDE_NUM_STAGES
            if one_warp_wide
            else NUM_STAGES,
        )


DEFAULT_TUNING = DecodeTuning()


def value_subchunks(spec: PageSpec) -> tuple[int, int]:
    """(coordinates per value sub-chunk, sub-chunks per chunk): a chunk is cut at value-group edges when it spans
    several."""
    if spec.VAL_MODE == VAL_GROUP and spec.VCW % spec.GROUP == 0 and spec.GROUP < spec.VCW:
        return spec.GROUP, spec.VCW // spec.GROUP
    return spec.VCW, 1


def choose_splits(
    batch: int, num_kv_heads: int, capacity: int, num_sms: int, block_n: int = BLOCK_N, waves: float = WAVES
) -> int:
    """Splits per sequence so that B * Hkv * splits programs give every SM at most ``waves`` programs (host-side only).

    Rounded down: with ``waves`` = programs resident per SM, a few programs past one full wave make a second, almost
    empty wave that the whole launch waits for (on the H200: 1600 programs on 1584 slots, 944 vs 740 us)."""
    tiles = max(1, -(-capacity // block_n))
    want = max(1, int(waves * num_sms) // max(1, batch * num_kv_heads))
    return max(1, min(tiles, want, 256))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA: offline compiles and the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def fast_key_planes(spec: PageSpec, kfit: tuple[float, float, float] | None, enabled: bool = True) -> tuple[bool, bool]:
    """(FAST_K, K_HIGH): score keys from index bit planes (affine codebook ``kfit``, one planar run) and whether the
    2-bit Lloyd-Max codebook's extra (k >> 1) plane is needed."""
    fast = enabled and spec.KEY_MODE != KEY_RAW and spec.KB > 0 and spec.KW1 == 0 and kfit is not None
    return fast, fast and kfit is not None and kfit[2] != 0.0


def fused_query(spec: PageSpec, codec) -> bool:
    """True when the decode launch rotates the query itself (mse keys, randomized Hadamard, D a power of two >= 16)."""
    rot = codec.key_rotation
    return spec.KEY_MODE == KEY_MSE and rot is not None and rot.kind == "hadamard" and spec.D == spec.DP
