"""ImageNet-shaped random images and labels, for throughput runs: nothing to download, decode or generate per step.

A pool of random uint8 images is made once from the seed; sample i is pool image i % pool with its own label,
fetched a batch at a time (one indexing op), so the loader can feed any GPU.
"""

import torch
from torch.utils.data import Dataset

from starter.data.base import ShardedDataModule


class RandomImages(Dataset):
    def __init__(self, length: int, shape: tuple[int, ...], num_classes: int, seed: int, pool: int = 256):
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (min(pool, length), *shape), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(num_classes, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index % len(self.images)], self.labels[index]

    def __getitems__(self, indices: list[int]):  # DataLoader's batched fetch
        index = torch.as_tensor(indices)
        return self.images[index % len(self.images)], self.labels[index]

    @staticmethod
    def collate_fn(batch):
        """__getitems__ already returns the batch."""
        return batch


class SyntheticDataModule(ShardedDataModule):
    def __init__(self, batch_size: int = 64, train_size: int = 2048, eval_size: int = 256, seed: int = 42, **kw):
        super().__init__(batch_size=batch_size, seed=seed, **kw)
        self.train_size, self.eval_size = int(train_size), int(eval_size)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        shape, classes = self.image_shape, self.num_classes
        self.train_set = RandomImages(self.train_size, shape, classes, self.seed)
        self.val_set = RandomImages(self.eval_size, shape, classes, self.seed + 1)
        self.test_set = RandomImages(self.eval_size, shape, classes, self.seed + 2)
