"""ImageNet-shaped random images and labels, made on the fly from (seed, index): for throughput runs."""

import torch
from torch.utils.data import Dataset

from starter.data.base import ShardedDataModule


class RandomImages(Dataset):
    def __init__(self, length: int, shape: tuple[int, ...], num_classes: int, seed: int):
        self.length, self.shape, self.num_classes, self.seed = length, shape, num_classes, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)  # the same sample every epoch
        image = torch.randn(self.shape, generator=generator)
        return image, torch.randint(self.num_classes, (), generator=generator)


class SyntheticDataModule(ShardedDataModule):
    def __init__(self, batch_size: int = 64, train_size: int = 2048, eval_size: int = 256, seed: int = 42, **kw):
        super().__init__(batch_size=batch_size, seed=seed, **kw)
        self.train_size, self.eval_size = int(train_size), int(eval_size)

    def setup(self, stage: str | None = None) -> None:
        shape, classes = self.image_shape, self.num_classes
        self.train_set = RandomImages(self.train_size, shape, classes, self.seed)
        self.val_set = RandomImages(self.eval_size, shape, classes, self.seed + 1)
        self.test_set = RandomImages(self.eval_size, shape, classes, self.seed + 2)
