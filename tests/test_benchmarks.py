"""The benchmark scripts that need hardware we lack run here in their tiny form, so they stay runnable."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_gpu_scaling_benchmark_runs_its_tiny_cpu_form(tmp_path):
    command = [
        sys.executable,
        "-m",
        "benchmarks.gpu_scaling",
        "--tiny",
        "--accelerator",
        "cpu",
        "--max-devices",
        "1",  # the multi-process path is ddp's, tested elsewhere; here the script's own paths, at half the time
        "--results",
        str(tmp_path),
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads((tmp_path / "gpu_scaling_tiny.json").read_text())
    assert set(measured) == {"ResNet-18", "ViT (3 blocks, patch 4)"}  # a conv net and a transformer
    assert all(set(m) == {"1", "hand loop, 1 device"} and all(v > 0 for v in m.values()) for m in measured.values())
    assert "scaling efficiency" in (table := (tmp_path / "gpu_scaling_tiny.md").read_text())
    assert "train.py / hand loop" in table
