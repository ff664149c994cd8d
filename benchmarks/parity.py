"""Parity: training samples/s of train.py's normal path vs a hand-written PyTorch loop (single process).

Same net (MLP 784-256-256-10), same MNIST-shaped in-memory tensors (written as IDX files, read by the
MNIST DataModule), same global batch and optimizer (AdamW). The Lightning side is `starter.run.run` with
the default callbacks, CSV logging and progress bar, exactly as `python train.py data=mnist` runs; the
hand loop indexes the tensors with a fresh permutation each epoch (the fastest loop one would write).
Both are timed from the 10th step to the end of one epoch (no warm-up, validation or checkpointing),
alternately, REPEATS times per batch size, in this one process.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS, compose, markdown_table
from starter.data.mnist import MNISTDataModule, write_fake_mnist
from starter.models.nets.mlp import MLP


def lightning_samples_per_s(data_dir: Path, batch_size: int, scratch: Path) -> tuple[float, int]:
    from starter.run import run

    timing = scratch / "timing.json"
    cfg = compose(
        ["data=mnist", f"paths.data_dir={data_dir}", "data.download=false", f"data.batch_size={batch_size}",
         "trainer.max_epochs=1", "test=false", f"paths.log_dir={scratch}", "accelerator=cpu",
         "+callbacks.step_timer._target_=benchmarks.common.StepTimer", f"+callbacks.step_timer.output={timing}"],
        scratch / f"run_{time.monotonic_ns()}",
    )  # fmt: skip
    run(cfg)
    figures = json.loads(timing.read_text())
    return figures["samples"] / figures["seconds"], figures["steps"]


def hand_loop_samples_per_s(images, labels, batch_size: int, warmup: int = 10) -> float:
    torch.manual_seed(0)
    net = MLP([1, 28, 28], 10)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.002, weight_decay=0.01)
    order = torch.randperm(len(labels))
    steps = len(labels) // batch_size
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        index = order[step * batch_size : (step + 1) * batch_size]
        loss = F.cross_entropy(net(images[index]), labels[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return (steps - warmup) * batch_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=60_000)
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="parity-"))
    data_dir = write_fake_mnist(scratch / "data", train_size=args.train_size, test_size=1000)
    datamodule = MNISTDataModule(str(data_dir), download=False, image_shape=[1, 28, 28], num_classes=10)
    datamodule.setup()
    images, labels = datamodule.train_set.images, datamodule.train_set.labels

    rows, results = [], {}
    for batch_size in args.batch_sizes:
        ours, hand = [], []
        for _ in range(args.repeats):
            hand.append(hand_loop_samples_per_s(images, labels, batch_size))
            samples_per_s, steps = lightning_samples_per_s(data_dir, batch_size, scratch)
            ours.append(samples_per_s)
        ratios = [o / h for o, h in zip(ours, hand)]
        m_ours, m_hand = statistics.median(ours), statistics.median(hand)
        overhead_ms = (batch_size / m_ours - batch_size / m_hand) * 1000
        results[batch_size] = {"train.py": ours, "hand loop": hand, "ratio": ratios, "overhead_ms": overhead_ms}
        rows.append([batch_size, f"{m_ours:,.0f}", f"{m_hand:,.0f}", f"{statistics.median(ratios):.2f}",
                     f"{min(ratios):.2f}-{max(ratios):.2f}", f"{overhead_ms:.2f}"])  # fmt: skip
        print(rows[-1], flush=True)
    table = markdown_table(
        ["global batch", "train.py samples/s", "hand loop samples/s", "ratio (median)", "ratio range",
         "overhead ms/step"], rows)  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "parity.md").write_text(table + "\n")
    (RESULTS / "parity.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table)


if __name__ == "__main__":
    main()
