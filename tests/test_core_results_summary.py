"""benchmarks/results/SUMMARY.md is what ``python benchmarks/summary.py`` generates from the JSON files
beside it (no hand edits, no machine paths), and every result file sits in a folder named for what it
measured."""

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.core

REPO = Path(__file__).resolve().parents[1]


def _summary_module():
    spec = importlib.util.spec_from_file_location("results_summary", REPO / "benchmarks" / "summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_is_generated_from_the_json():
    summary = _summary_module()
    text = summary.render()
    assert (REPO / "benchmarks" / "results" / "SUMMARY.md").read_text() == text, \
        "SUMMARY.md is out of date: run python benchmarks/summary.py"
    for path in sorted((REPO / "benchmarks" / "results").rglob("*.json")):
        assert path.parent.name in {folder for folder, _ in summary.SECTIONS}, path
        assert f"`{path.parent.name}/{path.name}`" in text
        assert summary.renderer(json.loads(path.read_text())) is not None, f"{path}: no table in summary.py"


def test_machine_paths_are_replaced():
    clean = _summary_module().clean_path
    assert clean("python3 x.py --out /root/out --model /work/main/launch/configs/llama") == \
        "python3 x.py --out OUT --model launch/configs/llama"
    assert clean("/opt/torch/.venv/bin/python3 -m a --model-path /root/.cache/sglang_wgkv/SmolLM2-135M-Instruct") == \
        "python -m a --model-path EMBEDDED_MODEL"
    assert clean("--gates /tmp/wgkv_run/lam0.1") == "--gates <lam0.1>"
