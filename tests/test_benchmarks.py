"""The benchmark scripts that need hardware we lack run here in their tiny form, so they stay runnable; figures that
are arithmetic on records are checked on records made up here."""

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
        "--models",
        "ViT (3 blocks, patch 4)",  # one net: the script's path is the same for each
        "--results",
        str(tmp_path),
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads((tmp_path / "gpu_scaling_tiny.json").read_text())
    assert set(measured) == {"ViT (3 blocks, patch 4)"}
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


class FakeClock:
    """A monotonic clock the test moves."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_gpu_session_runs_its_steps_in_order_each_in_its_bound_and_keeps_what_each_measured(tmp_path, capsys):
    from types import SimpleNamespace

    from benchmarks.gpu_session import Session, Step

    clock, ran = FakeClock(), []

    def measures(session, timeout_s):
        ran.append("measures")
        session.record("measures", {"status": "partial", "first": 1.0})
        return {"first": 1.0, "second": [2.0, 3.0, 4.0]}

    def hangs(session, timeout_s):  # a real process, killed at the step's own bound
        ran.append("hangs")
        session.command([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s)

    def fails_after_a_figure(session, timeout_s):
        ran.append("fails")
        session.record("fails", {"status": "partial", "kept": 7})
        clock.now += 600  # and the session's budget is spent
        raise ValueError("a step's own error")

    steps = [Step("measures", 60, measures), Step("hangs", 1, hangs), Step("fails", 60, fails_after_a_figure),
             Step("late", 60, lambda session, timeout_s: ran.append("late"))]  # fmt: skip
    Session(tmp_path, SimpleNamespace(budget_s=540), clock).run(steps)
    assert ran == ["measures", "hangs", "fails"]  # in order; none after the budget
    results = {step.name: json.loads((tmp_path / f"{step.name}.json").read_text()) for step in steps}
    assert results["measures"]["status"] == "done" and results["measures"]["second"] == [2.0, 3.0, 4.0]
    assert results["hangs"]["status"] == "timed out after 1 s"
    assert results["fails"] == {**results["fails"], "status": "failed: ValueError: a step's own error", "kept": 7}
    assert results["late"]["status"] == "not run: the session's budget is spent"
    summary = (tmp_path / "summary.md").read_text()
    assert summary in capsys.readouterr().out and "| measures | done" in summary and "3.0 [2.0-4.0]" in summary


def test_a_ratio_is_the_median_of_its_repetitions_and_unsettled_past_a_spread_of_5_percent():
    from benchmarks.gpu_session import ratio, shown

    settled = ratio([96, 97, 98, 99, 100], [100] * 5)
    assert settled == {"median": 0.98, "min": 0.96, "max": 1.0, "spread": 0.0408, "settled": True}
    assert shown(settled) == "0.98 (0.96-1.00)"
    unsettled = ratio([90, 97, 98, 99, 100], [100] * 5)
    assert not unsettled["settled"] and shown(unsettled) == "unsettled (0.90-1.00)"  # no figure where it moved 10%


def test_the_gpu_sessions_parity_step_takes_turns_between_train_py_and_the_hand_loop_on_cpu(tmp_path):
    run_benchmark("benchmarks.gpu_session", "--tiny", "--accelerator", "cpu", "--only", "parity", "--modes", "eager",
                  "--models", "ResNet-18", "--repeats", "3", "--out", str(tmp_path))  # fmt: skip
    parity = json.loads((tmp_path / "parity.json").read_text())
    assert parity["status"] == "done" and set(parity) - {"status", "seconds", "device_before", "after"} == {
        "ResNet-18, eager"
    }
    for model in ("ResNet-18, eager",):
        figures = parity[model]
        assert len(figures["train.py images/s"]) == len(figures["hand loop images/s"]) == 3
        assert all(rate > 0 for rate in figures["train.py images/s"] + figures["hand loop images/s"])
        assert set(figures["train.py / hand loop"]) == {"median", "min", "max", "spread", "settled"}
    assert "| parity | done" in (tmp_path / "summary.md").read_text()


def test_the_cost_of_a_lost_replica_counts_the_steps_trained_again_and_the_time_past_the_kill():
    from benchmarks.fault_tolerance import KILL_AT, cost

    steps = [(s, s * 0.1) for s in range(1, KILL_AT + 1)]  # 0.1 s a step up to the kill
    steps += [(s, KILL_AT * 0.1 + 10 + (s - 20) * 0.1) for s in range(21, KILL_AT + 3)]  # back from step 20, 10 s on
    figures = cost(steps)
    assert figures["steps_redone"] == KILL_AT - 20  # steps 21 to 35 trained again
    assert figures["step_s"] == pytest.approx(0.1)
    assert figures["seconds_lost"] == pytest.approx(10 + (KILL_AT + 1 - 20) * 0.1 - 0.1)
    survivor = [(s, s * 0.1 + (5 if s > KILL_AT else 0)) for s in range(1, 60)]  # a 5 s wait, no step again
    assert cost(survivor)["steps_redone"] == 0 and cost(survivor)["seconds_lost"] == pytest.approx(5)
