"""Throughput and peak memory of every strategy x precision pair that runs here, on synthetic ImageNet-shaped
data (3 channels, 1000 classes) with ResNet-18, through `python train.py` as a user runs it.

On CPU the images are 112x112 (224x224 takes seconds per step on 2 cores); samples/s counts all processes,
peak memory is the resident set of rank 0's process. Writes results/strategy_matrix.{md,json,png}.
"""

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, markdown_table, timed_training

PAIRS = [(s, p) for s in ("auto", "dp", "ddp", "ddp_spawn", "fsdp") for p in ("32", "bf16-mixed", "bf16-true")]


def measure(strategy: str, precision: str, size: int, batch: int, scratch: Path) -> dict:
    devices = 2 if strategy in ("ddp", "ddp_spawn", "fsdp") else 1
    figures = timed_training(["data=synthetic", "model=resnet18", f"strategy={strategy}", f"devices={devices}",
                              f"precision={precision}", "accelerator=cpu", f"data.image_shape=[3,{size},{size}]",
                              f"data.batch_size={batch}", "trainer.max_epochs=1", "trainer.limit_train_batches=8",
                              "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false"],
                             scratch, warmup=2)  # fmt: skip
    return {"samples_per_s": figures["samples"] / figures["seconds"], "peak_rss_mb": figures["peak_rss_mb"],
            "processes": devices}  # fmt: skip


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    fig, (ax_speed, ax_memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_speed.barh(labels, [r["samples_per_s"] for r in results.values()], color="tab:blue")
    ax_speed.set(title="training samples/s (all processes)", xlabel="samples/s")
    ax_memory.barh(labels, [r["peak_rss_mb"] for r in results.values()], color="tab:orange")
    ax_memory.set(title="peak resident memory of rank 0 (MB)", xlabel="MB")
    ax_memory.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="matrix-"))
    results = {}
    for strategy, precision in PAIRS:
        results[f"{strategy} / {precision}"] = measure(strategy, precision, args.size, args.batch, scratch)
        print(strategy, precision, results[f"{strategy} / {precision}"], flush=True)
    rows = [
        [name, r["processes"], f"{r['samples_per_s']:.1f}", f"{r['peak_rss_mb']:.0f}"] for name, r in results.items()
    ]
    table = markdown_table(["strategy / precision", "processes", "samples/s", "peak RSS of rank 0 (MB)"], rows)
    RESULTS.mkdir(exist_ok=True)
    header = f"ResNet-18, synthetic 3x{args.size}x{args.size}, global batch {args.batch}, CPU.\n\n"
    (RESULTS / "strategy_matrix.md").write_text(header + table + "\n")
    (RESULTS / "strategy_matrix.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, RESULTS / "strategy_matrix.png")
    print(table)


if __name__ == "__main__":
    main()
