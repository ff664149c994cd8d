"""MNIST in memory as uint8 tensors (55 MB), fetched a batch at a time (no per-item PIL conversion), normalised on the
device. torchvision reads <data_dir>/MNIST/raw, downloading there when `download` is on and the network allows."""

from pathlib import Path

import torch

from mynet.data.in_memory import TensorPairs
from starter.data.base import ShardedDataModule
from starter.errors import UserError

MEAN, STD = 0.1307, 0.3081  # of the 60k training images
RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


class MNISTDataModule(ShardedDataModule):
    split_by = ("seed", "val_size")  # what draws its split (starter/checkpointing/data_split.py)

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
            how = f"the download failed ({' '.join(str(err).split())})" if download else "data.download=false"
            raise UserError(
                f"MNIST not found in {raw} and {how}; put {', '.join(RAW_FILES)} there (the .gz files"
                " also do, with data.download=true), or set paths.data_dir to the directory holding"
                " MNIST/raw"
            ) from err
