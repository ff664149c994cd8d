"""Where a training step's time goes: `python train.py` against the hand-written loop of the same net, batch,
precision and optimizer (benchmarks.hand_loop), each timed and then traced by torch.profiler in one process.

Per run: images/s over `--steps` timed steps (the device's queue drained before both clock reads), then a trace of
`--profile-steps` more: the device's busy share of the wall time, kernels and CUDA runtime calls per step (a
cudaStreamSynchronize is the host waiting for the device), and the ops with the most host and device time.
Each `--variant` is one more train.py run with those overrides added (e.g. `strategy=ddp`, `callbacks=none`).

    python -m benchmarks.step_profile --model ResNet-50 --variant strategy=auto --variant strategy=ddp

Writes results/step_profile_<model>.{md,json} and, with `--traces DIR`, Chrome traces (.json.gz) of the hand loop
and the first variant.
`--tiny --accelerator cpu` runs the same path at toy sizes on the CPU: how the test suite checks it.
"""

import argparse
import gzip
import json
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import lightning as L
import torch

from benchmarks.common import RESULTS, compose_config, markdown_table, train_command

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def merged_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarise(prof, steps: int, seconds: float, images: int) -> dict:
    """The trace of `steps` steps taking `seconds`, per step."""
    device_events = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]  # kernels, copies; not the spans of ranges
    busy_us = merged_length([(e.time_range.start, e.time_range.end) for e in device_events])
    calls = Counter(e.name for e in prof.events() if e.name.startswith("cuda"))
    averages = prof.key_averages()

    def top(attribute: str) -> list[list]:
        ranked = sorted(averages, key=lambda a: getattr(a, attribute, 0), reverse=True)[:15]
        return [[a.key[:60], round(a.count / steps, 1), round(getattr(a, attribute, 0) / 1000 / steps, 3)]
                for a in ranked if getattr(a, attribute, 0) > 0]  # fmt: skip

    return {
        "images_per_s": images / seconds,
        "ms_per_step": 1000 * seconds / steps,
        "device_busy": busy_us / 1e6 / seconds,
        "device_ops_per_step": len(device_events) / steps,
        "syncs_per_step": sum(calls[name] for name in SYNCS) / steps,
        "runtime_calls_per_step": {k: round(v / steps, 1) for k, v in calls.most_common(12)},
        "top_host_ms_per_step": top("self_cpu_time_total"),
        "top_device_ms_per_step": top("self_device_time_total"),
    }


def profiler(device: torch.device):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, with_stack=True)


def save_trace(prof, trace: str | None) -> None:
    if not trace:
        return
    plain = Path(trace).with_suffix("")  # x.json.gz -> x.json
    prof.export_chrome_trace(str(plain))
    with open(plain, "rb") as src, gzip.open(trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain.unlink()


def _drained_now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StepProfiler(L.Callback):
    """In a train.py run (rank 0): times batches [warmup, warmup + timed), then traces the next `profiled` ones.
    Writes the figures of both windows to `output` (JSON), the trace to `trace` (.json.gz) if given."""

    def __init__(self, output: str, warmup: int, timed: int, profiled: int, trace: str | None = None):
        self.output, self.trace = Path(output), trace
        self.warmup, self.timed, self.profiled = warmup, timed, profiled
        self.start = self.timed_seconds = 0.0
        self.prof = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return
        if batch_idx == self.warmup:
            self.start = _drained_now(pl_module.device)
        elif batch_idx == self.warmup + self.timed:
            self.timed_seconds = _drained_now(pl_module.device) - self.start
            self.prof = profiler(pl_module.device).__enter__()
            self.start = _drained_now(pl_module.device)
        elif batch_idx == self.warmup + self.timed + self.profiled:
            seconds = _drained_now(pl_module.device) - self.start
            self.prof.__exit__(None, None, None)
            batch = trainer.datamodule.batch_size
            figures = summarise(self.prof, self.profiled, seconds, batch * self.profiled)
            figures["images_per_s"] = batch * self.timed / self.timed_seconds  # the untraced window's
            figures["ms_per_step"] = 1000 * self.timed_seconds / self.timed
            self.output.write_text(json.dumps(figures))
            save_trace(self.prof, self.trace)
            self.prof = None


def train_py(overrides: list[str], args, scratch: Path, trace: str | None) -> dict:
    import subprocess

    output = scratch / f"profile-{time.time_ns()}.json"
    command = train_command(*overrides, "test=false", f"paths.log_dir={scratch / 'logs'}",
                            "+callbacks.profile._target_=benchmarks.step_profile.StepProfiler",
                            f"+callbacks.profile.output={output}", f"+callbacks.profile.warmup={args.warmup}",
                            f"+callbacks.profile.timed={args.steps}",
                            f"+callbacks.profile.profiled={args.profile_steps}",
                            f"+callbacks.profile.trace={trace}")  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(output.read_text())


def hand_loop(overrides: list[str], args, scratch: Path, trace: str | None) -> dict:
    from benchmarks.hand_loop import hand_step, seconds

    cfg = compose_config(overrides, scratch / "hand")
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    step = hand_step(cfg, args.precision, args.compile, device)
    for _ in range(args.warmup):
        step()
    batch = cfg.data.batch_size
    timed = seconds(step, args.steps, device)
    with profiler(device) as prof:
        traced = seconds(step, args.profile_steps, device)
    figures = summarise(prof, args.profile_steps, traced, batch * args.profile_steps)
    figures["images_per_s"], figures["ms_per_step"] = batch * args.steps / timed, 1000 * timed / args.steps
    save_trace(prof, trace)
    return figures


def main() -> None:
    from benchmarks.gpu_scaling import MODELS, TINY, overrides

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ResNet-50", help=f"one of {list(MODELS)} (--tiny: {list(TINY)})")
    parser.add_argument("--variant", action="append", default=[], help="train.py overrides of one more run")
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--batch-per-device", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="timed steps (untraced)")
    parser.add_argument("--profile-steps", type=int, default=12)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on CPU: checks the path, not the speed")
    parser.add_argument("--traces", type=Path, default=None, help="a folder for one Chrome trace per run")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.strategy = "auto"  # overrides()'s default; a variant names its own
    if args.tiny:
        args.batch_per_device, args.warmup, args.steps, args.profile_steps, args.precision = 8, 2, 3, 2, "32"
    model = (TINY if args.tiny else MODELS)[args.model]
    scratch = Path(tempfile.mkdtemp(prefix="step-profile-"))
    args.steps += args.profile_steps + 1  # overrides() sizes the epoch: every window inside it
    base = overrides(model, 1, args)
    args.steps -= args.profile_steps + 1
    tag = args.model.split()[0].replace("/", "").lower() + ("_compiled" if args.compile else "")
    if args.traces:
        args.traces.mkdir(parents=True, exist_ok=True)

    def trace_path(name: str) -> str | None:
        return str(args.traces / f"{tag}_{name}.json.gz") if args.traces else None

    runs = {"hand loop": hand_loop(base, args, scratch, trace_path("hand"))}
    print(f"hand loop: {runs['hand loop']['images_per_s']:,.0f} images/s", flush=True)
    for i, variant in enumerate(args.variant or ["strategy=auto"]):
        trace = trace_path("train") if i == 0 else None  # the first variant's: traces are large
        runs[f"train.py {variant}"] = train_py(base + variant.split(), args, scratch, trace)
        print(f"train.py {variant}: {runs[f'train.py {variant}']['images_per_s']:,.0f} images/s", flush=True)
    hand = runs["hand loop"]["images_per_s"]
    columns = ["run", "images/s", "/ hand loop", "ms/step", "device busy", "device ops/step", "host syncs/step"]
    rows = [[name, f"{r['images_per_s']:,.0f}", f"{r['images_per_s'] / hand:.2f}", f"{r['ms_per_step']:.1f}",
             f"{r['device_busy']:.0%}", f"{r['device_ops_per_step']:.0f}", f"{r['syncs_per_step']:.1f}"]
            for name, r in runs.items()]  # fmt: skip
    header = (f"{args.model}, {args.precision}{', torch.compile' if args.compile else ''}, batch "
              f"{args.batch_per_device}, images on the device; {args.steps} steps timed after {args.warmup}, "
              f"then {args.profile_steps} traced (device busy, ops and syncs from the trace)")  # fmt: skip
    table = markdown_table(columns, rows)
    args.results.mkdir(parents=True, exist_ok=True)
    name = f"step_profile_{tag}" + ("_tiny" if args.tiny else "")
    (args.results / f"{name}.md").write_text(header + ".\n\n" + table + "\n")
    (args.results / f"{name}.json").write_text(json.dumps(runs, indent=1) + "\n")
    print(header + "\n" + table)


if __name__ == "__main__":
    main()
