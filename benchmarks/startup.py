"""Start-up: wall time of `--help`, of config errors, of `python train.py` to its first training step and of a whole
short ddp run on 2 processes, next to the bare `python -c "import torch, lightning"` on the same machine (REPEATS runs
each, alternated). `--baseline REV`: the ddp run of git revision REV too (a worktree of it), in the same alternation."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, markdown_table, train_command

TRAIN = train_command()
IMPORT_TORCH = 'python -c "import torch"'
DDP = ["strategy=ddp", "devices=2", "accelerator=cpu", "debug=limit"]


def ddp_run(tree: Path, cwd: Path) -> float:
    """`python train.py strategy=ddp devices=2 debug=limit` of the source tree `tree`, start to exit."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(tree / "train.py"), *DDP, f"paths.log_dir={cwd / 'logs'}"],
        cwd=cwd,
        capture_output=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return time.perf_counter() - start


def worktree(revision: str, scratch: Path) -> Path:
    tree = scratch / f"baseline-{revision}"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), revision], check=True, capture_output=True
    )
    return tree


def wall(command: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=cwd, capture_output=True)
    return time.perf_counter() - start


def to_first_step(cwd: Path) -> float:
    marker = cwd / "first_step"
    command = [
        *TRAIN,
        f"paths.log_dir={cwd / 'logs'}",
        "+callbacks.first_step._target_=benchmarks.common.ExitAtFirstStep",
        f"+callbacks.first_step.output={marker}",
    ]
    start = time.time()
    subprocess.run(command, cwd=ROOT, capture_output=True)
    return float(marker.read_text()) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="a git revision whose ddp run is timed beside this tree's")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="startup-"))
    ddp = f"python train.py {' '.join(DDP)} (whole run)"
    cases = {
        IMPORT_TORCH: lambda: wall([sys.executable, "-c", "import torch"], scratch),
        'python -c "import torch, lightning"': lambda: wall([sys.executable, "-c", "import torch, lightning"], scratch),
        "python train.py --help": lambda: wall([*TRAIN, "--help"], scratch),
        "python train.py strategy=fdsp (unknown option)": lambda: wall([*TRAIN, "strategy=fdsp"], scratch),
        "python train.py strategy=ddp devices=2 data.batch_size=63 (bad batch)": lambda: wall(
            [*TRAIN, "strategy=ddp", "devices=2", "data.batch_size=63", f"paths.log_dir={scratch}"], scratch),
        "python train.py, to the first training step": lambda: to_first_step(scratch),
        ddp: lambda: ddp_run(ROOT, scratch),
    }  # fmt: skip
    if args.baseline:
        baseline = worktree(args.baseline, scratch)
        cases[f"{ddp}, at {args.baseline}"] = lambda: ddp_run(baseline, scratch)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, measure in cases.items():
            times[name].append(measure())
    medians = {name: statistics.median(t) for name, t in times.items()}
    bare = medians['python -c "import torch, lightning"']
    rows = [[f"`{name}`", f"{medians[name]:.2f}", f"{min(t):.2f}-{max(t):.2f}"] for name, t in times.items()]
    table = markdown_table(["command", "median s", "range s"], rows)
    first = medians["python train.py, to the first training step"]
    verdict = (
        f"\nTo the first training step: bare import + {first - bare:.2f} s (target: + 1.5 s or less)."
        f"\n`--help`: {medians['python train.py --help']:.2f} s (target: under 1 s and under half of"
        f" `import torch`, {medians[IMPORT_TORCH]:.2f} s)."
    )
    if args.baseline:
        ratio = medians[ddp] / medians[f"{ddp}, at {args.baseline}"]
        verdict += f"\nThe ddp run: {ratio:.2f}x its time at {args.baseline} (target: 1.2x or less)."
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], capture_output=True)
    verdict += f"\nMade by `python -m benchmarks.startup {' '.join(sys.argv[1:])}`."
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "startup.md").write_text(table + "\n" + verdict + "\n")
    (RESULTS / "startup.json").write_text(json.dumps(times, indent=1) + "\n")
    print(table + verdict)


if __name__ == "__main__":
    main()
