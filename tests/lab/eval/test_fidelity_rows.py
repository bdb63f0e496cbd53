"""The fidelity harness's row grammar (``benchmarks/fidelity.py``: formats named by their features) and the plot
family of config rows, without running a model."""

from __future__ import annotations

from pathlib import Path

from jetson_tq.config import load_config

ROOT = Path(__file__).resolve().parents[3]


def test_klt_rows_name_their_levels_and_widths():
    """``kl52a{l,p}v3m..._w248_tq``: attention-weighted klt keys with Lloyd-Max (``l``) or cubic (``p``) levels and
    code widths 0/2/4/8, stored by the product format; a name the grammar does not know matches nothing."""
    import benchmarks.fidelity as bf

    for name, letter in (("kl52alv3m_b256_w248_tq", "l"), ("kl52apv3m_b256_w248_tq_seed2", "p")):
        m = bf.SPEC_ROW.match(name)
        assert m is not None and m["ln"] == "52" and m["la"] == "a" and m["ll"] == letter, name
        assert m["wd"] == "248" and m["tq"] == "_tq"
    assert bf.SPEC_ROW.match("kl52auv3m_b256_tq") is None  # evenly spaced levels: measured and removed


def test_sink_rows_name_their_first_layer():
    """``_e<S>l<L>``: the first S positions exact in layers L and later only, a per-layer format, so product-format
    (``_tq``) rows alone take it."""
    import benchmarks.fidelity as bf

    m = bf.SPEC_ROW.match("kl52apv3m_b256_e1l12_w248_tq_seed1")
    assert m is not None and (m["e"], m["el"], m["wd"], m["tq"], m["seed"]) == ("1", "12", "248", "_tq", "1")
    assert bf.SPEC_ROW.match("kl52apv3m_b256_e1_w248_tq")["el"] is None
    assert bf.SPEC_ROW.match("kl52apv3m_b256_l12_w248_tq") is None  # a first layer without a sink
    assert bf.spec_row("kl52apv3m_b256_e1l12_w248", "cpu-decoded") is None
    m = bf.SPEC_ROW.match("kl52apv3m_b256_e1l12k_w248_tq")  # ``k``: position 0 read from a calibrated constant
    assert m is not None and (m["e"], m["el"], m["ek"]) == ("1", "12", "k")
    assert bf.SPEC_ROW.match("kl52apv3m_b256_e1k_w248_tq") is None  # the constant goes with a first layer
    assert bf.spec_row("kl52apv3m_b256_e2l12k_w248_tq", "cpu-decoded") is None  # one position only


def test_config_rows_are_plotted_by_what_they_are():
    """``--extra-configs`` rows: a klt config joins the product's klt family, a per-layer config the SmartMix one,
    anything else is a plain config file."""
    import benchmarks.fidelity as bf

    assert bf.config_family(load_config("kl52_smollm2")) == bf.KLT_PRODUCT_FAMILY
    from lab.eval.fidelity import Variant

    klt = load_config("kl52_smollm2")
    assert bf.plot_family(Variant("kl52_smollm2", bf.config_family(klt), klt)) == bf.KLT_PRODUCT_FAMILY
    assert bf.config_family(load_config("mse_k4v3")) == "config file"
    per_layer = next((ROOT / "configs" / "per_layer").glob("*.yaml"))
    assert bf.config_family(load_config(per_layer)) == "per-layer (SmartMix)"
