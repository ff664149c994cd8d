"""Parity under ddp on 2 CPU processes (gloo): `python train.py strategy=ddp devices=2` vs the hand-written DDP
loop of the classic tutorials (DistributedSampler, DataLoader over a TensorDataset, DistributedDataParallel).

Same net, same MNIST-shaped tensors, global batch and AdamW; timed on rank 0 from the 10th step to the end
of one epoch, REPEATS alternated runs. Writes results/parity_ddp.{md,json}.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from benchmarks.common import RESULTS, free_port, markdown_table, timed_training, write_fake_mnist
from mynet.data.mnist import MEAN, STD, MNISTDataModule
from mynet.models.nets.mlp import MLP


def threads_per_process(world: int) -> int:
    """What train.py's launcher gives each worker (torchrun's rule): the cores shared out, or OMP_NUM_THREADS."""
    return int(os.environ.get("OMP_NUM_THREADS", max(1, len(os.sched_getaffinity(0)) // world)))


def hand_ddp_worker(rank: int, world: int, data_dir: str, batch_size: int, port: int, output: str) -> None:
    torch.set_num_threads(threads_per_process(world))  # as train.py's workers: not every core's threads in each
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    datamodule = MNISTDataModule(data_dir, download=False, image_shape=[1, 28, 28], num_classes=10)
    datamodule.setup()
    dataset = TensorDataset(datamodule.train_set.images, datamodule.train_set.labels)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size // world, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(MLP([1, 28, 28], 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.002, weight_decay=0.01)
    sampler.set_epoch(0)
    for step, (images, labels) in enumerate(loader):
        if step == 10:
            start = time.perf_counter()
        loss = F.cross_entropy(model((images.float() / 255 - MEAN) / STD), labels)  # as train.py normalises
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if rank == 0:
        steps = len(loader) - 10
        Path(output).write_text(json.dumps({"samples": steps * batch_size, "seconds": time.perf_counter() - start}))
    dist.destroy_process_group()


def hand_ddp(data_dir: Path, batch_size: int, scratch: Path) -> float:
    output = scratch / "hand.json"
    torch.multiprocessing.spawn(hand_ddp_worker, args=(2, str(data_dir), batch_size, free_port(), str(output)),
                                nprocs=2)  # fmt: skip
    figures = json.loads(output.read_text())
    return figures["samples"] / figures["seconds"]


def ours_ddp(data_dir: Path, batch_size: int, scratch: Path) -> float:
    figures = timed_training(["data=mnist", f"paths.data_dir={data_dir}", "data.download=false",
                              f"data.batch_size={batch_size}", "strategy=ddp", "devices=2", "accelerator=cpu",
                              "trainer.max_epochs=1"], scratch)  # fmt: skip
    return figures["samples"] / figures["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="parity-ddp-"))
    data_dir = write_fake_mnist(scratch / "data", test_size=1000)
    ours, hand = [], []
    for _ in range(args.repeats):
        hand.append(hand_ddp(data_dir, args.batch_size, scratch))
        ours.append(ours_ddp(data_dir, args.batch_size, scratch))
    ratios = [o / h for o, h in zip(ours, hand)]
    m_ours, m_hand = statistics.median(ours), statistics.median(hand)
    overhead_ms = (args.batch_size / m_ours - args.batch_size / m_hand) * 1000
    table = markdown_table(
        ["global batch", "train.py ddp samples/s", "hand DDP loop samples/s", "ratio (median)", "ratio range",
         "overhead ms/step"],
        [[args.batch_size, f"{m_ours:,.0f}", f"{m_hand:,.0f}", f"{statistics.median(ratios):.2f}",
          f"{min(ratios):.2f}-{max(ratios):.2f}", f"{overhead_ms:.2f}"]])  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    note = (
        f"\nBoth run 2 processes of {threads_per_process(2)} thread(s) each on the same data, global batch and AdamW."
        " The tutorial loop's DataLoader fetches and collates each rank's samples one by one, this starter a batch with"
        " one indexing op (data/in_memory.py); the overhead column is what train.py's loop costs per step besides"
        " (the single-process parity above measures the same loop)."
    )
    (RESULTS / "parity_ddp.md").write_text(table + "\n" + note + "\n")
    (RESULTS / "parity_ddp.json").write_text(json.dumps({"train.py": ours, "hand": hand, "ratio": ratios}) + "\n")
    print(table)


if __name__ == "__main__":
    main()
