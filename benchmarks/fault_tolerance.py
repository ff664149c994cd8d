"""What fault_tolerance=torchft saves when a replica is lost, and what it costs when none is: on CPU, 2 processes,
digits + MLP, the global batch 64, 3 epochs of 19 steps.

- A lost replica: one of two replica groups (one process each) SIGKILLed as step KILL_AT begins and not started again,
  against torchrun's elastic restart on the same run (issue 61: `torchrun --nproc-per-node=2 --max-restarts=1`, ddp,
  `checkpoint_every_n_steps=EVERY`, `ckpt_path=auto`) with rank 1 killed at the same step. Each step takes STEP_S
  longer (a model's step). The cost: steps trained again, and seconds lost (from the last step before the kill to the
  first step past it, less one step's time).
- Nothing lost: seconds per training step (StepTimer, the last epoch) of 2 replica groups against ddp on the same 2
  processes, REPEATS runs each, alternated.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, free_port, markdown_table, train_command

KILL_AT, EVERY, STEP_S = 35, 20, 0.1
RUN = ["accelerator=cpu", "trainer.max_epochs=3", "test=false", "trainer.enable_progress_bar=false"]


def clock(output: Path, **kill) -> list[str]:
    extra = [f"+callbacks.clock.{k}={v}" for k, v in kill.items()]
    return ["+callbacks.clock._target_=benchmarks.common.StepClock", f"+callbacks.clock.output={output}",
            f"+callbacks.clock.seconds={STEP_S}", *extra]  # fmt: skip


def groups(scratch: Path, overrides: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Two replica groups of one process, group 0 serving the lighthouse; each with its own overrides."""
    port = free_port()
    procs = []
    for number, extra in enumerate(overrides):
        lighthouse = [f"fault_tolerance.lighthouse=http://localhost:{port}"] if number else []
        command = train_command(*RUN, "fault_tolerance=torchft", f"fault_tolerance.replica_group={number}",
                                f"fault_tolerance.lighthouse_port={port}", *lighthouse,
                                f"paths.log_dir={scratch / f'g{number}'}", *extra)  # fmt: skip
        procs.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=600) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]


def records(path: Path) -> list[tuple[int, float]]:
    return [(int(s), float(t)) for s, t in (line.split() for line in path.read_text().splitlines())]


def cost(steps: list[tuple[int, float]]) -> dict:
    """Steps trained again after the kill, and the seconds it cost: from the step before it to the first step past
    it, less the median step."""
    durations = [b - a for (_, a), (_, b) in zip(steps, steps[1:KILL_AT])]
    before = next(t for s, t in steps if s == KILL_AT)
    after = [(s, t) for s, t in steps if t > before]
    past = next(t for s, t in after if s == KILL_AT + 1)
    median = statistics.median(durations)
    redone = sum(1 for s, _ in after if s <= KILL_AT)
    return {"steps_redone": redone, "seconds_lost": past - before - median, "step_s": median}


def lost_replica_torchft(scratch: Path) -> dict:
    out = scratch / "torchft"
    done = groups(out, [clock(out / "clock0"), clock(out / "clock1", kill_at=KILL_AT)])
    assert done[0].returncode == 0 and done[1].returncode == -9, done[0].stderr[-2000:]
    return cost(records(out / "clock0"))


def lost_replica_elastic(scratch: Path) -> dict:
    out = scratch / "elastic"
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
               f"--master-port={free_port()}", str(ROOT / "train.py"), *RUN, "strategy=ddp", "ckpt_path=auto",
               f"checkpoint_every_n_steps={EVERY}", f"paths.log_dir={out / 'logs'}",
               *clock(out / "clock", kill_at=KILL_AT, kill_rank=1)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return cost(records(out / "clock"))


def step_seconds(scratch: Path, torchft: bool) -> float:
    timing = scratch / f"timing-{time.time_ns()}.json"
    timer = ["+callbacks.timer._target_=benchmarks.common.StepTimer", f"+callbacks.timer.output={timing}",
             "+callbacks.timer.warmup=5"]  # fmt: skip
    if torchft:
        done = groups(scratch / "steps", [timer, []])
        assert all(d.returncode == 0 for d in done), done[0].stderr[-2000:]
    else:
        command = train_command(*RUN, "strategy=ddp", "devices=2", f"paths.log_dir={scratch / 'steps'}", *timer)
        subprocess.run(command, cwd=ROOT, capture_output=True, check=True)
    figures = json.loads(timing.read_text())
    return figures["seconds"] / figures["steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="fault-tolerance-"))
    lost = {"torchft": lost_replica_torchft(scratch), "elastic": lost_replica_elastic(scratch)}
    steps: dict[str, list[float]] = {"ddp": [], "torchft": []}
    for _ in range(args.repeats):
        steps["ddp"].append(step_seconds(scratch, torchft=False))
        steps["torchft"].append(step_seconds(scratch, torchft=True))
    rows = [
        ["`fault_tolerance=torchft`, 2 groups of 1 (heartbeat 5 s)", lost["torchft"]["steps_redone"],
         f"{lost['torchft']['seconds_lost']:.1f}", "none: one group trains on"],
        [f"torchrun's elastic restart, ddp on 2 (checkpoint_every_n_steps={EVERY})", lost["elastic"]["steps_redone"],
         f"{lost['elastic']['seconds_lost']:.1f}", "both processes"],
    ]  # fmt: skip
    table = markdown_table(["a replica lost at step 35", "steps trained again", "seconds lost", "restarted"], rows)
    ddp, ft = statistics.median(steps["ddp"]), statistics.median(steps["torchft"])
    per_step = markdown_table(
        ["2 processes, nothing lost", "ms per step (median)", "range ms"],
        [[name, f"{statistics.median(v) * 1000:.1f}", f"{min(v) * 1000:.1f}-{max(v) * 1000:.1f}"]
         for name, v in (("ddp", steps["ddp"]), ("fault_tolerance=torchft", steps["torchft"]))],
    )  # fmt: skip
    verdict = (
        f"\nA lost replica: {lost['torchft']['seconds_lost']:.1f} s and {lost['torchft']['steps_redone']} steps under"
        f" torchft, {lost['elastic']['seconds_lost']:.1f} s and {lost['elastic']['steps_redone']} steps through the"
        f" elastic restart (steps of {STEP_S} s added).\nNothing lost: torchft's step takes {(ft - ddp) * 1000:.0f} ms"
        f" more than ddp's ({ddp / ft:.2f}x ddp's speed on this machine; its quorum and commit are a fixed cost per"
        f" step, overlapped with the forward pass where the quorum allows).\n"
        f"Made by `python -m benchmarks.fault_tolerance {' '.join(sys.argv[1:])}` on {os.cpu_count()} CPUs."
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fault_tolerance.md").write_text(table + "\n\n" + per_step + "\n" + verdict + "\n")
    (RESULTS / "fault_tolerance.json").write_text(json.dumps({"lost": lost, "step_s": steps}, indent=1) + "\n")
    print(table + "\n\n" + per_step + verdict)


if __name__ == "__main__":
    main()
