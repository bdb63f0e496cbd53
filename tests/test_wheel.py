"""The installed package works outside the checkout: build the wheel, install it into a scratch venv, and from a
folder outside the repository load the default preset, run the CLI (``python -m jetson_tq``, the ``jetson-tq``
script), build a ``TurboQuantCache`` on a tiny transformers model and load the vLLM plugin's entry point.

The scratch venv has no packages of its own but jetson-tq: a ``.pth`` file puts the test venv's site-packages
after its own (torch, transformers and vLLM are reused, nothing is downloaded), and ``PYTHONPATH`` is cleared, so
``jetson_tq`` and its presets can only come from the installed wheel. The build runs offline
(``--no-build-isolation``: the test venv's setuptools) on a copy of the sources, so the checkout gets no
``build/`` or ``*.egg-info``.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: what the build copies: the lab beside the package too, so the wheel leaving it out is package discovery's doing
SOURCES = ("pyproject.toml", "README.md", "jetson_tq", "configs", "lab")

#: run by the scratch venv's python from a folder outside the repository
CHECKS = r"""
import importlib.metadata as md, json, sys
from pathlib import Path
import jetson_tq as jt
from jetson_tq.config import CONFIG_DIR
venv = Path(sys.prefix).resolve()
assert Path(jt.__file__).resolve().is_relative_to(venv), jt.__file__
assert CONFIG_DIR.resolve().is_relative_to(venv), CONFIG_DIR
cfg = jt.load_config()
from jetson_tq.models.specs import load_model_spec
spec = load_model_spec("smollm2-135m-instruct")
mix = jt.load_config(CONFIG_DIR / "per_layer" / "smartmix_smollm2-135m.yaml")

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from jetson_tq.integrations.transformers import TurboQuantCache
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                     max_position_embeddings=256)).eval()
cache = TurboQuantCache(model, "mse_k4v3")
ids = torch.randint(0, 64, (1, 12))
with torch.no_grad():
    out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)

eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "jetson_tq"]
ours = [e for e in eps if Path(str(e.dist.locate_file(""))).resolve().is_relative_to(venv)]
register = ours[0].load()
register()  # JETSON_TQ_CONFIG unset: the plugin stays off (a debug log line), whatever vLLM is installed
print(json.dumps({"config": cfg.name, "presets": jt.preset_names(), "model_layers": spec.num_layers,
                  "mix_overrides": len(mix.overrides), "generated": out.shape[1] - ids.shape[1],
                  "cache_layers": len(cache.layers), "entry_points": len(eps), "ours": len(ours),
                  "register": f"{register.__module__}.{register.__name__}"}))
"""


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("jetson_tq-*.whl")
    return wheel


def _scratch_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # the test venv's packages after the scratch venv's own (torch, transformers, vLLM: reused, not downloaded)
    Path(purelib, "test_venv_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    p = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return venv


def _outside_env(tmp: Path) -> dict[str, str]:
    """The environment of a user outside the checkout: no PYTHONPATH, no jetson-tq overrides."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("JETSON_TQ_")}
    return env | {"HOME": str(tmp / "home"), "JETSON_TQ_CACHE": str(tmp / "cache")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_every_preset_once_and_byte_for_byte(wheel):
    """configs/ is the one copy: the wheel carries each file under jetson_tq/presets/ with the same bytes."""
    shipped = sorted(p.relative_to(REPO / "configs") for p in (REPO / "configs").rglob("*.yaml"))
    assert len(shipped) >= 10 and Path("models") in {p.parent for p in shipped}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for rel in shipped:
            assert z.read(f"jetson_tq/presets/{rel}") == (REPO / "configs" / rel).read_bytes(), rel
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert sum(n.startswith("jetson_tq/presets/") for n in names) == len(shipped)
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"jetson_tq"}, top  # the product alone: no lab/, benchmarks/, demos/ or tests/
    text = REPO / "jetson_tq" / "calibration" / "texts" / "calibration.txt"  # what ``auto`` calibrates on
    with zipfile.ZipFile(wheel) as z:
        assert z.read("jetson_tq/calibration/texts/calibration.txt") == text.read_bytes()
    assert "[vllm.general_plugins]\njetson_tq = jetson_tq.integrations.vllm.plugin:register" in entry_points
    assert "jetson-tq = jetson_tq.__main__:main" in entry_points


@pytest.mark.slow  # ~40 s on 2 cores: a wheel build, a venv, four Python starts that import torch
def test_the_installed_wheel_works_outside_the_checkout(tmp_path, wheel):
    venv = _scratch_venv(tmp_path, wheel)
    python, script = venv / "bin" / "python", venv / "bin" / "jetson-tq"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = _outside_env(tmp_path)

    def run(*cmd: str) -> subprocess.CompletedProcess:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=outside, env=env)
        assert p.returncode == 0, (cmd, p.stdout[-3000:], p.stderr[-3000:])
        return p

    import json

    facts = json.loads(run(str(python), "-c", CHECKS).stdout.strip().splitlines()[-1])
    assert facts["config"] == "mse_k4v3" and {"mse_k4v3", "fp16", "k4v4"} <= set(facts["presets"])
    assert facts["model_layers"] == 30 and facts["mix_overrides"] > 0
    assert facts["generated"] == 3 and facts["cache_layers"] == 2
    assert facts["ours"] == 1 and facts["register"] == "jetson_tq.integrations.vllm.plugin.register"

    capacity = json.loads(
        run(
            str(python),
            "-m",
            "jetson_tq",
            "capacity",
            "--model",
            "qwen2.5-7b-instruct",
            "--kv-budget-gb",
            "1",
            "--no-plot",
            "--measure-tokens",
            "256",
            "--json",
        ).stdout
    )
    assert capacity["measured"]["ok"], capacity["measured"]
    assert capacity["report"]["config"] == "mse_k4v3" and capacity["report"]["multiplier_pool"] > 4
    help_text = run(str(script), "--help").stdout
    for mode in ("serve", "capacity", "calibrate", "platform", "demo", "vllm"):
        assert f"    {mode}" in help_text, help_text
    assert run(str(script), "--version").stdout.strip().startswith("jetson-tq ")
    model_dir = tmp_path / "a model"
    model_dir.mkdir()
    line = run(str(script), "serve", "--dry-run", str(model_dir), "--port", "8001").stdout.strip()
    assert line.startswith("JETSON_TQ_CONFIG=mse_k4v3 ") and "-m vllm.entrypoints.openai.api_server" in line, line
