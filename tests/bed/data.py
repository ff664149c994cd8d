"""The data sets the engine's tests train on, on the engine's ShardedDataModule: scikit-learn's 8x8 digits (real,
offline) and random images of any shape; both held as tensors and fetched a batch at a time."""

import math

import torch
from torch.utils.data import Dataset

from starter.data.base import ShardedDataModule
from starter.errors import UserError


def already_batched(batch):
    return batch


class TensorPairs(Dataset):
    """Sample i: (images[i % len(images)], labels[i]); a batch is one indexing op (__getitems__)."""

    collate_fn = staticmethod(already_batched)

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index % len(self.images)], self.labels[index]

    def __getitems__(self, indices: list[int]):
        index = torch.as_tensor(indices)
        return self.images[index % len(self.images)], self.labels[index]


class Digits(ShardedDataModule):
    """1,797 digits as (1, 8, 8) uint8 images, split train/val/test by `split` drawn with `seed`."""

    split_by = ("seed", "split")

    def __init__(self, batch_size: int = 64, split=(0.7, 0.15, 0.15), seed: int = 42, **kwargs):
        super().__init__(batch_size=batch_size, seed=seed, **kwargs)
        if len(split) != 3 or abs(sum(split) - 1) > 1e-6:
            raise UserError(f"data.split={list(split)}: give three fractions (train, val, test) that sum to 1")
        self.split = tuple(split)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = (torch.tensor(digits.images) * 255 / 16).round().to(torch.uint8).unsqueeze(1)
        labels = torch.tensor(digits.target, dtype=torch.long)
        self._check_shape("digits", images.shape[1:], int(labels.max()) + 1)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        n_train, n_val = int(self.split[0] * len(order)), int(self.split[1] * len(order))
        parts = order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]
        pixels = images[parts[0]].long()  # exact integer sums: the same statistics whatever the thread count
        n, total, squares = pixels.numel(), int(pixels.sum()), int((pixels * pixels).sum())
        self.mean, self.std = (total / n / 255,), (math.sqrt((squares - total * total / n) / (n - 1)) / 255,)
        self.train_set, self.val_set, self.test_set = (TensorPairs(images[p], labels[p]) for p in parts)


class RandomImages(ShardedDataModule):
    """`train_size` (and `eval_size` per evaluation split) random uint8 images of `image_shape` from a pool of at
    most 256, each sample with a random label of its own."""

    split_by = ("seed",)

    def __init__(self, batch_size: int = 64, train_size: int = 2048, eval_size: int = 256, seed: int = 42, **kwargs):
        super().__init__(batch_size=batch_size, seed=seed, **kwargs)
        self.train_size, self.eval_size = int(train_size), int(eval_size)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            sizes = (self.train_size, self.eval_size, self.eval_size)
            self.train_set, self.val_set, self.test_set = (self._images(n, self.seed + i) for i, n in enumerate(sizes))

    def _images(self, length: int, seed: int) -> TensorPairs:
        generator = torch.Generator().manual_seed(seed)
        images = torch.randint(0, 256, (min(256, length), *self.image_shape), dtype=torch.uint8, generator=generator)
        return TensorPairs(images, torch.randint(self.num_classes, (length,), generator=generator))
