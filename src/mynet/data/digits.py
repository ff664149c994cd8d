"""scikit-learn's bundled 8x8 handwritten digits: 1,797 real images, offline. The default data set."""

import math

import torch

from mynet.data.in_memory import TensorPairs
from starter.data.base import ShardedDataModule
from starter.errors import UserError


class DigitsDataModule(ShardedDataModule):
    split_by = ("seed", "split")  # what draws its split (starter/checkpointing/data_split.py)

    def __init__(self, batch_size: int = 64, split=(0.7, 0.15, 0.15), seed: int = 42, **kwargs):
        super().__init__(batch_size=batch_size, seed=seed, **kwargs)
        if len(split) != 3 or abs(sum(split) - 1) > 1e-6:
            raise UserError(f"data.split={list(split)}: give three fractions (train, val, test) that sum to 1")
        if min(split) * 1797 < 1:
            raise UserError(f"data.split={list(split)}: every split needs samples; e.g. data.split=[0.7,0.15,0.15]")
        self.split = tuple(split)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits

        digits = load_digits()
        # (N, 1, 8, 8): values 0..16 scaled to 0..255, so an 8-bit image file of a digit is what the net saw
        images = (torch.tensor(digits.images) * 255 / 16).round().to(torch.uint8).unsqueeze(1)
        labels = torch.tensor(digits.target, dtype=torch.long)
        self._check_shape("digits", images.shape[1:], int(labels.max()) + 1)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        n_train, n_val = int(self.split[0] * len(order)), int(self.split[1] * len(order))
        parts = order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]
        # normalised on the device with training-split statistics only, from exact integer sums: the same figures
        # whatever the number of threads (a float32 sum's last bits follow it: a ddp worker's one thread, a process's)
        pixels = images[parts[0]].long()
        n, total, squares = pixels.numel(), int(pixels.sum()), int((pixels * pixels).sum())
        self.mean, self.std = (total / n / 255,), (math.sqrt((squares - total * total / n) / (n - 1)) / 255,)
        self.train_set, self.val_set, self.test_set = (TensorPairs(images[p], labels[p]) for p in parts)
