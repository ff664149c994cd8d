"""What each DataLoader worker runs first: its torch, random and numpy generators seeded from the loader's seed, the
data-parallel place and the worker's id (a tensor-parallel group or pipeline draws the same augmentations). No
Lightning: a loader's fork server imports this module."""

import random

import numpy as np
import torch


def seed_worker(worker_id: int, rank: int) -> None:
    loader_seed = torch.initial_seed() - worker_id  # torch seeded this worker with the loader's seed + its id
    words = np.random.SeedSequence([loader_seed, rank, worker_id]).generate_state(4)  # four 32-bit words
    torch.manual_seed(int(words[0]) << 32 | int(words[1]))
    random.seed(int(words[2]))
    np.random.seed(int(words[3]))
