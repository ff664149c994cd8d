"""Can the ImageFolder path feed the GPU? A `data=imagenet` training epoch through `python train.py` on a generated
JPEG folder (photo-like 500x375 images, quality 90, decoded and augmented by the loader workers on the CPU)
against the same run on images already on the device (`data=synthetic data.on_device=true`), in one invocation;
then the same JPEGs as shards (make_shards.py, a local directory), decoded by the workers or on the device
(`data.decode=gpu`), and the folder decoded on the device, at the largest worker count.

    python -m benchmarks.folder_epoch --images 16000 --workers 8 15

The ratio data path / on-device says whether it keeps up with the net (>= 0.95: it does). Writes
results/folder_epoch.{md,json}. `--tiny --accelerator cpu` checks the paths at toy sizes.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from multiprocessing import Pool
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, ROOT, markdown_table, timed_training

CLASSES = 10


def _write(job: tuple[Path, int, int, tuple[int, int]]) -> None:
    """Images [first, last) into root/<class>: smooth colour fields with mild noise, which compress like photos."""
    from PIL import Image

    root, first, last, size = job
    rng = np.random.default_rng(first)
    for i in range(first, last):
        base = Image.fromarray(rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
        noise = rng.integers(-12, 12, (size[1], size[0], 3))
        pixels = np.clip(np.asarray(base, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / f"class{i % CLASSES}" / f"{i}.JPEG", quality=90)


def write_folder(root: Path, train: int, val: int, size=(500, 375)) -> None:
    """root/{train,val}/class<k>/*.JPEG, written by every core."""
    jobs = []
    for split, count in (("train", train), ("val", val)):
        for c in range(CLASSES):
            (root / split / f"class{c}").mkdir(parents=True, exist_ok=True)
        chunk = max(1, count // (4 * (os.cpu_count() or 1)))
        jobs += [(root / split, i, min(i + chunk, count), size) for i in range(0, count, chunk)]
    with Pool() as pool:
        pool.map(_write, jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--images", type=int, default=16000)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 15])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="toy sizes on CPU: checks the path, not the speed")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    size, image_size = (500, 375), 224
    if args.tiny:
        args.images, args.batch, args.model, args.precision, args.warmup = 48, 8, "resnet18", "32", 2
        args.workers, size, image_size = [1], (64, 48), 32
    scratch = Path(tempfile.mkdtemp(prefix="folder-epoch-"))
    write_folder(scratch / "images", args.images, CLASSES * 4, size)
    common = [f"model={args.model}", "channels_last=true", "strategy=auto", f"accelerator={args.accelerator}",
              "devices=1", f"precision={args.precision}", f"data.batch_size={args.batch}",
              f"data.image_shape=[3,{image_size},{image_size}]", f"data.num_classes={CLASSES}",
              "trainer.max_epochs=1", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false"]  # fmt: skip
    runs = {}
    on_device = ["data=synthetic", "data.on_device=true", f"data.train_size={args.images}"]
    figures = timed_training(common + on_device, scratch, warmup=args.warmup)
    runs["images on the device (data=synthetic)"] = figures["samples"] / figures["seconds"]
    print(f"on the device: {runs['images on the device (data=synthetic)']:,.0f} images/s", flush=True)
    for workers in args.workers:
        folder = ["data=imagenet", f"data.root={scratch / 'images'}", f"data.num_workers={workers}"]
        figures = timed_training(common + folder, scratch, warmup=args.warmup)
        runs[f"JPEG folder, {workers} loader workers"] = figures["samples"] / figures["seconds"]
        print(f"{workers} workers: {runs[f'JPEG folder, {workers} loader workers']:,.0f} images/s", flush=True)
    folder = ["data=imagenet", f"data.root={scratch / 'images'}"]
    subprocess.run([sys.executable, str(ROOT / "make_shards.py"), *folder, f"data.image_shape=[3,{image_size},"
                    f"{image_size}]", f"data.num_classes={CLASSES}", f"out={scratch / 'shards'}", "check_images=false",
                    f"num_workers={os.cpu_count()}", f"paths.log_dir={scratch / 'logs'}"], check=True,
                   capture_output=True)  # fmt: skip
    shards, most = ["data=shards", f"data.source={scratch / 'shards'}"], max(args.workers)
    paths = {
        "shards": [*shards, "data.decode=cpu"],
        "shards, decoded on the device": [*shards, "data.decode=gpu"],
        "JPEG folder, decoded on the device": [*folder, "data.decode=gpu"],
    }
    if args.tiny:  # the shards' path is checked; decoding on the device is tested in tests/test_shards.py
        paths = {"shards": paths["shards"]}
    for name, data in paths.items():
        figures = timed_training(common + data + [f"data.num_workers={most}"], scratch, warmup=args.warmup)
        runs[f"{name}, {most} loader workers"] = figures["samples"] / figures["seconds"]
        print(f"{name}: {runs[f'{name}, {most} loader workers']:,.0f} images/s", flush=True)
    base = runs["images on the device (data=synthetic)"]
    rows = [[name, f"{rate:,.0f}", f"{rate / base:.2f}"] for name, rate in runs.items()]
    header = (f"{args.model}, {args.precision}, channels_last, batch {args.batch}, one device, {os.cpu_count()} CPU"
              f" cores; {args.images} JPEGs {size[0]}x{size[1]} (train: RandomResizedCrop {image_size} + flip, decoded"
              f" by the loader workers unless said), one epoch timed after {args.warmup} steps")  # fmt: skip
    table = markdown_table(["data", "images/s", "/ on the device"], rows)
    args.results.mkdir(parents=True, exist_ok=True)
    name = "folder_epoch" + ("_tiny" if args.tiny else "")
    (args.results / f"{name}.md").write_text(header + ".\n\n" + table + "\n")
    (args.results / f"{name}.json").write_text(json.dumps(runs, indent=1) + "\n")
    print(header + "\n" + table)


if __name__ == "__main__":
    main()
