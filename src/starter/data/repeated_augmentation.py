"""Repeated augmentation (torchvision's `--ra-sampler --ra-reps N`, DeiT's): each image of an epoch's permutation N
times in a row, its copies on consecutive ranks, each augmented on its own; each rank keeps len(dataset) // world of its
share, so an epoch has as many steps as without it."""

import torch
from torch.utils.data import Dataset, DistributedSampler


class RepeatedAugmentationSampler(DistributedSampler):
    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, repetitions: int, seed: int = 0):
        super().__init__(dataset, num_replicas, rank, shuffle=True, seed=seed, drop_last=True)
        self.repetitions = int(repetitions)

    def __iter__(self):
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator).repeat_interleave(self.repetitions)
        return iter(order[self.rank :: self.num_replicas][: self.num_samples].tolist())
