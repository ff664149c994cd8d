"""What each DataLoader worker runs first: its torch, random and numpy generators seeded from the loader's seed for
this iterator, the data-parallel place and the worker's id. The processes of one tensor-parallel group or pipeline
share a place, so they draw the same augmentations; two places or two workers never do. torch and numpy only: a
loader's fork server imports this module, not Lightning (3 s less of imports per training process)."""

import random

import numpy as np
import torch


def seed_worker(worker_id: int, rank: int) -> None:
    loader_seed = torch.initial_seed() - worker_id  # torch seeded this worker with the loader's seed + its id
    words = np.random.SeedSequence([loader_seed, rank, worker_id]).generate_state(4)  # four 32-bit words
    torch.manual_seed(int(words[0]) << 32 | int(words[1]))
    random.seed(int(words[2]))
    np.random.seed(int(words[3]))
