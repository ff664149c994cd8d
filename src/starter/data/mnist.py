"""MNIST in memory as uint8 tensors (55 MB), fetched a batch at a time (no per-item PIL conversion), normalised on the
device. torchvision reads <data_dir>/MNIST/raw, downloading there when `download` is on and the network allows."""

import struct
from pathlib import Path

import numpy as np
import torch

from starter.data.base import ShardedDataModule
from starter.data.in_memory import TensorPairs
from starter.errors import UserError

MEAN, STD = 0.1307, 0.3081  # of the 60k training images
RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


class MNISTDataModule(ShardedDataModule):
    def __init__(
        self, data_dir: str, download: bool = True, batch_size: int = 128, val_size: int = 5000, seed: int = 42, **kw
    ):
        super().__init__(batch_size=batch_size, seed=seed, **kw)
        self.data_dir, self.download, self.val_size = Path(data_dir), bool(download), int(val_size)
        self.mean, self.std = (MEAN,), (STD,)

    def prepare_data(self) -> None:  # rank 0 of each node only: download once
        self._read(train=True, download=self.download)
        self._read(train=False, download=self.download)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        train, test = self._read(train=True), self._read(train=False)
        self._check_shape("MNIST", (1, *train.data.shape[1:]), len(train.classes))
        images, labels = train.data.unsqueeze(1).contiguous(), train.targets  # uint8: normalised on the device
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        val, fit = order[: self.val_size], order[self.val_size :]
        self.train_set = TensorPairs(images[fit], labels[fit])
        self.val_set = TensorPairs(images[val], labels[val])
        self.test_set = TensorPairs(test.data.unsqueeze(1).contiguous(), test.targets)

    def _read(self, train: bool, download: bool = False):
        from torchvision.datasets import MNIST

        try:
            return MNIST(str(self.data_dir), train=train, download=download)
        except (RuntimeError, OSError) as err:
            raw = self.data_dir / "MNIST" / "raw"
            how = f"the download failed ({err})" if download else "data.download=false"
            raise UserError(
                f"MNIST not found in {raw} and {how}; put {', '.join(RAW_FILES)} there (the .gz files"
                f" also do, with data.download=true), or set paths.data_dir to the directory holding MNIST/raw"
            ) from err


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write `array` (uint8 values) as an MNIST IDX file: for tests and benchmarks that need MNIST offline."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    Path(path).write_bytes(header + array.astype(np.uint8).tobytes())


def write_fake_mnist(data_dir: Path, train_size: int = 60_000, test_size: int = 10_000, seed: int = 0) -> Path:
    """MNIST-shaped random images and labels in torchvision's layout under `data_dir`/MNIST/raw."""
    raw = Path(data_dir) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", train_size), ("t10k", test_size)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    return Path(data_dir)
