"""One GPU: every strategy that runs on one device x every precision, and the extras (channels_last, compile,
fsdp's options, tp/pp/2D at 1, sync_batchnorm, EMA), each a short `python train.py` run; prints and writes
results/gpu_matrix.md with each run's outcome (ran and its test/acc, or the one-line refusal, or the error).

    python -m benchmarks.gpu_matrix [--parallel 4]

Runs 4 at a time (one GPU holds them all); about 5 minutes on an H100 host with 16 cores.
"""

import argparse
import json
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from benchmarks.common import RESULTS, markdown_table, train_command

BASE = ["accelerator=gpu", "devices=1", "debug=limit", "trainer.max_epochs=1", "trainer.enable_progress_bar=false"]
R18 = ["data=synthetic", "model=resnet18", "data.image_shape=[3,64,64]", "data.num_classes=10",
       "data.train_size=256", "data.eval_size=64", "data.batch_size=32"]  # fmt: skip
RUNS = [[f"strategy={s}", f"precision={p}"] for s in ("auto", "dp", "ddp", "ddp_spawn", "fsdp")
        for p in ("32", "16-mixed", "bf16-mixed", "bf16-true")]  # fmt: skip
RUNS += [
    ["model=cnn", "channels_last=true", "precision=bf16-mixed"],
    ["model=cnn", "compile=true"],
    [*R18, "compile=true", "precision=bf16-mixed", "channels_last=true"],
    [*R18, "strategy=ddp", "compile=true", "precision=bf16-mixed", "channels_last=true"],
    [*R18, "strategy=fsdp", "compile=true", "precision=bf16-mixed"],
    [*R18, "strategy=fsdp", "channels_last=true"],
    [*R18, "strategy=fsdp", "strategy.cpu_offload=true"],
    [*R18, "strategy=fsdp", "strategy.activation_checkpointing=true", "precision=bf16-mixed"],
    [*R18, "strategy=ddp_spawn", "compile=true"],
    [*R18, "strategy=dp", "compile=true", "precision=16-mixed"],
    [*R18, "strategy=ddp", "sync_batchnorm=true"],
    [*R18, "callbacks.weight_averaging.decay=0.99", "precision=bf16-mixed"],
    ["model=vit", "strategy=tp", "precision=bf16-mixed"],
    ["model=vit", "strategy=tp", "precision=16-mixed"],
    ["model=vit", "strategy=pp", "precision=bf16-mixed"],
    ["model=vit", "strategy=fsdp", "strategy.tensor_parallel_size=1", "precision=bf16-mixed"],
    ["model=vit", "compile=true", "precision=bf16-mixed"],
    ["strategy=ddp", "devices=auto"],
    ["strategy=ddp", "devices=[0]"],
]


def outcome(overrides: list[str], scratch: Path) -> list:
    log_dir = scratch / str(time.time_ns())
    start = time.perf_counter()
    proc = subprocess.run(train_command(*BASE, *overrides, f"paths.log_dir={log_dir}"), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    seconds = time.perf_counter() - start
    if proc.returncode == 0:
        (metrics,) = log_dir.glob("**/metrics.json")
        result = f"runs (test/acc {json.loads(metrics.read_text())['test/acc']:.3f})"
    else:
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:") or "Error:" in line]
        result = f"exit {proc.returncode}: {errors[-1] if errors else proc.stderr[-300:]}"
    return [" ".join(overrides), result, f"{seconds:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", type=int, default=4)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="gpu-matrix-"))
    rows = []
    with ThreadPoolExecutor(args.parallel) as pool:
        for future in as_completed([pool.submit(outcome, o, scratch) for o in RUNS]):
            rows.append(future.result())
            print(" | ".join(rows[-1]), flush=True)
    import torch

    table = markdown_table(["overrides (with " + " ".join(BASE) + ")", "outcome", "s"], sorted(rows))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_matrix.md").write_text(f"{torch.cuda.get_device_name()}, torch {torch.__version__}.\n\n{table}\n")


if __name__ == "__main__":
    main()
