"""A GPU session in one command (`bash benchmarks/gpu_session.sh OUT`): every measurement a GPU host is lent for, in
order, within `--budget-s` (9 min), each step under its own timeout, each result written into OUT as soon as it is
measured (a session cut short leaves what it measured), and a summary table last (OUT/summary.md, also printed).

Figures that hold: train.py and the hand-written loop (benchmarks/hand_loop.py) run side by side as two processes,
each warmed up once, then take turns: a window of `--window-steps` steps of train.py, one of the hand loop, one of
train.py, ... (`--repeats` each, the device's queued work finished before each clock read). A ratio is the median of
the repetitions' ratios with its spread (min-max); a spread over 5% of the median is reported as unsettled, not as a
figure. The device's clocks and temperature are read before and after each step.

Steps, in this order (the budget cuts the last; `--only NAME ...` runs some): device, parity (ResNet-50 and ViT-S/16,
eager and compiled), recipes (the `experiment=fast_*` recipes' images/s and MFU), floor (1-GPU ddp through torch's
agent on this host's torch), gpu_tier (tests/test_gpu.py), stop (a stop signal saves last.ckpt), fsdp_async_save (fsdp
with checkpoint_every_n_steps: sharded saves under NCCL, written while training goes on), decode (data.decode=gpu
against images on the device), profile (benchmarks/step_profile.py for each model whose ratio fell short of 0.95).
Every command run is in OUT/commands.log.
`--tiny --accelerator cpu` runs the same path at toy sizes: how the test suite checks it.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
UNSETTLED = 0.05  # a spread (max - min) above this share of the median is no figure
MODELS = {"ResNet-50": ["model=resnet50", "channels_last=true"], "ViT-S/16": ["model=vit_s16"]}
TINY = {"ResNet-18": ["model=resnet18", "channels_last=true"], "ViT (3 blocks, patch 4)": ["model=vit"]}
RECIPES = {"ResNet-50": "fast_resnet50", "ViT-S/16": "fast_vit_s16"}


@dataclass
class Step:
    name: str
    timeout_s: float  # its own bound; the session's remaining budget may cut it shorter
    run: object  # (session, timeout_s) -> figures (a JSON-able dict)


class Session:
    def __init__(self, out: Path, args, clock=time.monotonic):
        self.out, self.args, self.clock = out, args, clock
        self.deadline = clock() + args.budget_s
        self.results: dict[str, dict] = {}
        out.mkdir(parents=True, exist_ok=True)

    def run(self, steps: list[Step]) -> None:
        for step in steps:
            left = self.deadline - self.clock()
            if left < 5:
                self.record(step.name, {"status": "not run: the session's budget is spent"})
                continue
            before, began = device_state(), self.clock()
            try:
                figures = {"status": "done", **step.run(self, min(step.timeout_s, left))}
            except subprocess.TimeoutExpired:  # what it measured before stays
                figures = {
                    **self.results.get(step.name, {}),
                    "status": f"timed out after {min(step.timeout_s, left):.0f} s",
                }
            except Exception as err:  # a step that fails leaves the others to run
                figures = {
                    **self.results.get(step.name, {}),
                    "status": f"failed: {type(err).__name__}: {str(err).strip()[-2000:]}",
                }
            figures |= {"seconds": round(self.clock() - began, 1), "device_before": before, "after": device_state()}
            self.record(step.name, figures)
        report = summary_table(self.results)
        (self.out / "summary.md").write_text(report + "\n")
        print(report, flush=True)

    def record(self, name: str, figures: dict) -> None:
        self.results[name] = figures
        (self.out / f"{name}.json").write_text(json.dumps(figures, indent=1) + "\n")
        print(f"{name}: {figures['status']}", flush=True)

    def command(self, argv: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
        """`argv` run from the repository root, stdout and stderr kept in OUT/<first word>.log; killed at timeout."""
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, **kwargs)
        with open(self.out / "commands.log", "a") as log:
            log.write(f"$ {' '.join(argv)}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}(exit {proc.returncode})\n")
        return proc


def device_state() -> dict | None:
    """The GPU's clocks (MHz), temperature (C) and power (W), where nvidia-smi answers."""
    fields = "name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.splitlines()[0]  # fmt: skip
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None
    return dict(zip(fields.split(","), (value.strip() for value in line.split(","))))


def ratio(numerators: list[float], denominators: list[float]) -> dict:
    """The median of the repetitions' ratios, their spread, and whether that spread leaves it unsettled."""
    ratios = [n / d for n, d in zip(numerators, denominators)]
    median = statistics.median(ratios)
    spread = (max(ratios) - min(ratios)) / median
    return {"median": round(median, 4), "min": round(min(ratios), 4), "max": round(max(ratios), 4),
            "spread": round(spread, 4), "settled": spread <= UNSETTLED}  # fmt: skip


def shown(figure: dict) -> str:
    if not figure["settled"]:
        return f"unsettled ({figure['min']:.2f}-{figure['max']:.2f})"
    return f"{figure['median']:.2f} ({figure['min']:.2f}-{figure['max']:.2f})"


def summary_table(results: dict[str, dict]) -> str:
    """A row per step and figure: a ratio as its median and spread (or unsettled), repetitions as median [min-max]."""
    rows = ["| step | status | figure | value |", "| --- | --- | --- | --- |"]
    for name, figures in results.items():
        said = {k: v for k, v in figures.items() if k not in ("status", "device_before", "after", "seconds")}
        status = f"{figures['status']} ({figures.get('seconds', 0)} s)"
        rows += [f"| {name} | {status} | {key} | {value_of(value)} |" for key, value in said.items()] or [
            f"| {name} | {status} | | |"
        ]
    return "\n".join(rows)


def value_of(value) -> str:
    if isinstance(value, dict) and "settled" in value:
        return shown(value)
    if isinstance(value, dict):
        return "; ".join(f"{k}: {value_of(v)}" for k, v in value.items())
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return f"{statistics.median(value):,.1f} [{min(value):,.1f}-{max(value):,.1f}]"
    return str(value)


# train.py and the hand loop taking turns: each reads "go" on stdin, trains a window of steps and appends its images/s
# as a line to a file of its own; anything else on stdin ends it.


class Turns(L.Callback):
    """After `warmup` steps, training waits for "go" on stdin before each window of `steps` steps and appends the
    window's images/s to `report`."""

    def __init__(self, steps: int, warmup: int, report: str):
        self.steps, self.warmup, self.report, self.began = steps, warmup, Path(report), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx >= self.warmup and (batch_idx - self.warmup) % self.steps == 0:
            if sys.stdin.readline().strip() != "go":
                os._exit(0)
            self.began = synchronized(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if batch_idx >= self.warmup and (batch_idx - self.warmup) % self.steps == self.steps - 1:
            rate = trainer.datamodule.batch_size * self.steps / (synchronized(pl_module.device) - self.began)
            with open(self.report, "a") as report:
                report.write(f"{rate}\n")


def synchronized(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def hand_turns(overrides: list[str], steps: int, warmup: int, report: str, precision: str, compile: bool) -> None:
    """The hand loop taking turns as train.py does (Turns), on the same config."""
    from benchmarks.common import compose_config
    from benchmarks.hand_loop import hand_step

    cfg = compose_config(overrides, Path(tempfile.mkdtemp(prefix="hand-")) / "run")
    device = torch.device("cuda" if cfg.accelerator == "gpu" else "cpu")
    step = hand_step(cfg, precision, compile, device)
    for _ in range(warmup):
        step()
    while sys.stdin.readline().strip() == "go":
        began = synchronized(device)
        for _ in range(steps):
            step()
        with open(report, "a") as out:
            out.write(f"{cfg.data.batch_size * steps / (synchronized(device) - began)}\n")


def overrides(model: list[str], args, compiled: bool, steps: int) -> list[str]:
    size, batch = (32, 8) if args.tiny else (224, args.batch)
    return [*model, "data=synthetic", "data.on_device=true", "strategy=auto", "devices=1",
            f"accelerator={args.accelerator}", f"precision={args.precision}", f"data.image_shape=[3,{size},{size}]",
            f"data.batch_size={batch}", f"data.train_size={batch * steps}", f"compile={str(compiled).lower()}",
            "trainer.max_epochs=1", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false", "test=false",
            "callbacks=none"]  # fmt: skip


def side_by_side(session: Session, model: list[str], compiled: bool, timeout_s: float) -> dict:
    """train.py and the hand loop, warmed up once each, taking turns `--repeats` times (see the module's doc)."""
    args, scratch = session.args, Path(tempfile.mkdtemp(prefix="parity-"))
    config = overrides(model, args, compiled, args.warmup + args.repeats * args.window_steps + 1)
    window = [f"--window-steps={args.window_steps}", f"--warmup={args.warmup}"]
    commands = {
        "train.py": [sys.executable, "train.py", *config, f"paths.log_dir={scratch}",
                     "+callbacks.turns._target_=benchmarks.gpu_session.Turns",
                     f"+callbacks.turns.steps={args.window_steps}", f"+callbacks.turns.warmup={args.warmup}",
                     f"+callbacks.turns.report={scratch / 'train.py'}"],
        "hand loop": [sys.executable, "-m", "benchmarks.gpu_session", "hand", *window, f"--report={scratch / 'hand'}",
                      f"--precision={args.precision}", *(["--compile"] * compiled), "--", *config],
    }  # fmt: skip
    reports = {"train.py": scratch / "train.py", "hand loop": scratch / "hand"}
    with open(session.out / "commands.log", "a") as log:  # the exact commands, beside the figures
        log.writelines(f"$ {' '.join(argv)}\n" for argv in commands.values())
    procs = {name: subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                    stderr=open(session.out / f"{name.replace(' ', '_')}.log", "a"))
             for name, argv in commands.items()}  # fmt: skip
    deadline, rates = session.clock() + timeout_s, {name: [] for name in commands}
    try:
        for repeat in range(args.repeats):
            for name, proc in procs.items():
                proc.stdin.write("go\n")
                proc.stdin.flush()
                rates[name].append(next_line(reports[name], repeat, proc, session, deadline))
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    return {"train.py images/s": rates["train.py"], "hand loop images/s": rates["hand loop"],
            "train.py / hand loop": ratio(rates["train.py"], rates["hand loop"])}  # fmt: skip


def next_line(report: Path, index: int, proc, session: Session, deadline: float) -> float:
    """Line `index` of `report` once its process has written it; its end, or the deadline passing, raise."""
    while True:
        lines = report.read_text().splitlines() if report.exists() else []
        if len(lines) > index:
            return round(float(lines[index]), 1)
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[1]} ended (exit {proc.returncode}) before its window; see its log")
        if session.clock() > deadline:
            raise subprocess.TimeoutExpired(proc.args, 0)
        time.sleep(0.05)


def parity(session: Session, timeout_s: float) -> dict:
    figures, models, deadline = {}, TINY if session.args.tiny else MODELS, session.clock() + timeout_s
    for name, model in [(name, models[name]) for name in session.args.models or models]:
        for compiled in [mode == "compiled" for mode in session.args.modes]:
            key = f"{name}, {'compiled' if compiled else 'eager'}"
            figures[key] = side_by_side(session, model, compiled, deadline - session.clock())
            session.record("parity", {"status": "partial", **figures})  # what is measured stays, if cut short
    return figures


def recipes(session: Session, timeout_s: float) -> dict:
    """Each `experiment=fast_*` recipe's images/s and model FLOPs utilisation (its net's training FLOPs, counted by
    torch, per image, x images/s / --peak-flops)."""
    from benchmarks.common import timed_training

    figures, deadline, args = {}, session.clock() + timeout_s, session.args
    for name, recipe in RECIPES.items():
        extra = (
            ["data.image_shape=[3,32,32]", "data.batch_size=8", "data.train_size=64", "model=vit"] if args.tiny else []
        )
        run = [f"experiment={recipe}", f"accelerator={args.accelerator}", *extra, "trainer.max_epochs=1"]
        timing = timed_training(run, Path(tempfile.mkdtemp(prefix="recipe-")), warmup=2 if args.tiny else 20)
        rate = timing["samples"] / timing["seconds"]
        flops = flops_per_image(run) if not args.tiny else 0
        figures[name] = {"images/s": round(rate), "MFU": round(flops * rate / args.peak_flops, 4)}
        if session.clock() > deadline:
            raise subprocess.TimeoutExpired(name, timeout_s)
    return figures


def flops_per_image(run: list[str]) -> float:
    from benchmarks.common import compose_config
    from benchmarks.hand_loop import hand_step, training_flops_per_image

    cfg, device = compose_config(run, Path(tempfile.mkdtemp()) / "run"), torch.device("cuda")
    return training_flops_per_image(
        hand_step(cfg, str(cfg.precision), False, device).net, list(cfg.data.image_shape), device
    )


def train_py(session: Session, timeout_s: float, *overrides_: str) -> subprocess.CompletedProcess:
    scratch = tempfile.mkdtemp(prefix="session-")
    args = [f"accelerator={session.args.accelerator}", "debug=limit", f"paths.log_dir={scratch}"]
    return session.command([sys.executable, "train.py", *args, *overrides_], timeout_s)


def floor(session: Session, timeout_s: float) -> dict:
    """1-GPU ddp through torch's elastic agent, on this host's torch."""
    proc = train_py(session, timeout_s, "strategy=ddp", "devices=1")
    return {"torch": torch.__version__, "ddp through the agent": "passed" if proc.returncode == 0 else
            f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}  # fmt: skip


def stop(session: Session, timeout_s: float) -> dict:
    """SIGTERM once training runs: last.ckpt saved, exit 143, the line."""
    scratch = Path(tempfile.mkdtemp(prefix="stop-"))
    command = [sys.executable, "train.py", f"accelerator={session.args.accelerator}", "trainer.max_epochs=1000",
               f"paths.log_dir={scratch}", "trainer.enable_progress_bar=false"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = session.clock() + timeout_s
    while not list(scratch.glob("train/runs/*/checkpoints/last.ckpt")) and session.clock() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=max(1.0, deadline - session.clock()))
    return {"exit": proc.returncode, "line": err.strip().splitlines()[-1:]}


def fsdp_async_save(session: Session, timeout_s: float) -> dict:
    devices = 1 if session.args.accelerator == "gpu" else 2
    proc = train_py(session, timeout_s, "strategy=fsdp", f"devices={devices}", "checkpoint_every_n_steps=2")
    return {"exit": proc.returncode, "last line": proc.stderr.strip().splitlines()[-1:]}


def decode(session: Session, timeout_s: float) -> dict:
    tiny, accelerator = ["--tiny"] * session.args.tiny, f"--accelerator={session.args.accelerator}"
    proc = session.command(
        [sys.executable, "-m", "benchmarks.folder_epoch", *tiny, accelerator, f"--results={session.out}"], timeout_s
    )
    return {"exit": proc.returncode, "table": proc.stdout.strip().splitlines()[-6:]}


def profile(session: Session, timeout_s: float) -> dict:
    """Where a step's time goes, for each model whose parity figure fell short of 0.95 of the hand loop (or none was
    settled): benchmarks/step_profile.py, its tables and traces in OUT."""
    parity, short, done = session.results.get("parity", {}), [], {}
    for key, figures in parity.items():
        if isinstance(figures, dict) and "train.py / hand loop" in figures:
            measured = figures["train.py / hand loop"]
            if not measured["settled"] or measured["median"] < 0.95:
                short.append(key)
    for key in short:
        name, mode = key.split(", ")
        tiny = ["--tiny"] * session.args.tiny
        proc = session.command([sys.executable, "-m", "benchmarks.step_profile", "--model", name, *tiny,
                                f"--accelerator={session.args.accelerator}", "--variant", "strategy=auto",
                                *(["--compile"] * (mode == "compiled")), f"--results={session.out}",
                                f"--traces={session.out / 'traces'}"], timeout_s)  # fmt: skip
        done[key] = "profiled" if proc.returncode == 0 else f"exit {proc.returncode}"
    return done or {"none short": "every parity figure settled at 0.95 or more"}


def gpu_tier(session: Session, timeout_s: float) -> dict:
    proc = session.command([sys.executable, "-m", "pytest", "tests/test_gpu.py", "-q", "-o", "addopts="], timeout_s)
    return {"exit": proc.returncode, "result": proc.stdout.strip().splitlines()[-1:]}


STEPS = [("device", 15, lambda s, t: {"device": device_state(), "python": sys.version.split()[0]}),
         ("parity", 300, parity), ("recipes", 90, recipes), ("floor", 60, floor), ("gpu_tier", 180, gpu_tier),
         ("stop", 60, stop), ("fsdp_async_save", 60, fsdp_async_save), ("decode", 60, decode),
         ("profile", 120, profile)]  # fmt: skip


def main(argv: list[str] | None = None, clock=time.monotonic) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hand"]:  # the hand loop's side of a parity step (side_by_side)
        parser = argparse.ArgumentParser(prog="gpu_session hand")
        parser.add_argument("--window-steps", type=int)
        parser.add_argument("--warmup", type=int)
        parser.add_argument("--report")
        parser.add_argument("--precision")
        parser.add_argument("--compile", action="store_true")
        parser.add_argument("overrides", nargs="*")
        hand = parser.parse_args(argv[1:])
        return hand_turns(hand.overrides, hand.window_steps, hand.warmup, hand.report, hand.precision, hand.compile)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder each step's result is written into")
    parser.add_argument("--budget-s", type=float, default=540, help="the whole session's bound (9 min)")
    parser.add_argument("--only", nargs="+", choices=[name for name, _, _ in STEPS], help="these steps, in order")
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--batch", type=int, default=128, help="images per step of the parity runs")
    parser.add_argument("--repeats", type=int, default=5, help="windows of each, taking turns")
    parser.add_argument("--window-steps", type=int, default=30)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--models", nargs="+", default=None, help="the parity step's (default: all of them)")
    parser.add_argument("--warmup", type=int, default=15, help="steps before the first window (compile, autotune)")
    parser.add_argument("--peak-flops", type=float, default=989e12, help="the device's dense bf16 peak (H100/H200)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: checks the path, not the speed")
    args = parser.parse_args(argv)
    if args.tiny:
        args.precision, args.window_steps, args.warmup = "32", 3, 2
    steps = [Step(name, timeout, run) for name, timeout, run in STEPS if not args.only or name in args.only]
    Session(args.out, args, clock).run(steps)


if __name__ == "__main__":
    main()
