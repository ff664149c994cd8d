"""The benchmark scripts that need hardware we lack run here in their tiny form, so they stay runnable."""

import gzip
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
    for figures in measured.values():
        assert set(figures) == {"1", "hand loop, 1 device"} and figures["1"] > 0
        hand = figures["hand loop, 1 device"]
        assert hand["images_per_s"] > 0 and hand["logging_images_per_s"] > 0
        assert hand["flops_per_image"] > 1e6  # forward + backward of a real net, counted by torch
    assert "scaling efficiency" in (table := (tmp_path / "gpu_scaling_tiny.md").read_text())
    assert "train.py / hand loop" in table and "MFU" in table


def run_benchmark(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_step_profile_traces_train_py_and_the_hand_loop(tmp_path):
    traces = str(tmp_path / "traces")
    run_benchmark("benchmarks.step_profile", "--tiny", "--accelerator", "cpu", "--model", "ViT (3 blocks, patch 4)",
                  "--variant", "strategy=auto", "--traces", traces, "--results", str(tmp_path))  # fmt: skip
    runs = json.loads((tmp_path / "step_profile_vit_tiny.json").read_text())
    assert set(runs) == {"hand loop", "train.py strategy=auto"}
    for figures in runs.values():
        assert figures["images_per_s"] > 0 and figures["ms_per_step"] > 0
        assert figures["syncs_per_step"] == 0 and figures["device_busy"] == 0  # a CPU run: no device, no waits
        assert any(name.startswith("aten::") for name, _, _ in figures["top_host_ms_per_step"])
    for trace in ("vit_hand.json.gz", "vit_train.json.gz"):
        events = json.loads(gzip.open(tmp_path / "traces" / trace).read())["traceEvents"]
        assert any(e.get("cat") == "cpu_op" for e in events)


def test_folder_epoch_times_the_image_folder_against_images_on_the_device(tmp_path):
    run_benchmark("benchmarks.folder_epoch", "--tiny", "--accelerator", "cpu", "--results", str(tmp_path))
    rates = json.loads((tmp_path / "folder_epoch_tiny.json").read_text())
    assert set(rates) == {"images on the device (data=synthetic)", "JPEG folder, 1 loader workers",
                          "shards, 1 loader workers"}  # fmt: skip
    assert all(rate > 0 for rate in rates.values())
