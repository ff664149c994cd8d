"""The random numbers a training process draws itself (dropout, stochastic depth, augmentation in the main process,
decoding on the device): each data-parallel rank draws its own, and a resumed run draws what the stopped one would
have. Every rank's generators (torch's CPU and CUDA, numpy's, Python's) are saved in every checkpoint with the rank's
place in the layout (its data-, tensor- and pipeline-parallel rank), gathered when it is written, and restored to the
process of the same place when training starts again in the same layout; in another layout (another number of
processes, or ddp's checkpoint resumed under tp) they start from the seed, said in one line. Every rank builds the
model from the run's seed (fsdp and tp shard each rank's copy, so the copies must be equal); then ranks other than
data-parallel rank 0 draw from a seed of their own, and data-parallel rank 0 goes on as one process would (a run of
one process draws what it always drew)."""

import logging
import random

import numpy as np
import torch

from starter.callbacks.restored import Restored
from starter.topology import data_parallel_place, layout_place

log = logging.getLogger(__name__)


def generator_states() -> dict:
    """This process's generators, as plain values and tensors (a checkpoint loads weights-only)."""
    kind, words, position, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "numpy": [kind, torch.from_numpy(words.astype(np.int64)), position, has_gauss, gauss],
        "python": random.getstate(),
    }


def set_generator_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(states["cuda"])
    kind, words, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, words.numpy().astype(np.uint32), position, has_gauss, gauss))
    random.setstate(states["python"])


def seed_rank(seed: int, rank: int) -> None:
    """torch's (CPU and CUDA), numpy's and Python's generators from the run's seed and this data-parallel rank."""
    words = np.random.SeedSequence([seed, rank]).generate_state(4)
    torch.manual_seed(int(words[0]) << 32 | int(words[1]))
    random.seed(int(words[2]))
    np.random.seed(int(words[3]))


class RandomState(Restored):
    per_process_state = True  # a torchft heal leaves it: the healed group's processes keep their own

    def __init__(self, seed: int):
        self.seed, self.saved, self.place = int(seed), None, (("data_parallel", 1, 0),)

    def setup(self, trainer, pl_module, stage: str) -> None:  # the model is built; the process group is up
        _, rank = data_parallel_place(trainer)
        if stage == "fit" and rank > 0:
            seed_rank(self.seed, rank)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.place = layout_place(trainer)

    def state_dict(self) -> dict:
        """Every rank's generators and place, gathered (each rank writes the checkpoint, or rank 0 for all)."""
        mine = [generator_states(), list(map(list, self.place))]
        ranks = [mine]
        if trainer_world() > 1:
            ranks = [None] * trainer_world()
            torch.distributed.all_gather_object(ranks, mine)
        return {"ranks": [states for states, _ in ranks], "places": [place for _, place in ranks]}

    def load_state_dict(self, state_dict: dict) -> None:
        with self.reading():  # each rank's place: [[name, size, rank], ...]
            ranks = list(state_dict["ranks"])
            places = [tuple((str(n), int(s), int(r)) for n, s, r in place) for place in state_dict.get("places", [])]
            if "places" not in state_dict:  # saved before places were: its ranks in order, each a data-parallel one
                places = [(("data_parallel", len(ranks), rank),) for rank in range(len(ranks))]
            self.saved = {"ranks": ranks, "places": places}

    def on_train_start(self, trainer, pl_module) -> None:  # after the checkpoint is restored and the sanity check
        saved, self.saved = self.saved, None
        if saved is None:
            return
        places = saved["places"]
        if len(places) == trainer.world_size and self.place in places:
            set_generator_states(saved["ranks"][places.index(self.place)])
        elif trainer.is_global_zero:
            log.warning(
                "the checkpoint holds the random generators of %d process%s (%s), this run has %d (%s): they start"
                " from the seed (dropout and augmentation draw other numbers than the stopped run would have)",
                len(saved["ranks"]),
                "" if len(saved["ranks"]) == 1 else "es",
                ", ".join(f"{name} {size}" for name, size, _ in (places[0] if places else ())),
                trainer.world_size,
                ", ".join(f"{name} {size}" for name, size, _ in self.place),
            )


def trainer_world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
