"""Data sets held as tensors, fetched a batch at a time: one indexing op per batch instead of one per item. torch
only: loader workers unpickle them in a fork server that imports this module, not Lightning."""

import torch
from torch.utils.data import Dataset


def already_batched(batch):
    """The collate_fn of a data set whose __getitems__ returns the whole batch."""
    return batch


class TensorPairs(Dataset):
    """Sample i: (images[i % len(images)], labels[i]): a pair per label, or with `pool` fewer images, shared."""

    indices_only = False  # yield pool indices instead, for SyntheticDataModule.transfer_batch_to_device to gather
    collate_fn = staticmethod(already_batched)

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, pool: bool = False):
        if len(images) != len(labels) and not (pool and len(images) <= len(labels)):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index % len(self.images)], self.labels[index]

    def __getitems__(self, indices: list[int]):  # DataLoader's batched fetch (torch >= 2.0)
        index = torch.as_tensor(indices)
        slots = index % len(self.images)
        return slots if self.indices_only else self.images[slots], self.labels[index]


def random_images(length: int, shape: tuple[int, ...], num_classes: int, seed: int, pool: int = 256) -> TensorPairs:
    """`length` samples of a pool of random uint8 images, each with a random label of its own."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (min(pool, length), *shape), dtype=torch.uint8, generator=generator)
    return TensorPairs(images, torch.randint(num_classes, (length,), generator=generator), pool=True)
