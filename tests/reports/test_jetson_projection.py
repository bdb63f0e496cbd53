"""The Jetson projection's arithmetic on hand-computed cases: byte counts from ``jetson_tq.format``, the
bandwidth floor, SM x clock scaling and the max of the two bounds."""

from __future__ import annotations

import pytest

import benchmarks.jetson_projection as jp
from jetson_tq.format import fp16_bytes_per_token


def test_floor_scaling_and_max_on_a_hand_computed_case():
    # 1 GB at 250 GB/s = 4 ms; 1e9 / (250 * 1e3) µs
    assert jp.floor_us(1_000_000_000, 250.0) == pytest.approx(4000.0, rel=1e-12)
    # a device with 10 SMs at 1.32 GHz vs the H100's 132 x 1.98: 13.2 / 261.36 of its SM-clocks -> 19.8x the time
    dev = jp.Device("toy", 10, 1.32, 0.66, 100.0, 100.0, False, 8)
    assert jp.scaled_us(10.0, dev) == pytest.approx(198.0, rel=1e-12)
    assert jp.scaled_us(10.0, dev, low_clock=True) == pytest.approx(396.0, rel=1e-12)
    assert jp.projected_us(4000.0, 198.0) == 4000.0
    assert jp.projected_us(100.0, 198.0) == 198.0
    assert jp.projected_us(100.0, None) == 100.0


def test_bytes_come_from_the_format():
    shape = jp.Shape(batch=2, q_heads=8, kv_heads=4, context=1000)
    # fp16 K+V at D=128: 2 x 128 x 2 = 512 B per token per KV head; 2 x 4 x 1000 x 512
    assert fp16_bytes_per_token(128) == 512
    assert jp.kv_bytes("fp16/bf16 flash", shape) == 4_096_000
    assert jp.kv_bytes("fp8 KV", shape) == 2_048_000
    fmt = jp.our_format("mse_k4v3")
    assert jp.kv_bytes("mse_k4v3", shape) == 8 * fmt.sequence_bytes(1000, 128)
    # mse_k4v3 at D=128: 122 B/token/head compressed (the preset's description) + the exact 128-token fp16 window
    assert fmt.sequence_bytes(1000, 128) == 1000 * 122 + 128 * 512


def test_thor_row_is_the_larger_bound():
    rows = {(r["shape"], r["engine"]): r for r in jp.kernel_rows((jp.THOR,))}
    r = rows[("8 x 64k, 32/8, D=128", "fp16/bf16 flash")]
    assert r["bytes"] == 8 * 8 * 65536 * 512
    assert r["floor_us"] == pytest.approx(8 * 8 * 65536 * 512 / 257e3)
    assert r["issue_us"] == pytest.approx(700.0 * 132 * 1.98 / (20 * 1.575))
    assert r["projected_us"] == max(r["floor_us"], r["issue_us"])
    assert ("8 x 64k, 32/8, D=128", "fp8 KV") in rows
    assert rows[("8 x 64k, 32/8, D=128", "kl52_smollm2")]["issue_us"] is None  # no H100 figure: floor only
    assert not any(r["engine"] == "fp8 KV" for r in jp.kernel_rows((jp.ORIN,)))  # Orin has no FP8


def test_every_table_is_labelled_and_capacity_follows_the_bytes():
    cap = jp.capacity_rows(0.8, (jp.THOR,))
    by = {r["format"]: r for r in cap}
    assert by["fp8"]["bytes_per_token"] * 2 == by["bf16"]["bytes_per_token"] == 28 * 4 * 512
    assert by["mse_k4v3"]["tokens"] > by["fp8"]["tokens"] > by["bf16"]["tokens"] > 0
    text = jp.render(jp.kernel_rows((jp.THOR,)), [], cap, jp.h100_check_rows())
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert len(headings) == 4
    assert all(jp.LABEL in h for h in headings[:3])


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        jp.main(["--read-bw", "0", "150"])
    assert exc.value.code == 2
    assert "expected a positive number" in capsys.readouterr().err
