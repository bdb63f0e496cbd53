"""Bad input never gives a silent wrong answer, a traceback or a hang (issue 13; policy in docs/robustness.md).

Tables of bad inputs for the public API, the YAML loader, the command line and the launcher; each case
asserts the named error class and the words of its message (what was expected, what was given).
Hypothesis fuzzes the YAML loader and the position a non-finite K/V element is reported at.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jetson_tq import api, attention_decode, attention_prefill, turboquant_scores
from jetson_tq.cache.compressed import CompressedKVCache
from jetson_tq.cli import exit_codes
from jetson_tq.cli.main import main
from jetson_tq.codec.kv import KVCodec
from jetson_tq.codec.packing import pack_bits, unpack_bits
from jetson_tq.codec.rotation import Rotation, qjl_matrix
from jetson_tq.config import MAX_YAML_BYTES, config_from_dict, load_config
from jetson_tq.errors import (
    ArgTypeError,
    CapacityError,
    ConfigError,
    DeviceError,
    DTypeError,
    FormatError,
    JetsonTQError,
    ShapeError,
    ValueRangeError,
)
from jetson_tq.format import FP16_FORMAT, KVFormat, PagedLayout, fp16_bytes_per_token
from jetson_tq.models.specs import MODELS_DIR, load_model_spec
from lab import vllm_compare as compare
from tests.helpers.sandbox import run_launcher

D, H, B = 32, 2, 2
FMT = KVFormat(
    key_mode="prod", key_bits=3, value_bits=2, value_group=16
)  # prod 3-bit keys, 2-bit value groups, fp16 norms, 128-token buffer
SMALL = KVFormat(key_mode="prod", key_bits=3, value_bits=2, value_group=16, recent_tokens=0)  # no exact ring


#: what cache(initial_capacity=10**13) would allocate, from format.py: pages (16-token blocks) + the fp16 K/V ring
HUGE_CACHE_BYTES = B * (10**13 // 16) * H * PagedLayout(FMT, D, 16).page_bytes + 2 * B * H * FMT.recent_tokens * D * 2


def cache(fmt: KVFormat = FMT, dtype=torch.float16, **kw) -> CompressedKVCache:
    return CompressedKVCache(fmt, H, D, B, dtype=dtype, **kw)


def kv(t: int = 4, scale: float = 1.0, dtype=torch.float16, b: int | None = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    shape = (H, t, D) if b is None else (b, H, t, D)
    return (torch.randn(shape, generator=g) * scale).to(dtype), (torch.randn(shape, generator=g) * scale).to(dtype)


def poisoned(index: tuple, value: float, which: str = "k", t: int = 4, **kw):
    k, v = kv(t, **kw)
    (k if which == "k" else v)[index] = value
    return k, v


def filled(value: float, dtype=torch.float32, t: int = 4):
    return torch.full((B, H, t, D), value, dtype=dtype)


def decoded_cache() -> CompressedKVCache:
    c = cache()
    c.append(*kv(6))
    return c


def q(b: int = B, hq: int = 4) -> torch.Tensor:
    return torch.randn(b, hq, D)


def scores_args(**change):
    """Valid ``turboquant_scores`` inputs (S=5 keys, D=8), with some replaced."""
    d, s = 8, 5
    args = {
        "Q": torch.randn(3, d),
        "K_idx": torch.zeros(s, d, dtype=torch.uint8),
        "qjl_signs": torch.ones(s, d, dtype=torch.int8),
        "gamma": torch.ones(s),
        "Pi": torch.eye(d),
        "S_mat": torch.eye(d),
        "codebook": torch.zeros(4),
    }
    args.update(change)
    return args


def signs_with(value: int) -> torch.Tensor:
    s = torch.ones(5, 8, dtype=torch.int8)
    s[2, 3] = value
    return s


def gamma_with(value: float) -> torch.Tensor:
    g = torch.ones(5)
    g[1] = value
    return g


# ------------------------------------------------------------------------------------------- public API table
API_CASES = {
    # non-finite K/V at append: rejected, naming sequence, KV head and position
    "nan key": (
        lambda: cache().append(*poisoned((1, 0, 2, 5), math.nan)),
        ValueRangeError,
        ["k: expected finite values, got nan", "sequence 1, KV head 0, position 2, coordinate 5"],
    ),
    "inf value": (
        lambda: cache().append(*poisoned((0, 1, 3, 0), math.inf, "v")),
        ValueRangeError,
        ["v: expected finite values, got inf", "sequence 0, KV head 1, position 3"],
    ),
    "-inf key, one sequence": (
        lambda: cache().append(
            *(lambda k, v: (k.index_fill_(1, torch.tensor([2]), -math.inf), v))(*kv(4, b=None)), seq=1
        ),
        ValueRangeError,
        ["got -inf", "sequence 1, KV head 0, position 2"],
    ),
    # finite input that overflows an fp16 field
    "key norm over fp16 (6000 per coordinate, D=128)": (
        lambda: CompressedKVCache(KVFormat(key_mode="prod", key_bits=3), 1, 128, 1).append(
            torch.full((1, 1, 1, 128), 6000.0, dtype=torch.float16), torch.zeros(1, 1, 1, 128, dtype=torch.float16)
        ),
        ValueRangeError,
        ["k: expected key norm <= 32752", "got 67882", "norm_dtype float32"],
    ),
    "mse key norm over fp16": (
        lambda: cache(KVFormat(key_mode="mse", value_group=16), torch.float32).append(filled(20000.0), filled(0.0)),
        ValueRangeError,
        ["key norm <= 65504", "got 113137"],
    ),
    "value groups of 1e5 in a float32 cache": (
        lambda: cache(dtype=torch.float32).append(filled(1.0), filled(1e5)),
        ValueRangeError,
        ["v: expected |group minimum| <= 65504", "got 100000"],
    ),
    "value scale over fp16 (range 1e5, 1 bit)": (
        lambda: cache(KVFormat(value_bits=1, value_group=16), torch.float32).append(
            filled(1.0), torch.cat([filled(-5e4)[..., :8], filled(5e4)[..., :8]] * 2, dim=-1)
        ),
        ValueRangeError,
        ["group scale (max - min) / levels <= 65504", "got 100000"],
    ),
    "raw fp16 field of a float32 cache": (
        lambda: cache(FP16_FORMAT, torch.float32).append(filled(1e5), filled(1.0)),
        ValueRangeError,
        ["k: expected |value| <= 65504", "float32 cache stores"],
    ),
    "float32 input into an fp16 cache": (
        lambda: cache().append(filled(7e4), filled(1.0)),
        ValueRangeError,
        ["k: expected |value| <= 65504", "recent buffer"],
    ),
    # queries and the softmax scale
    "nan query (reference)": (
        lambda: attention_decode(torch.full((B, 4, D), math.nan), decoded_cache()),
        ValueRangeError,
        ["q: expected finite values, got nan"],
    ),
    "inf query (dispatch)": (
        lambda: api.attention_decode(torch.full((B, 4, D), math.inf), decoded_cache()),
        ValueRangeError,
        ["q: expected finite values, got inf"],
    ),
    "nan chunk key (prefill)": (
        lambda: attention_prefill(
            torch.randn(B, 4, 3, D), torch.full((B, H, 3, D), math.nan), torch.zeros(B, H, 3, D), decoded_cache()
        ),
        ValueRangeError,
        ["k: expected finite values"],
    ),
    "softmax_scale nan": (
        lambda: attention_decode(q(), decoded_cache(), math.nan),
        ValueRangeError,
        ["softmax_scale: expected a finite float > 0 or None, got nan"],
    ),
    "softmax_scale negative": (
        lambda: api.attention_decode(q(), decoded_cache(), -0.5),
        ValueRangeError,
        ["softmax_scale: expected a finite float > 0", "got -0.5"],
    ),
    "softmax_scale as a string": (
        lambda: attention_decode(q(), decoded_cache(), "0.1"),
        ArgTypeError,
        ["softmax_scale: expected a float > 0 or None, got str"],
    ),
    # turboquant_scores
    "qjl sign 2": (
        lambda: turboquant_scores(**scores_args(qjl_signs=signs_with(2))),
        ValueRangeError,
        ["qjl_signs: expected only +1 or -1, got 2 at index (2, 3)"],
    ),
    "qjl sign 0": (
        lambda: turboquant_scores(**scores_args(qjl_signs=signs_with(0))),
        ValueRangeError,
        ["expected only +1 or -1, got 0"],
    ),
    "gamma nan": (
        lambda: turboquant_scores(**scores_args(gamma=gamma_with(math.nan))),
        ValueRangeError,
        ["gamma: expected finite values, got nan at index (1,)"],
    ),
    "gamma negative": (
        lambda: turboquant_scores(**scores_args(gamma=gamma_with(-1.0))),
        ValueRangeError,
        ["gamma: expected residual norms >= 0, got -1.0"],
    ),
    "Q inf": (
        lambda: turboquant_scores(**scores_args(Q=torch.full((3, 8), math.inf))),
        ValueRangeError,
        ["Q: expected finite values"],
    ),
    # bit packing and seeds
    "pack_bits 255 at 2 bits": (
        lambda: pack_bits(torch.tensor([[255, 0, 1, 2]], dtype=torch.uint8), 2),
        ValueRangeError,
        ["expected values < 2**2 = 4", "got 255"],
    ),
    "float cache seed": (lambda: cache(seed=1.5), ArgTypeError, ["seed: expected an integer seed", "got float 1.5"]),
    "negative cache seed": (
        lambda: cache(seed=-1),
        ValueRangeError,
        ["seed: expected an integer seed in [0,", "got -1"],
    ),
    "float codec seed": (lambda: KVCodec(FMT, D, seed=2.0), ArgTypeError, ["got float 2.0"]),
    "float rotation seed": (lambda: Rotation(D, "auto", 0.5), ArgTypeError, ["got float 0.5"]),
    # wrong Python types
    "num_kv_heads=2.5": (
        lambda: CompressedKVCache(FMT, 2.5, D, B),
        ArgTypeError,
        ["num_kv_heads: expected an integer, got float 2.5"],
    ),
    "batch_size='2'": (
        lambda: CompressedKVCache(FMT, H, D, "2"),
        ArgTypeError,
        ["batch_size: expected an integer, got str '2'"],
    ),
    "num_kv_heads=0": (
        lambda: CompressedKVCache(FMT, 0, D, B),
        ValueRangeError,
        ["num_kv_heads: expected an integer >= 1, got 0"],
    ),
    "fmt as a preset name": (
        lambda: CompressedKVCache("k4v4", H, D, B),
        ArgTypeError,
        ["fmt: expected a KVFormat, got str"],
    ),
    "device bogus": (
        lambda: cache(device="bogus"),
        DeviceError,
        ["device: expected 'cpu', 'cuda' or 'cuda:N', got 'bogus'"],
    ),
    "seq=1.5": (lambda: cache().append(*kv(2, b=None), seq=1.5), ArgTypeError, ["seq: expected an integer, got float"]),
    "k as a list": (
        lambda: cache().append([[0.0]], torch.zeros(B, H, 1, D)),
        ArgTypeError,
        ["k: expected a torch.Tensor, got list"],
    ),
    "q as a list (reference)": (
        lambda: attention_decode([[0.0] * D], decoded_cache()),
        ArgTypeError,
        ["q: expected a torch.Tensor, got list"],
    ),
    "q as a list (dispatch)": (
        lambda: api.attention_decode([[0.0] * D], decoded_cache()),
        ArgTypeError,
        ["q: expected a torch.Tensor, got list"],
    ),
    "cache as a string (reference)": (
        lambda: attention_decode(q(), "cache"),
        ArgTypeError,
        ["cache: expected a CompressedKVCache or PagedKV, got str"],
    ),
    "cache as a string (dispatch)": (
        lambda: api.attention_decode(q(), "cache"),
        ArgTypeError,
        ["cache: expected a CompressedKVCache or PagedKV, got str"],
    ),
    # issue 25: unhashable values in format fields, sizes that cannot be allocated, meta tensors, lists for tensors
    "norm_dtype as a list": (
        lambda: KVFormat(norm_dtype=["float16"]),
        FormatError,
        ["norm_dtype: expected one of ('float16', 'float32'), got list ['float16']"],
    ),
    "key_mode as a dict": (
        lambda: KVFormat(key_mode={"mse": 1}),
        FormatError,
        ["key_mode: expected one of", "got dict"],
    ),
    "window None": (lambda: KVFormat(window=None), FormatError, ["window: expected one of", "got NoneType None"]),
    "with_ an unknown field": (
        lambda: FMT.with_(bits=3),
        FormatError,
        ["with_: unknown field(s) ['bits']", "key_bits"],
    ),
    "initial_capacity of 1e13 tokens": (
        lambda: cache(initial_capacity=10**13),
        CapacityError,
        [
            "initial_capacity=10,000,000,000,000 tokens",
            "free there",
            f"({HUGE_CACHE_BYTES:,} bytes) on cpu, expected at most the",
        ],
    ),
    "reserve 1e13 tokens": (
        lambda: cache().reserve(10**13),
        CapacityError,
        ["growing the cache to 10,000,000,000,000 tokens per sequence", "expected at most"],
    ),
    "batch of 1e9 sequences": (
        lambda: CompressedKVCache(FMT, H, D, 10**9),
        CapacityError,
        ["batch_size=1000000000", "recent ring", "free there"],
    ),
    "head_dim 1e9": (lambda: CompressedKVCache(FMT, H, 10**9, B), CapacityError, ["head_dim=1000000000", "needs"]),
    "dense rotation of dim 1e6": (
        lambda: Rotation(10**6, "dense", 0),
        CapacityError,
        ["a dense rotation of dim 1000000: needs 21.8 TiB"],
    ),
    "QJL sketch of dim 1e6": (lambda: qjl_matrix(10**6, 0), CapacityError, ["a QJL sketch matrix of dim 1000000"]),
    "QJL sketch of dim 0": (lambda: qjl_matrix(0, 0), FormatError, ["dim: expected a positive integer, got 0"]),
    "QJL seed -1": (lambda: qjl_matrix(8, -1), ValueRangeError, ["seed: expected an integer seed in [0,", "got -1"]),
    "cache on the meta device": (
        lambda: cache(device="meta"),
        DeviceError,
        ["device: expected 'cpu', 'cuda' or 'cuda:N', got 'meta'"],
    ),
    "k on the meta device": (
        lambda: cache().append(torch.zeros(B, H, 2, D, device="meta"), torch.zeros(B, H, 2, D)),
        DeviceError,
        ["k: expected a tensor on the CPU or a CUDA GPU, got one on meta"],
    ),
    "q on the meta device": (
        lambda: attention_decode(torch.zeros(B, 4, D, device="meta"), decoded_cache()),
        DeviceError,
        ["q: expected a tensor on the CPU or a CUDA GPU, got one on meta"],
    ),
    "every scores input on meta": (
        lambda: turboquant_scores(**{n: t.to("meta") for n, t in scores_args().items()}),
        DeviceError,
        ["Q: expected a tensor on the CPU or a CUDA GPU, got one on meta"],
    ),
    "Pi as a list": (
        lambda: turboquant_scores(**scores_args(Pi=torch.eye(8).tolist())),
        ArgTypeError,
        ["Pi: expected a torch.Tensor, got list"],
    ),
    "Q as a list": (
        lambda: turboquant_scores(**scores_args(Q=[[0.0] * 8] * 3)),
        ArgTypeError,
        ["Q: expected a torch.Tensor, got list"],
    ),
    "Pi not orthogonal (all ones)": (
        lambda: turboquant_scores(**scores_args(Pi=torch.ones(8, 8))),
        ValueRangeError,
        ["Pi: expected an orthogonal rotation", "got |Pi @ Pi.T - I| = 8"],
    ),
    "Pi scaled by 2": (
        lambda: turboquant_scores(**scores_args(Pi=2 * torch.eye(8))),
        ValueRangeError,
        ["expected an orthogonal rotation", "= 3 at row 0, column 0"],
    ),
    "pack_bits of a list": (lambda: pack_bits([[1, 2]], 2), ArgTypeError, ["codes: expected a torch.Tensor, got list"]),
    "unpack_bits of a list": (lambda: unpack_bits([[0]], 2, 8), ArgTypeError, ["packed: expected a torch.Tensor"]),
    "unpack_bits n=8.0": (
        lambda: unpack_bits(torch.zeros(1, 2, dtype=torch.uint8), 2, 8.0),
        ArgTypeError,
        ["n: expected an integer, got float 8.0"],
    ),
    "attn_mask as a list": (
        lambda: attention_prefill(q(hq=4).unsqueeze(2), *kv(1), decoded_cache(), attn_mask=[[1]]),
        ArgTypeError,
        ["attn_mask: expected a torch.Tensor, got list"],
    ),
    "int attn_mask": (
        lambda: attention_prefill(
            q(hq=4).unsqueeze(2), *kv(1), decoded_cache(), attn_mask=torch.ones(B, 1, 1, 7, dtype=torch.int64)
        ),
        DTypeError,
        ["attn_mask: expected a bool mask (True = attend) or an additive float mask"],
    ),
    "NaN in a float attn_mask": (
        lambda: attention_prefill(
            q(hq=4).unsqueeze(2),
            *kv(1, dtype=torch.float32),
            decoded_cache(),
            attn_mask=torch.full((B, 1, 1, 7), math.nan),
        ),
        ValueRangeError,
        ["attn_mask: expected finite values or -inf, got nan"],
    ),
    "validate='no'": (lambda: cache(validate="no"), ArgTypeError, ["validate: expected True or False, got str 'no'"]),
    "zero query heads": (
        lambda: attention_decode(torch.zeros(B, 0, D), decoded_cache()),
        ShapeError,
        ["expected q [B, Hq, D] with at least one query head, got (2, 0, 32)"],
    ),
    "softmax_scale 1e300 overflows": (
        lambda: attention_decode(q(), decoded_cache(), 1e300),
        ValueRangeError,
        ["expected query . key x softmax_scale to fit float32", "softmax_scale 1e+300"],
    ),
    "query of 3e38 overflows": (
        lambda: attention_decode(torch.full((B, 4, D), 3e38), decoded_cache()),
        ValueRangeError,
        ["the output is not finite (largest |q| 3e+38"],
    ),
    "KVCodec of a preset name": (
        lambda: KVCodec("k4v4", D),
        ArgTypeError,
        ["fmt: expected a KVFormat, got str 'k4v4'"],
    ),
    "KVCodec raw_dtype int8": (
        lambda: KVCodec(FMT, D, raw_dtype=torch.int8),
        DTypeError,
        ["raw_dtype: expected", "int8"],
    ),
    "PagedLayout of a preset name": (lambda: PagedLayout("k4v4", D, 16), FormatError, ["fmt: expected a KVFormat"]),
    "format_for_layer('1')": (
        lambda: load_config("k4v4").format_for_layer("1", 6),
        ArgTypeError,
        ["layer: expected an integer, got str '1'"],
    ),
    "check_model('30', 64)": (
        lambda: load_config("k4v4").check_model("30", 64),
        ArgTypeError,
        ["num_layers: expected an integer, got str '30'"],
    ),
    "fp16_bytes_per_token('128')": (
        lambda: fp16_bytes_per_token("128"),
        FormatError,
        ["head_dim: expected an integer in [1,", "got '128'"],
    ),
}
if not torch.cuda.is_available():
    API_CASES["cuda without a GPU"] = (lambda: cache(device="cuda"), DeviceError, ["torch sees no CUDA GPU"])


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_public_api_rejects_bad_input_by_name(case):
    call, error, words = API_CASES[case]
    with pytest.raises(error) as e:
        call()
    assert isinstance(e.value, JetsonTQError)
    for w in words:
        assert w in str(e.value), (case, str(e.value))


def test_nothing_is_stored_when_an_append_is_refused():
    c = cache()
    c.append(*kv(3))
    with pytest.raises(ValueRangeError, match="position 5"):  # positions count from what the cache holds
        c.append(*poisoned((0, 1, 2, 0), math.nan))
    assert c.lengths.tolist() == [3, 3]
    assert torch.isfinite(attention_decode(q(), c)).all()


def test_validate_false_skips_the_data_checks_only():
    """The documented opt-out: data checks off (no reduction, no sync), type and scale checks still on."""
    c = cache(validate=False)
    c.append(*poisoned((0, 0, 0, 0), math.nan))  # accepted: the caller vouches for the data
    assert c.lengths.tolist() == [4, 4]
    with pytest.raises(ValueRangeError, match="softmax_scale"):
        attention_decode(q(), c, -1.0)
    with pytest.raises(ArgTypeError):
        CompressedKVCache(FMT, 2.5, D, B, validate=False)


def test_values_just_inside_the_limits_are_stored_and_decode_finite():
    """The checks refuse only what would overflow: keys of norm ~30,000 and values of +-60,000 round-trip finite."""
    c = CompressedKVCache(SMALL, H, D, B, dtype=torch.float32)
    k = torch.randn(B, H, 16, D)
    k = k / k.norm(dim=-1, keepdim=True) * 30000.0  # under 32752 = 65504 / 2 (prod keeps ||r|| too)
    v = torch.cat([torch.full((B, H, 16, D // 2), -3e4), torch.full((B, H, 16, D // 2), 3e4)], dim=-1)
    c.append(k, v)
    assert c.compressed_lens.tolist() == [16, 16]
    for name, t in c.compressed_fields().items():
        assert not t.is_floating_point() or torch.isfinite(t).all(), name
    keys, values, _ = c.materialize()
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert torch.isfinite(attention_decode(torch.randn(B, 4, D) * 1e-3, c)).all()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(0, B - 1),
    h=st.integers(0, H - 1),
    t=st.integers(0, 5),
    d=st.integers(0, D - 1),
    bad=st.sampled_from([math.nan, math.inf, -math.inf]),
    which=st.sampled_from(["k", "v"]),
    held=st.integers(0, 3),
)
def test_any_non_finite_element_is_reported_where_it_is(b, h, t, d, bad, which, held):
    c = cache()
    if held:
        c.append(*kv(held))
    k, v = poisoned((b, h, t, d), bad, which, t=6)
    with pytest.raises(ValueRangeError) as e:
        c.append(k, v)
    assert f"{which}: expected finite values" in str(e.value)
    assert f"sequence {b}, KV head {h}, position {held + t}, coordinate {d}" in str(e.value)
    assert c.lengths.tolist() == [held, held]


# ------------------------------------------------------------------------------------------- YAML loader table
BOMB = (
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
    "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
    "description: [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
)
YAML_CASES = {
    "duplicate key": (
        "keys: {mode: mse, bits: 4}\nseed: 1\nseed: 2\n",
        ["line 3: duplicate key 'seed'", "first on line 2"],
    ),
    "duplicate nested key": ("keys: {mode: mse, mode: prod}\n", ["duplicate key 'mode'"]),
    "empty file": ("", ["the file is empty; expected a mapping"]),
    "comments only": ("# nothing here\n\n", ["the file is empty"]),
    "alias bomb": (BOMB, ["YAML anchor &a is not allowed"]),
    "merge key alias": ("base: &base {bits: 4}\nkeys:\n  <<: *base\n", ["anchor &base is not allowed"]),
    "invalid UTF-8": (b"name: caf\xe9\n", ["expected UTF-8 text, got byte 0xe9 at offset 9"]),
    "a list, not a mapping": ("- keys\n- values\n", ["expected a mapping, got list"]),
    "a scalar": ("42\n", ["expected a mapping, got int"]),
    "keep_fp16_first: 1e9 (YAML reads a string)": (
        "layers: {keep_fp16_first: 1e9}\n",
        ["layers.keep_fp16_first: expected an integer in [0, 4096], got '1e9'"],
    ),
    "keep_fp16_first: 1000000000": ("layers: {keep_fp16_first: 1000000000}\n", ["got 1000000000"]),
    "keep_fp16_last: -1": ("layers: {keep_fp16_last: -1}\n", ["expected an integer in [0, 4096], got -1"]),
    "float seed": ("seed: 1.5\n", ["seed: expected an integer in [0,", "got 1.5"]),
    "negative seed": ("seed: -3\n", ["got -3"]),
    "bits true": ("keys: {bits: true}\n", ["key_bits: expected an integer in [1, 8], got True"]),
    "norm_dtype a list": ("norm_dtype: [float16]\n", ["norm_dtype: expected one of ('float16', 'float32'), got list"]),
    "keys.mode a mapping": ("keys: {mode: {mse: 1}}\n", ["key_mode: expected one of", "got dict {'mse': 1}"]),
    "buffer.window a list": ("buffer: {window: [block]}\n", ["window: expected one of ('sliding', 'block'), got list"]),
    "rotation a list": ("rotation: [auto, dense]\n", ["rotation: expected one of", "got list ['auto', 'dense']"]),
    "an override's norm_dtype a list": (
        "layers: {overrides: {1: {norm_dtype: [a]}}}\n",
        ["layers.overrides.1.: norm_dtype: expected one of", "got list ['a']"],
    ),
    "name a list": ("name: [a, b]\n", ["name: expected a string, got list ['a', 'b']"]),
    "description a mapping": ("description: {a: 1}\n", ["description: expected a string, got dict"]),
    "not YAML": ("keys: [unclosed\n", ["not valid YAML"]),
}


@pytest.mark.parametrize("case", sorted(YAML_CASES))
def test_config_loader_rejects_bad_files_by_name(case, tmp_path):
    text, words = YAML_CASES[case]
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as e:
        load_config(path)
    for w in words:
        assert w in str(e.value), (case, str(e.value))


def test_config_names_and_paths(tmp_path):
    (tmp_path / "dir.yaml").mkdir()
    cases = {
        "../../etc/passwd": "expected a path ending in .yaml",
        "../configs/k4v4": "ending in .yaml",
        "k4v4/..": "ending in .yaml",
        "..": "no path",
        "k4v4..": "no path",
        "nosuchpreset": "no config",
        str(tmp_path / "dir.yaml"): "the path is a directory",
        str(tmp_path / "missing.yaml"): "does not exist",
        str(tmp_path): "ending in .yaml",
        "": "no path",
    }
    for name, words in cases.items():
        with pytest.raises(ConfigError, match=words):
            load_config(name)
    with pytest.raises(ConfigError, match="expected a name or a path"):
        load_config(3)
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")  # never read: it would not end
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_config(tmp_path / "zero.yaml")
    big = tmp_path / "big.yaml"
    big.write_text("description: " + "x" * MAX_YAML_BYTES + "\n")
    with pytest.raises(ConfigError, match="at most 262,144 bytes"):
        load_config(big)


def test_keep_fp16_covering_every_layer_is_refused_for_a_compressed_format():
    cfg = config_from_dict({"layers": {"keep_fp16_first": 20, "keep_fp16_last": 10}})
    with pytest.raises(ConfigError, match="= 30: expected fewer than the model's 30 layers"):
        cfg.check_model(30, 64)
    config_from_dict({"layers": {"keep_fp16_first": 29}}).check_model(30, 64)  # one layer compressed: fine
    load_config("fp16").check_model(30, 64)  # passthrough preset: fine


def test_model_specs_are_read_by_the_same_strict_loader(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: m\nnum_layers: 2\nnum_layers: 3\n")
    with pytest.raises(ConfigError, match="duplicate key 'num_layers'"):
        load_model_spec(path)
    with pytest.raises(ConfigError, match="ending in .yaml"):
        load_model_spec("../models/qwen2.5-7b-instruct")
    assert load_model_spec("Qwen2.5-7B-Instruct").num_layers == 28  # shipped names stay case-insensitive
    good = (MODELS_DIR / "qwen2.5-7b-instruct.yaml").read_text()
    for line, words in (
        ("weight_dtype: [bfloat16]", "weight_dtype: expected a string, got list"),
        ("name: {a: 1}", "name: expected a string, got dict"),
        ("tie_word_embeddings: 'no'", "tie_word_embeddings: expected true or false, got str 'no'"),
    ):
        key = line.split(":")[0]
        text = "\n".join(row for row in good.splitlines() if not row.startswith(key + ":")) + f"\n{line}\n"
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_model_spec(path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.one_of(
        st.binary(max_size=120),
        st.text(max_size=120).map(str.encode),
        st.lists(
            st.sampled_from(
                [
                    "keys:",
                    " {mode: mse",
                    ", bits: 4}",
                    "\n",
                    "seed: 1",
                    "&a ",
                    "*a",
                    "layers: {keep_fp16_first: 2}",
                    "- x",
                    ": ",
                    "values:",
                    " [1, 2]",
                ]
            ),
            max_size=12,
        ).map(lambda parts: "".join(parts).encode()),
    )
)
def test_any_bytes_give_a_config_or_a_config_error(data, tmp_path):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    try:
        cfg = load_config(path)
    except ConfigError:
        return
    assert cfg.default.key_bits >= 1


# ------------------------------------------------------------------------------------------- command line table
CLI_CASES = {  # cases past the budget pass --kv-budget-gb: this machine's free memory must not matter
    "--memory-gb -5": (
        ["capacity", "--memory-gb", "-5"],
        exit_codes.USAGE,
        "argument --memory-gb: expected a number > 0, got '-5'",
    ),
    "--memory-gb 0": (["capacity", "--memory-gb", "0"], exit_codes.USAGE, "expected a number > 0, got '0'"),
    "--memory-gb nan": (["capacity", "--memory-gb", "nan"], exit_codes.USAGE, "expected a finite number, got 'nan'"),
    "--memory-gb 1e300": (
        ["capacity", "--memory-gb", "1e300"],
        exit_codes.USAGE,
        "argument --memory-gb: expected at most 1e+06 GB (1 PB, more than any one machine holds), got '1e300'",
    ),
    "--kv-budget-gb 1e300": (["capacity", "--kv-budget-gb", "1e300"], exit_codes.USAGE, "expected at most 1e+06 GB"),
    "--weights-gb 1e300": (["capacity", "--weights-gb", "1e300"], exit_codes.USAGE, "expected at most 1e+06 GB"),
    "--overhead-gb 2e6": (["capacity", "--overhead-gb", "2e6"], exit_codes.USAGE, "expected at most 1e+06 GB"),
    "--memory-gb ten": (["capacity", "--memory-gb", "ten"], exit_codes.USAGE, "expected a number, got 'ten'"),
    "--context 1e3": (["capacity", "--context", "1e3"], exit_codes.USAGE, "expected an integer, got '1e3'"),
    "vllm --kv-mib 1e12 MiB": (
        ["vllm", "--kv-mib", str(10**12)],
        exit_codes.USAGE,
        "CapacityError: --kv-mib 1000000000000 (the KV budget of each engine): needs 931.3 PiB",
    ),
    "--kv-budget-gb inf": (
        ["capacity", "--kv-budget-gb", "inf"],
        exit_codes.USAGE,
        "expected a finite number, got 'inf'",
    ),
    "--kv-budget-gb -1": (["capacity", "--kv-budget-gb", "-1"], exit_codes.USAGE, "expected a number > 0"),
    "--weights-gb -1": (["capacity", "--weights-gb", "-1"], exit_codes.USAGE, "expected a number >= 0, got '-1'"),
    "--overhead-gb=-inf": (["capacity", "--overhead-gb=-inf"], exit_codes.USAGE, "expected a finite number"),
    "--utilization 0": (["capacity", "--utilization", "0"], exit_codes.USAGE, "expected a fraction in (0, 1], got '0'"),
    "--utilization nan": (["capacity", "--utilization", "nan"], exit_codes.USAGE, "expected a finite number"),
    "--context 0": (
        ["capacity", "--context", "0"],
        exit_codes.USAGE,
        "argument --context: expected an integer >= 1, got '0'",
    ),
    "--context -4096": (["capacity", "--context", "-4096"], exit_codes.USAGE, "expected an integer >= 1"),
    "--context 1.5": (["capacity", "--context", "1.5"], exit_codes.USAGE, "expected an integer, got '1.5'"),
    "--measure-tokens 0": (["capacity", "--measure-tokens", "0"], exit_codes.USAGE, "expected an integer >= 1"),
    "--device bogus": (
        ["capacity", "--device", "bogus"],
        exit_codes.USAGE,
        "expected auto, cpu, cuda or cuda:N, got 'bogus'",
    ),
    "weights larger than memory": (
        ["capacity", "--memory-gb", "1"],
        exit_codes.USAGE,
        "no memory left for the KV cache: --memory-gb 1",
    ),
    "--config a directory": (["capacity", "--config", "{tmp}/d.yaml"], exit_codes.USAGE, "the path is a directory"),
    "--config invalid UTF-8": (["capacity", "--config", "{tmp}/latin1.yaml"], exit_codes.USAGE, "expected UTF-8 text"),
    "--config ../": (["capacity", "--config", "../../etc/passwd"], exit_codes.USAGE, "expected a path ending in .yaml"),
    "--model a directory": (["capacity", "--model", "{tmp}/d.yaml"], exit_codes.USAGE, "the path is a directory"),
    "--compare with an unknown preset": (
        ["capacity", "--kv-budget-gb", "1", "--compare", "k4v4,nosuch", "--plot", "{tmp}/p.png"],
        exit_codes.USAGE,
        "no config 'nosuch'",
    ),
    "--plot a directory": (
        ["capacity", "--kv-budget-gb", "1", "--plot", "{tmp}"],
        exit_codes.USAGE,
        "--plot: expected a PNG file path",
    ),
    "vllm --config nosuchpreset": (["vllm", "--config", "nosuchpreset"], exit_codes.USAGE, "no config 'nosuchpreset'"),
    "vllm --kv-mib 0": (["vllm", "--kv-mib", "0"], exit_codes.USAGE, "argument --kv-mib: expected an integer >= 1"),
    "vllm --max-tokens -1": (["vllm", "--max-tokens", "-1"], exit_codes.USAGE, "expected an integer >= 1, got '-1'"),
    "vllm --dtype fp9": (["vllm", "--dtype", "fp9"], exit_codes.USAGE, "invalid choice: 'fp9'"),
    "vllm --json a directory": (["vllm", "--json", "{tmp}"], exit_codes.USAGE, "--json: expected a file path"),
    "vllm --prompt ''": (["vllm", "--prompt", " "], exit_codes.USAGE, "--prompt: expected non-empty prompts"),
    "demo --config nosuch": (["demo", "--config", "nosuch"], exit_codes.USAGE, "no config 'nosuch'"),
    "demo --model nosuch": (["demo", "--model", "nosuch"], exit_codes.USAGE, "no model 'nosuch'"),
    "demo --utilization 2": (["demo", "--utilization", "2"], exit_codes.USAGE, "expected a fraction in (0, 1]"),
    "demo --measure-tokens 0": (["demo", "--measure-tokens", "0"], exit_codes.USAGE, "expected an integer >= 1"),
    "demo --out a file": (["demo", "--out", "{tmp}/latin1.yaml"], exit_codes.USAGE, "--out: expected a folder"),
    "unknown mode": (["bogus"], exit_codes.USAGE, "invalid choice: 'bogus'"),
}
if not torch.cuda.is_available():
    CLI_CASES["--device cuda without a GPU"] = (
        ["capacity", "--kv-budget-gb", "1", "--device", "cuda", "--no-plot"],
        exit_codes.USAGE,
        "DeviceError: device: 'cuda' asked for, but torch sees no CUDA GPU",
    )


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(max_size=12), st.floats().map(repr), st.integers(-(10**20), 10**20).map(str)))
def test_number_arguments_are_finite_and_in_range_or_a_usage_error(text):
    import argparse

    from jetson_tq import arg_types

    for check, ok in (
        (arg_types.positive_float, lambda x: math.isfinite(x) and x > 0),
        (arg_types.nonnegative_float, lambda x: math.isfinite(x) and x >= 0),
        (arg_types.fraction, lambda x: 0 < x <= 1),
        (arg_types.positive_int, lambda x: isinstance(x, int) and x >= 1),
    ):
        try:
            value = check(text)
        except argparse.ArgumentTypeError as e:
            assert repr(text) in str(e)
            continue
        assert ok(value), (check.__name__, text, value)


@pytest.fixture
def no_work(monkeypatch):
    """Fail loudly if a command starts real work (a vLLM engine, a demo section, a measured cache)."""

    def refuse(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(compare, "run_engine_subprocess", refuse)
    import jetson_tq.cli.capacity_cmd as capacity_cmd

    monkeypatch.setattr(capacity_cmd, "measure_model", refuse)
    monkeypatch.setattr(capacity_cmd, "capacity_report", refuse)


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_command_line_rejects_bad_arguments_before_any_work(case, tmp_path, capsys, no_work):
    argv, code, words = CLI_CASES[case]
    (tmp_path / "d.yaml").mkdir()
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == code, (case, out, err)
    assert words in err, (case, err)
    assert "Traceback" not in out + err and "== 1." not in out  # one line, and no demo section ran


def test_a_measured_cache_that_cannot_be_allocated_is_refused_before_allocating(capsys):
    """--measure-tokens 1e15: the measured CompressedKVCache is refused by size (exit 2), nothing printed on stdout."""
    rc = main(["capacity", "--kv-budget-gb", "1", "--no-plot", "--device", "cpu", "--measure-tokens", str(10**15)])
    out, err = capsys.readouterr()
    assert rc == exit_codes.USAGE and out == "", (rc, out, err)
    assert (
        "jetson-tq: CapacityError: measuring a cache of 1,000,000,000,000,000 tokens (4 KV heads, head_dim 128)" in err
        and "expected at most the" in err
    )


def test_missing_dependency_is_exit_5_with_the_install_line(monkeypatch, capsys, no_work):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else real(name, *a))
    assert main(["vllm"]) == exit_codes.MISSING_COMPONENT
    err = capsys.readouterr().err
    assert "vllm mode needs ['safetensors']" in err and "./run_jetson.sh vllm installs" in err


def test_unexpected_errors_are_one_line_not_a_traceback(monkeypatch, capsys):
    import jetson_tq.cli.capacity_cmd as capacity_cmd

    def boom(args):
        raise ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib")

    monkeypatch.setattr(capacity_cmd, "run_capacity", boom)
    assert main(["capacity"]) == exit_codes.MISSING_COMPONENT
    assert "missing dependency 'matplotlib' for mode 'capacity'" in capsys.readouterr().err
    monkeypatch.setattr(capacity_cmd, "run_capacity", lambda args: 1 / 0)
    assert main(["capacity"]) == exit_codes.FAILED
    err = capsys.readouterr().err
    assert "capacity failed: ZeroDivisionError" in err and "JETSON_TQ_TRACEBACK=1" in err and "Traceback" not in err
    monkeypatch.setenv("JETSON_TQ_TRACEBACK", "1")
    with pytest.raises(ZeroDivisionError):
        main(["capacity"])


# ------------------------------------------------------------------------------------------- launcher table
LAUNCHER_CASES = {
    "--bogus demo": (["--bogus", "demo"], exit_codes.USAGE, "unknown option '--bogus'"),
    "bogus mode": (["bogus"], exit_codes.USAGE, "unknown mode 'bogus'"),
    "--image without a value": (["demo", "--image"], exit_codes.USAGE, "--image needs a value"),
    "--config without a value": (["--config"], exit_codes.USAGE, "--config needs a value"),
    "no mode": (["--dry-run"], exit_codes.USAGE, "usage: ./run_jetson.sh"),
    "vllm on JetPack 6": (["--dry-run", "vllm"], exit_codes.UNSUPPORTED_PLATFORM, "vllm cannot run here"),
}


@pytest.mark.parametrize("case", sorted(LAUNCHER_CASES))
def test_launcher_rejects_bad_arguments(case, tmp_path):
    args, code, words = LAUNCHER_CASES[case]
    board = "orin_r36" if "JetPack" in case else "x86_cpu"
    p = run_launcher(tmp_path, board, *args)
    assert p.returncode == code and words in p.stderr, (case, p.returncode, p.stderr)
    assert p.stdout == ""  # nothing to run was printed


def test_launcher_dry_run_never_reaches_pytest(tmp_path):
    p = run_launcher(tmp_path, "x86_cpu", "test", "-q", "--dry-run")
    assert p.returncode == 0 and "--dry-run" not in shlex.split(p.stdout)


# ------------------------------------------------------------------------------------------- vllm mode's report
def engine(tokens: int, dtype: str, ids: list[list[int]], kv_bytes: int = 2**28) -> dict:
    return {
        "kv_cache_size_tokens": tokens,
        "kv_bytes": kv_bytes,
        "num_gpu_blocks": tokens // 16,
        "kv_dtype": dtype,
        "tokens_per_s": 10.0,
        "logged_kv_tokens": tokens,
        "outputs": [
            {"prompt": f"Prompt {i}: " + "lorem ipsum dolor " * 20 + "the last words", "text": "x", "token_ids": t}
            for i, t in enumerate(ids)
        ],
    }


def test_vllm_report_names_the_baseline_dtype_and_the_ratio_vs_fp16(capsys):
    base = engine(1000, "float32", [[1, 2, 3], [4, 5, 6]])
    tq = engine(7420, None, [[1, 2, 3], [4, 9, 6]])
    s = compare.summarize(base, tq, 2048)
    assert s["capacity_ratio"] == 7.42 and s["capacity_ratio_vs_fp16"] == 3.71 and s["baseline_kv_dtype"] == "float32"
    assert s["first_divergence"] == [None, 1]
    compare._print_report(
        {
            "summary": s,
            "baseline": base,
            "turboquant": tq,
            "vllm_version": "0.27.0",
            "device": "cpu",
            "model": "m",
            "config": "mse_k4v3",
        }
    )
    out = capsys.readouterr().out
    assert "baseline (float32 KV cache) 1,000 tokens" in out
    assert "x7.42 vs this float32 baseline, x3.71 vs an fp16 KV cache" in out
    assert "--- prompt 0: " in out and "(identical outputs)" in out.splitlines()[-6]
    assert "first divergence at token 1" in out and out.count("first divergence") == 1
    assert "the last words" in out  # the prompt's ending is shown ...
    for line in out.splitlines():
        if line.startswith("--- prompt"):
            shown = line.split("'")[1]
            assert all(
                word in ("lorem", "ipsum", "dolor", "...", "the", "last", "words", "Prompt", "0:", "1:")
                for word in shown.split()
            ), shown  # ... and never a word cut in half
    s16 = compare.summarize(engine(1000, "bfloat16", [[1]]), engine(4100, None, [[1]]), 2048)
    assert s16["capacity_ratio_vs_fp16"] == s16["capacity_ratio"] == 4.1


def test_vllm_config_that_does_not_fit_the_model_is_refused_before_the_baseline(tmp_path, monkeypatch, capsys, no_work):
    import json

    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 6, "hidden_size": 128, "num_attention_heads": 4, "head_dim": 32})
    )
    monkeypatch.setattr(compare, "resolve_model", lambda name: (str(tmp_path), "float32"))
    assert compare.model_shape(str(tmp_path)) == (6, 32)
    assert compare.model_shape("qwen2.5-7b-instruct") == (28, 128) and compare.model_shape("org/some-hub-id") is None
    bad = tmp_path / "bad.yaml"
    bad.write_text("keys: {mode: mse, bits: 4}\nlayers: {overrides: {10: {keys: {bits: 3}}}}\n")
    assert main(["vllm", "--model", "tiny", "--config", str(bad)]) == exit_codes.USAGE  # layer 10 of a 6-layer model
    assert "layer 10 out of range for a model of 6 layers" in capsys.readouterr().err


def test_one_unsupported_model_error_for_both_integrations(monkeypatch, capsys):
    """TurboQuantCache, the vLLM backend and the calibration refuse a model with the same class: caught as the
    platform error it was on the vLLM side and the ValueError it was on the transformers side; the CLI names it."""
    from jetson_tq import errors
    from jetson_tq.calibration import capture
    from jetson_tq.cli import platform_cmd
    from jetson_tq.integrations import transformers
    from jetson_tq.integrations.vllm import spec

    cls = errors.UnsupportedModelError
    assert transformers.UnsupportedModelError is spec.UnsupportedModelError is capture.UnsupportedModelError is cls
    assert issubclass(cls, errors.UnsupportedPlatformError) and issubclass(cls, ValueError)

    def refuse(args):
        raise cls("layer 3: attention with ALiBi")

    monkeypatch.setattr(platform_cmd, "_run", refuse)
    assert main(["platform"]) == exit_codes.UNSUPPORTED_PLATFORM
    assert "jetson-tq: unsupported model: layer 3: attention with ALiBi" in capsys.readouterr().err


def test_a_failed_engine_reports_its_named_error_not_its_traceback(tmp_path):
    from jetson_tq.errors import UnsupportedModelError

    log = (
        "INFO x\nTraceback (most recent call last):\n  File ...\n[rank0]: jetson_tq.errors.ConfigError: layer 0: bad "
        "group\nRuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    err = compare.engine_failure("jetson-tq k4v4", 1, log)
    assert isinstance(err, ConfigError)
    assert "vLLM engine (jetson-tq k4v4): ConfigError: layer 0: bad group (full log: " in str(err)
    err = compare.engine_failure("jetson-tq x", 1, "jetson_tq.errors.UnsupportedModelError: sliding_window\n")
    assert isinstance(err, UnsupportedModelError) and "UnsupportedModelError: sliding_window" in str(err)
    err = compare.engine_failure("baseline", 1, "Traceback ...\nValueError: bad dtype\nshutting down\n")
    assert type(err) is RuntimeError and "failed with code 1: ValueError: bad dtype" in str(err)
    err = compare.engine_failure("baseline", -9, "loading\nKilled\n")
    assert isinstance(err, RuntimeError) and "failed with code -9: Killed" in str(err) and "Traceback" not in str(err)


def test_engine_start_that_lost_its_port_runs_again_other_failures_do_not(monkeypatch):
    """A start-up whose rendezvous port was taken by another process is retried; a real error fails at once, and a
    port lost on every try fails after ``PORT_RETRIES`` more starts."""
    import subprocess

    def engine(*stderrs: str) -> list:
        """Child runs failing with ``stderrs`` in turn, then succeeding; returns the list of commands run."""
        calls: list = []

        def run(command, **kw):
            calls.append(command)
            if len(calls) <= len(stderrs):
                return subprocess.CompletedProcess(command, 1, "", stderrs[len(calls) - 1])
            Path(command[-1]).write_text(json.dumps({"texts": ["ok"]}))
            return subprocess.CompletedProcess(command, 0, "# KV cache size: 1,024 tokens\n", "")

        monkeypatch.setattr(compare.subprocess, "run", run)
        monkeypatch.setenv("JETSON_TQ_ENGINE_FORK", "0")  # fresh processes: the faked subprocess.run starts them
        return calls

    calls = engine("DistNetworkError: ... EADDRINUSE ...\n")
    assert compare.run_engine_subprocess({"model": "m"}, None, {})["texts"] == ["ok"] and len(calls) == 2
    calls = engine("ValueError: bad dtype\n")
    with pytest.raises(RuntimeError, match="bad dtype"):
        compare.run_engine_subprocess({"model": "m"}, None, {})
    assert len(calls) == 1
    calls = engine(*["DistNetworkError: EADDRINUSE\n"] * (1 + compare.PORT_RETRIES))
    with pytest.raises(RuntimeError, match="EADDRINUSE"):
        compare.run_engine_subprocess({"model": "m"}, None, {})
    assert len(calls) == 1 + compare.PORT_RETRIES


FORMATS = [
    KVFormat(**{"key_mode": "prod", "key_bits": 3, "value_bits": 2, "value_group": 16, "recent_tokens": 0, **kw})
    for kw in (
        {},
        {"key_mode": "mse", "key_bits": 4, "value_bits": 3},
        {"norm_dtype": "float32"},
        {"value_mode": "mse", "value_bits": 3},
        {"key_mode": "fp16", "value_mode": "fp16"},
        {"value_bits": 1},
    )
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(FORMATS),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    log_scale=st.floats(-3, 6.5),
    offset=st.floats(-1e5, 1e5),
    seed=st.integers(0, 2**16),
)
def test_finite_input_is_stored_finite_or_refused_never_nan(fmt, dtype, log_scale, offset, seed):
    """The promise of issue 13 as a property: any finite K/V either round-trips to finite output or is refused."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 1, 8, D, generator=g) * 10**log_scale
    v = torch.randn(1, 1, 8, D, generator=g) * 10**log_scale + offset
    c = CompressedKVCache(fmt, 1, D, 1, dtype=dtype)
    try:
        c.append(k, v)
    except ValueRangeError as e:
        assert "expected" in str(e) and "sequence 0, KV head 0, position" in str(e)
        return
    assert c.compressed_lens.tolist() == [8] or fmt.is_passthrough
    keys, values, _ = c.materialize()
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    assert torch.isfinite(attention_decode(torch.randn(1, 2, D, generator=g), c)).all()


def test_engines_in_one_process_each_get_their_own_log_lines(monkeypatch):
    """Several engines in one process: each result carries the logged KV size, the jetson-tq lines and the tail of its
    own part of the log (what the process printed before the first job goes with the first)."""
    import subprocess

    mark = compare.JOB_MARK
    log = (
        "jetson-tq: TurboQuant KV cache 'k4v4'\n"
        f"{mark}a\nKV cache size: 1,024 tokens\njetson-tq: compressed 6 of 6\n"
        f"{mark}b\nKV cache size: 2,048 tokens\nWARNING something\n"
    )

    def run(command, **kw):
        assert kw["stderr"] == subprocess.STDOUT  # one stream: stderr lines stay in their job's part
        Path(command[-1]).write_text(json.dumps({"a": {}, "b": {}}))
        return subprocess.CompletedProcess(command, 0, log, None)

    monkeypatch.setattr(compare.subprocess, "run", run)
    monkeypatch.setenv("JETSON_TQ_ENGINE_FORK", "0")
    out = compare.run_engines_in_one_process({"a": {}, "b": {}}, "k4v4", {})
    assert out["a"]["logged_kv_tokens"] == 1024 and out["b"]["logged_kv_tokens"] == 2048
    assert out["a"]["jetson_tq_log"] == ["jetson-tq: TurboQuant KV cache 'k4v4'", "jetson-tq: compressed 6 of 6"]
    assert (
        out["b"]["jetson_tq_log"] == [] and out["b"]["log_tail"] == "\nKV cache size: 2,048 tokens\nWARNING something\n"
    )
