"""A data set held as two tensors, fetched a batch at a time: one indexing op per batch instead of one per item."""

import torch
from torch.utils.data import Dataset


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

    @staticmethod
    def collate_fn(batch):
        """__getitems__ already returns the batch."""
        return batch
