"""Predict's images/s against the test loop of the same checkpoint, in one process: how much reading image files
(decode, resize, the inference record's normalisation) costs over the data a run tests on.

    python -m benchmarks.predict_speed [--repeats 3]

For the digits (the test loop: tensors in memory; predict: the same 271 images as PNG files) and for an image
folder (both decode the same JPEG files: the test loop through the run's DataModule, predict through predict.py's).
Writes results/predict_speed.{json,md}.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.common import RESULTS, markdown_table, train_command


def trained(scratch: Path, *overrides: str) -> Path:
    import subprocess

    subprocess.run([*train_command(*overrides, f"paths.log_dir={scratch / 'logs'}", "trainer.max_epochs=2",
                    "test=false")], check=True, capture_output=True)  # fmt: skip
    return next((scratch / "logs").glob("*/runs/*/checkpoints/best.ckpt"))


def images_per_s(checkpoint: Path, datamodule, files: list[str]) -> tuple[float, float]:
    """(test loop, predict) images/s of one checkpoint, in this process."""
    import lightning as L

    from starter.checkpointing.inference import load_for_inference
    from starter.checkpointing.record import model_builders
    from starter.data.base import ImagesToPredict

    model, record = load_for_inference(checkpoint, model_builders([Path(__file__).parents[1] / "conf"]))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)  # fmt: skip
    start = time.perf_counter()
    trainer.test(model, datamodule=datamodule, verbose=False)
    tested = len(datamodule.test_set) / (time.perf_counter() - start)
    start = time.perf_counter()
    trainer.predict(model, datamodule=ImagesToPredict(files, record, batch_size=datamodule.batch_size),
                    return_predictions=False)  # fmt: skip
    return tested, len(files) / (time.perf_counter() - start)


def digits(scratch: Path):
    from mynet.data.digits import DigitsDataModule

    data = DigitsDataModule(image_shape=[1, 8, 8], num_classes=10)
    data.setup()
    folder = scratch / "digit_files"
    folder.mkdir()
    for i, image in enumerate(data.test_set.images):
        Image.fromarray(image[0].numpy()).save(folder / f"{i:04d}.png")
    return trained(scratch), data, sorted(str(p) for p in folder.iterdir())


def image_folder(scratch: Path):
    from starter.data.imagenet import ImageFolderDataModule

    root, rng = scratch / "images", np.random.default_rng(0)
    for split, count in (("train", 16), ("val", 96)):
        for label in range(3):
            (root / split / str(label)).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (80, 96, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / str(label) / f"{i}.jpg", quality=90)
    overrides = ["data=imagenet", f"data.root={root}", "data.image_shape=[3,64,64]", "data.num_workers=0",
                 "data.batch_size=32"]  # fmt: skip
    data = ImageFolderDataModule(root=str(root), batch_size=32, num_workers=0, image_shape=[3, 64, 64], num_classes=3)
    data.setup()
    return trained(scratch / "folder", *overrides), data, sorted(str(p) for p in (root / "val").rglob("*.jpg"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="predict-speed-"))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results, rows = {}, []
    for name, make in (("digits, MLP (PNG files)", digits), ("image folder, MLP on 64x64 crops (JPEG)", image_folder)):
        checkpoint, data, files = make(scratch)
        runs = [images_per_s(checkpoint, data, files) for _ in range(args.repeats)]
        test, predict = (statistics.median(r[i] for r in runs) for i in (0, 1))
        results[name] = {"test_images_per_s": [r[0] for r in runs], "predict_images_per_s": [r[1] for r in runs]}
        rows.append([name, len(files), f"{test:.0f}", f"{predict:.0f}", f"{predict / test:.2f}"])
    table = markdown_table(["data", "images", "test loop images/s", "predict images/s", "predict / test"], rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "predict_speed.json").write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS / "predict_speed.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
