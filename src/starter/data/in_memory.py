"""Data sets held as tensors, fetched a batch at a time: one indexing op per batch instead of one per item. torch
only: loader workers unpickle them in a fork server that imports this module, not Lightning."""

import torch
from torch.utils.data import Dataset


def already_batched(batch):
    """The collate_fn of a data set whose __getitems__ returns the whole batch."""
    return batch


class TensorPairs(Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]):  # DataLoader's batched fetch (torch >= 2.0)
        index = torch.as_tensor(indices)
        return self.images[index], self.labels[index]

    collate_fn = staticmethod(already_batched)


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
        if self.indices_only:
            return index % len(self.images), self.labels[index]
        return self.images[index % len(self.images)], self.labels[index]

    indices_only = False  # yield pool indices for SyntheticDataModule.transfer_batch_to_device to gather

    collate_fn = staticmethod(already_batched)
