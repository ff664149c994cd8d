"""Parity: training samples/s of train.py's normal path vs bare Lightning vs a hand-written PyTorch loop.

Same net (MLP 784-256-256-10), same MNIST-shaped uint8 tensors (written as IDX files, read by the MNIST
DataModule), normalised per batch as train.py does, same global batch and optimizer (AdamW). `train.py` is
`starter.run.run` with the default callbacks, CSV logging and progress bar, exactly as `python train.py
data=mnist` runs. Bare Lightning is what one writes in ten minutes: a LightningModule that logs its loss, a
shuffled DataLoader over the same tensors, `L.Trainer(max_epochs=1)` with every default (bar, checkpointing,
logger). The hand loop indexes the tensors with a fresh permutation each epoch (the fastest loop one would
write). All are timed from the 10th step to the end of one epoch, in turn, REPEATS times per batch size, in
this one process.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import RESULTS, StepTimer, compose_config, markdown_table, write_fake_mnist
from mynet.data.mnist import MEAN, STD, MNISTDataModule
from mynet.models.nets.mlp import MLP


def normalised(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255 - MEAN) / STD


def lightning_samples_per_s(data_dir: Path, batch_size: int, scratch: Path) -> tuple[float, int]:
    from starter.run import run

    timing = scratch / "timing.json"
    cfg = compose_config(
        ["data=mnist", f"paths.data_dir={data_dir}", "data.download=false", f"data.batch_size={batch_size}",
         "trainer.max_epochs=1", "test=false", f"paths.log_dir={scratch}", "accelerator=cpu",
         "+callbacks.step_timer._target_=benchmarks.common.StepTimer", f"+callbacks.step_timer.output={timing}"],
        scratch / f"run_{time.monotonic_ns()}",
    )  # fmt: skip
    run(cfg)
    figures = json.loads(timing.read_text())
    return figures["samples"] / figures["seconds"], figures["steps"]


class BareClassifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = MLP([1, 28, 28], 10)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self.net(normalised(images)), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.002, weight_decay=0.01)


def bare_lightning_samples_per_s(images, labels, batch_size: int, scratch: Path) -> float:
    torch.manual_seed(0)
    timing = scratch / "bare-timing.json"
    loader = DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=True, drop_last=True)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, default_root_dir=scratch,
                        callbacks=[StepTimer(str(timing))])  # fmt: skip
    trainer.fit(BareClassifier(), loader)
    figures = json.loads(timing.read_text())
    return figures["samples"] / figures["seconds"]


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
        loss = F.cross_entropy(net(normalised(images[index])), labels[index])
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
        ours, bare, hand = [], [], []
        for _ in range(args.repeats):
            hand.append(hand_loop_samples_per_s(images, labels, batch_size))
            bare.append(bare_lightning_samples_per_s(images, labels, batch_size, scratch))
            ours.append(lightning_samples_per_s(data_dir, batch_size, scratch)[0])
        ratio = [o / h for o, h in zip(ours, hand)]
        bare_ratio = [b / h for b, h in zip(bare, hand)]
        vs_bare = [o / b for o, b in zip(ours, bare)]
        m_ours, m_bare, m_hand = (statistics.median(x) for x in (ours, bare, hand))
        overhead_ms = (batch_size / m_ours - batch_size / m_hand) * 1000
        results[batch_size] = {"train.py": ours, "bare lightning": bare, "hand loop": hand, "ratio": ratio,
                               "bare ratio": bare_ratio, "vs bare": vs_bare, "overhead_ms": overhead_ms}  # fmt: skip
        rows.append(
            [
                batch_size,
                f"{m_ours:,.0f}",
                f"{m_bare:,.0f}",
                f"{m_hand:,.0f}",
                f"{statistics.median(ratio):.2f}",
                f"{statistics.median(bare_ratio):.2f}",
                f"{statistics.median(vs_bare):.2f}",
                f"{overhead_ms:.2f}",
            ]
        )
        print(rows[-1], flush=True)
    table = markdown_table(
        ["global batch", "train.py samples/s", "bare Lightning samples/s", "hand loop samples/s",
         "train.py / hand", "bare Lightning / hand", "train.py / bare Lightning", "train.py overhead ms/step"],
        rows)  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "parity.md").write_text(table + "\n")
    (RESULTS / "parity.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table)


if __name__ == "__main__":
    main()
