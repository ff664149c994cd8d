"""Data paths: one MNIST epoch held in memory (this starter) vs torchvision's per-item PIL path; the ImageNet
train transform (decode, RandomResizedCrop 224, flip) per image in one process, by decoder; and ImageFolder
throughput per DataLoader worker count on a generated JPEG folder (photo-like 500x375 images, quality 90);
with CUDA, the same decode + crop on the GPU (nvJPEG through torchvision.io.decode_jpeg, batches of 128). The same
JPEGs as shards (make_shards.py), read from a directory and from a local S3 server (moto's, on 127.0.0.1; a cold cache
each epoch's first read, then warm), per loader worker count, and the bytes each holds on disk."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from benchmarks.common import RESULTS, ROOT, LocalS3, markdown_table, write_fake_mnist
from mynet.data.mnist import MNISTDataModule
from starter.data.imagenet import ImageFolderDataModule


def epoch_seconds(loader) -> float:
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def mnist_loaders(data_dir: Path, batch_size: int):
    from torchvision import transforms
    from torchvision.datasets import MNIST

    ours = MNISTDataModule(str(data_dir), download=False, val_size=0, batch_size=batch_size,
                           image_shape=[1, 28, 28], num_classes=10)  # fmt: skip
    ours.setup()
    per_item = MNIST(str(data_dir), train=True, transform=transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]))  # fmt: skip
    return ours.train_dataloader(), DataLoader(per_item, batch_size=batch_size, shuffle=True)


def write_jpegs(root: Path, count: int, size=(500, 375)) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(4):
            (root / split / f"class{c}").mkdir(parents=True, exist_ok=True)
    for i in range(count):  # smooth colour fields with mild noise: compresses like a photograph, unlike noise
        base = Image.fromarray(rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
        noise = rng.integers(-12, 12, (size[1], size[0], 3))
        pixels = np.clip(np.asarray(base, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / "train" / f"class{i % 4}" / f"{i}.JPEG", quality=90)
    for c in range(4):
        Image.fromarray(pixels).save(root / "val" / f"class{c}" / "0.JPEG")


def decoders() -> dict:
    """The train transform by decoder, each giving the crop that training receives."""
    import torch
    from PIL import Image
    from torchvision.transforms import v2

    from starter.data.image_files import load_image
    from starter.data.imagenet import IMAGENET_MEAN, IMAGENET_STD, imagenet_transforms

    crop = [v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()]
    before = v2.Compose(
        [*crop, v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )
    on_pil = v2.Compose([*crop, v2.PILToTensor()])

    def pil(path):
        with Image.open(path) as image:
            return image.convert("RGB")

    def pil_draft(path):  # libjpeg's reduced-size decode, ahead of the crop
        image = Image.open(path)
        image.draft("RGB", (224, 224))
        return image.convert("RGB")

    ours = imagenet_transforms(True, 224, 256, 224)
    return {
        "PIL, float32 normalised in the worker (before)": lambda p: before(pil(p)),
        "PIL, uint8 out": lambda p: on_pil(pil(p)),
        "PIL with JPEG draft, uint8 out": lambda p: on_pil(pil_draft(p)),
        "torchvision decode_image, crop on the tensor, uint8 (this starter)": lambda p: ours(load_image(str(p))),
    }


def gpu_decode_images_per_s(files: list[Path], repeats: int, batch: int = 128) -> list[float]:
    """Files read on the host, decoded on the GPU a batch at a time, each cropped and flipped there."""
    import torch
    from torchvision.io import decode_jpeg, read_file
    from torchvision.transforms import v2

    crop = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])
    rates = []
    for _ in range(repeats + 1):  # the first pass loads nvJPEG: left out
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(0, len(files), batch):
            images = decode_jpeg([read_file(str(p)) for p in files[i : i + batch]], device="cuda")
            torch.stack([crop(image) for image in images])
        torch.cuda.synchronize()
        rates.append(len(files) / (time.perf_counter() - start))
    return rates[1:]


def shard_rates(root: Path, scratch: Path, store: LocalS3, workers: list[int], repeats: int) -> tuple[list, dict]:
    """Images/s of the folder and of its shards (a directory; S3 on a local server, cold then warm cache) by loader
    workers, the same transform, and the bytes on disk."""
    from starter.data.shards import ShardsDataModule

    env = {**os.environ, **store.env}
    try:
        for out in (scratch / "shards", "s3://shards/jpeg"):
            subprocess.run([sys.executable, str(ROOT / "make_shards.py"), "data=imagenet", f"data.root={root}",
                            "data.image_shape=[3,224,224]", "data.num_classes=4", f"out={out}",
                            f"paths.log_dir={scratch / 'logs'}"], check=True, capture_output=True, env=env)  # fmt: skip
        images = len(list((root / "train").rglob("*.JPEG"))) // 32 * 32
        rates, rows = {}, []
        for w in workers:
            sources = {"folder": None, "shards, directory": str(scratch / "shards"), "shards, S3": "s3://shards/jpeg"}
            for name, source in sources.items():
                options = dict(batch_size=32, num_workers=w, pin_memory=False, persistent_workers=False,
                               image_shape=[3, 224, 224], num_classes=4)  # fmt: skip
                if source is None:
                    dm = ImageFolderDataModule(str(root), **options)
                else:
                    dm = ShardsDataModule(source, cache_dir=str(scratch / f"cache-{w}"), **options)
                dm.setup()
                seconds = [epoch_seconds(dm.train_dataloader()) for _ in range(repeats + (source is not None))]
                if name == "shards, S3":
                    rates[f"{name}, cold cache, {w} workers"] = [images / seconds.pop(0)]
                elif source is not None:
                    seconds.pop(0)  # the page cache warmed as the folder's was
                rates[f"{name}, {w} workers"] = [images / s for s in seconds]
            rows += [[name, w, f"{statistics.median(r):.0f}", f"{min(r):.0f}-{max(r):.0f}"]
                     for name, r in rates.items() if name.endswith(f", {w} workers")]  # fmt: skip
    finally:
        store.stop()
    on_disk = {"folder": sum(p.stat().st_size for p in root.rglob("*") if p.is_file()),
               "shards": sum(p.stat().st_size for p in (scratch / "shards").rglob("*") if p.is_file())}  # fmt: skip
    table = markdown_table(["the same JPEGs (500x375 -> RandomResizedCrop 224)", "workers", "images/s", "range"], rows)
    table += (f"\n\nOn disk: the folder {on_disk['folder'] / 1e6:.1f} MB, its shards {on_disk['shards'] / 1e6:.1f} MB"
              " (the val split, written once, included in both).")  # fmt: skip
    return table, {"images_per_s": rates, "bytes_on_disk": on_disk}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="data-"))
    store = LocalS3(scratch)  # before any loader worker: their fork server keeps the environment it started with
    os.environ.update(store.env)

    ours, per_item = mnist_loaders(write_fake_mnist(scratch / "mnist", test_size=100), batch_size=128)
    in_memory, pil = [], []
    for _ in range(args.repeats):
        in_memory.append(epoch_seconds(ours))
        pil.append(epoch_seconds(per_item))
    ratio = statistics.median(pil) / statistics.median(in_memory)
    mnist_table = (
        markdown_table(
            ["MNIST train epoch (60k, batch 128)", "median s", "range s"],
            [
                [
                    "in memory, uint8, one indexing op a batch (this starter)",
                    f"{statistics.median(in_memory):.2f}",
                    f"{min(in_memory):.2f}-{max(in_memory):.2f}",
                ],
                [
                    "torchvision MNIST, PIL + ToTensor per item",
                    f"{statistics.median(pil):.2f}",
                    f"{min(pil):.2f}-{max(pil):.2f}",
                ],
            ],
        )
        + f"\n\nIn memory is {ratio:.1f}x faster than the per-item PIL path (target: 2.5x or more).\n"
    )

    write_jpegs(scratch / "jpeg", args.images)
    import torch

    torch.set_num_threads(1)  # as in a loader worker
    files = sorted((scratch / "jpeg" / "train").rglob("*.JPEG"))
    per_decoder = {}
    for name, transform in decoders().items():
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for path in files:
                transform(path)
            rates.append(len(files) / (time.perf_counter() - start))
        per_decoder[name] = rates
    first = statistics.median(next(iter(per_decoder.values())))
    decoder_table = markdown_table(
        ["train transform, one process (a loader worker's work)", "images/s", "range", "vs before"],
        [[name, f"{statistics.median(r):.0f}", f"{min(r):.0f}-{max(r):.0f}", f"{statistics.median(r) / first:.2f}x"]
         for name, r in per_decoder.items()])  # fmt: skip
    rows, decode = [], {}
    for workers in args.workers:
        dm = ImageFolderDataModule(str(scratch / "jpeg"), batch_size=32, num_workers=workers, pin_memory=False,
                                   persistent_workers=False, image_shape=[3, 224, 224], num_classes=4)  # fmt: skip
        dm.setup()
        loader = dm.train_dataloader()
        seconds = [epoch_seconds(loader) for _ in range(args.repeats)]
        decode[workers] = [args.images // 32 * 32 / s for s in seconds]
        rows.append([workers, f"{statistics.median(decode[workers]):.0f}",
                     f"{min(decode[workers]):.0f}-{max(decode[workers]):.0f}"])  # fmt: skip
    folder_table = markdown_table(
        ["DataLoader workers", "images/s (500x375 JPEG -> RandomResizedCrop 224)", "range"], rows
    )
    shards_table, shards = shard_rates(scratch / "jpeg", scratch, store, args.workers, args.repeats)
    folder_table += "\n\n" + shards_table
    if torch.cuda.is_available():
        torch.set_num_threads(1)
        rates = gpu_decode_images_per_s(files, args.repeats)
        per_decoder["GPU: nvJPEG decode_jpeg(device='cuda'), batches of 128, crop on the GPU"] = rates
        folder_table += (f"\n\nOn {torch.cuda.get_device_name()}: decode and crop on the GPU "
                         f"{statistics.median(rates):.0f} images/s (one host process reading the files).")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "data.md").write_text(mnist_table + "\n" + decoder_table + "\n\n" + folder_table + "\n")
    (RESULTS / "data.json").write_text(
        json.dumps(
            {
                "mnist_in_memory_s": in_memory,
                "mnist_pil_s": pil,
                "decoder_images_per_s": per_decoder,
                "imagefolder_images_per_s": decode,
                "shards": shards,
            },
            indent=1,
        )
        + "\n"
    )
    print(mnist_table + "\n" + decoder_table + "\n\n" + folder_table)


if __name__ == "__main__":
    main()
