"""`make bench`: run every benchmark, then write benchmarks/RESULTS.md with each table and its target.

`python -m benchmarks.run_all parity startup` runs some; `--report-only` rewrites RESULTS.md from results/."""

import json
import os
import statistics
import subprocess
import sys

from benchmarks.common import RESULTS, ROOT

BENCHMARKS = [
    "parity",
    "parity_ddp",
    "host_syncs",
    "startup",
    "model_parallel_memory",
    "fault_tolerance",
    "diloco",
    "checkpoint_store",
]
BENCHMARKS += ["data_paths", "strategy_matrix", "gpu_scaling", "gpu_matrix", "predict_speed"]  # full examples
RUNS = {"host_syncs": [["accelerator=cpu"], ["strategy=ddp", "devices=2", "accelerator=cpu"]],
        "checkpoint_store": [[], ["--strategy", "fsdp"]]}  # fmt: skip


def verdicts() -> list[str]:
    lines = []
    parity = json.loads((RESULTS / "parity.json").read_text())
    single = statistics.median(parity["128"]["ratio"])
    vs_bare = statistics.median(parity["128"]["vs bare"])
    syncs = json.loads((RESULTS / "host_syncs.json").read_text())
    worst = max(r["syncs_per_non_logging_step"] for r in syncs["accelerator=cpu"].values())
    data = json.loads((RESULTS / "data.json").read_text())  # full examples
    decoders = list(data["decoder_images_per_s"].values())  # full examples
    decode_gain = statistics.median(decoders[-1]) / statistics.median(decoders[0])  # full examples
    ddp = statistics.median(json.loads((RESULTS / "parity_ddp.json").read_text())["ratio"])
    data_ratio = statistics.median(data["mnist_pil_s"]) / statistics.median(data["mnist_in_memory_s"])  # full examples
    startup = {k: statistics.median(v) for k, v in json.loads((RESULTS / "startup.json").read_text()).items()}
    first_step = startup["python train.py, to the first training step"] - startup['python -c "import torch, lightning"']
    checks = [
        ("parity, single process, MNIST defaults (batch 128)", single, 0.90, ">="),
        ("train.py / bare Lightning with its defaults (batch 128)", vs_bare, 0.98, ">="),
        ("host syncs per non-logging training step, default run", worst, 0, "<="),
        ("ImageNet train transform images/s per worker, now / before", decode_gain, 1.5, ">="),  # full examples
        ("parity, ddp on 2 processes (batch 128)", ddp, 0.90, ">="),
        ("MNIST data path, in memory / per-item PIL", data_ratio, 2.5, ">="),  # full examples
        ("`python train.py --help`, seconds", startup["python train.py --help"], 1.0, "<"),
        ("first training step minus bare import, seconds", first_step, 1.5, "<="),
    ]
    for name, value, target, op in checks:
        met = {">=": value >= target, "<": value < target, "<=": value <= target}[op]
        gap = "" if met else f" (missed by {abs(value - target):.2f})"
        lines.append(f"| {name} | {value:.2f} | {op} {target} | {'met' if met else 'NOT met' + gap} |")
    return "\n".join(["| target | measured | wanted | |", "| --- | --- | --- | --- |", *lines])


def host_syncs_table() -> str:
    rows = []
    for run, ranks in json.loads((RESULTS / "host_syncs.json").read_text()).items():
        r = ranks["rank0"]
        where = ", ".join(sorted({site.split(" ")[-1] for site in r["non_logging_sites"]})) or "-"
        rows.append(
            f"| `{run}` | {r['syncs_per_non_logging_step']} + {r['collectives_per_non_logging_step']} | {where} |"
            f" {r['syncs_per_logging_step']} + {r['collectives_per_logging_step']} |"
            f" {r['syncs_per_evaluation_step']} + {r['collectives_per_evaluation_step']} |"
        )
    head = "| run | syncs + collectives, non-logging step | from | logging step | evaluation step |"
    head += "\n| --- | --- | --- | --- | --- |"
    return head + "\n" + "\n".join(rows)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# full examples: begin
GPU_SCALING = (
    "On a GPU machine `make bench` runs `benchmarks/gpu_scaling.py` (ResNet-50, bf16-mixed, channels_last,"
    " 1..N GPUs; `--compile` adds torch.compile). The tests run its tiny CPU form (`--tiny --accelerator cpu`)."
)
GPU_MATRIX = "`python -m benchmarks.gpu_matrix` on a GPU host; `pytest tests/test_gpu.py` asserts the same runs."
STEP_PROFILE = "`python -m benchmarks.step_profile --model ResNet-50 --variant strategy=auto` on a GPU host."
FOLDER_EPOCH = "`python -m benchmarks.folder_epoch` on a GPU host (generates 16,000 JPEGs)."
DATA_GPU_HOST = "`python -m benchmarks.data_paths --workers 4 8 16` on a GPU host (adds nvJPEG decoding)."


def measured_on_a_gpu(table: str, how: str) -> str:
    """results/<table>, written by `make bench` on a GPU host, or how to measure it."""
    measured = RESULTS / table
    return measured.read_text() if measured.is_file() else f"Not measured: no CUDA on this machine. {how}"


# full examples: end
def main() -> None:
    names = [] if sys.argv[1:] == ["--report-only"] else sys.argv[1:] or BENCHMARKS
    for name in names:
        if name.startswith("gpu_") and not cuda_available():
            print(f"== {name}: no CUDA here, skipped (see RESULTS.md)", flush=True)
            continue
        print(f"== {name}", flush=True)
        for args in RUNS.get(name, [[]]):
            subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT, check=True)
    sections = [
        "# Benchmark results",
        f"Written by `make bench` on this machine: {os.cpu_count()} CPU cores, "
        f"{'CUDA GPUs' if cuda_available() else 'no GPU'}. Ratios compare runs made in the same invocation.",
        "## Targets", verdicts(),
        "## Parity: train.py vs bare Lightning vs a hand-written loop, single process",
        (RESULTS / "parity.md").read_text(),
        "## Host syncs and collectives per training step", host_syncs_table(),
        "## Parity under ddp (2 processes, gloo)", (RESULTS / "parity_ddp.md").read_text(),
        "## Data paths", (RESULTS / "data.md").read_text(),  # full examples
        "## Start-up", (RESULTS / "startup.md").read_text(),
        "## A lost replica: fault_tolerance=torchft against the elastic restart (CPU)",
        (RESULTS / "fault_tolerance.md").read_text(),
        "## Replica groups that meet every H steps: fault_tolerance.sync_every (DiLoCo, CPU)",
        (RESULTS / "diloco.md").read_text(),
        "## Checkpoints in an object store: checkpoint_store against the local disk (CPU)",
        (RESULTS / "checkpoint_store.md").read_text(), (RESULTS / "checkpoint_store_fsdp.md").read_text(),
        "## Predict: images/s against the test loop of the same checkpoint (one process, CPU)",  # full examples
        (RESULTS / "predict_speed.md").read_text(),  # full examples
        "## Strategy x precision (CPU)", (RESULTS / "strategy_matrix.md").read_text(),  # full examples
        "## Which mode when: state per rank (ViT, CPU)", (RESULTS / "model_parallel_memory.md").read_text(),
        "![strategy x precision](results/strategy_matrix.png)",  # full examples
        "## GPU scaling", measured_on_a_gpu("gpu_scaling.md", GPU_SCALING),  # full examples
        "## One GPU: every strategy x precision", measured_on_a_gpu("gpu_matrix.md", GPU_MATRIX),  # full examples
        "## One GPU: where a step's time goes", measured_on_a_gpu("step_profile.md", STEP_PROFILE),  # full examples
        "## One GPU: can the image folder feed it", measured_on_a_gpu("folder_epoch.md", FOLDER_EPOCH),  # full examples
        "## Data paths on a GPU host", measured_on_a_gpu("data_gpu_host.md", DATA_GPU_HOST),  # full examples
    ]  # fmt: skip
    (ROOT / "benchmarks" / "RESULTS.md").write_text("\n\n".join(s.strip() for s in sections) + "\n")
    print((ROOT / "benchmarks" / "RESULTS.md").read_text())


if __name__ == "__main__":
    main()
