"""A training DataLoader that a run stopped mid-epoch resumes exactly where it stopped: its whole state is (epoch,
batches trained in it), the order being one seeded permutation per epoch. The count comes from the trainer's progress
(workers fetch ahead); the resumed iterator skips the trained batches' indices without loading them."""

import itertools
from collections.abc import Callable

from torch.utils.data import BatchSampler, DataLoader


class ResumableBatches(BatchSampler):
    """Batches of the sampler's permutation for its epoch, the first `skip` left out once (after a resume)."""

    skip = 0

    def __iter__(self):  # a generator: the sampler's epoch is read when the first batch is drawn
        skip, self.skip = self.skip, 0
        yield from itertools.islice(super().__iter__(), skip, None)


class ResumableLoader(DataLoader):
    def __init__(self, *args, progress: Callable[[], tuple[int, int]], epoch: Callable[[], int], **kwargs):
        """`progress()` gives (batches trained in this epoch, batches an epoch trains), `epoch()` the epoch training
        is in, from the trainer."""
        super().__init__(*args, **kwargs)
        self.progress, self.epoch = progress, epoch
        self.seed = self.generator.initial_seed() if self.generator is not None else 0

    def __iter__(self):
        if self.generator is not None:  # each epoch's workers seeded from the epoch: a resumed epoch's are the same
            self.generator.manual_seed(self.seed * 1_000_003 + self.epoch())
        return super().__iter__()

    def state_dict(self) -> dict[str, int]:
        epoch, (done, per_epoch) = self.batch_sampler.sampler.epoch, self.progress()
        return {"epoch": epoch + 1, "batches": 0} if done >= per_epoch else {"epoch": epoch, "batches": done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # Lightning creates the iterator before it sets the sampler's epoch (workers fetch indices at once)
        self.batch_sampler.sampler.set_epoch(state["epoch"])
        self.batch_sampler.skip = state["batches"]
