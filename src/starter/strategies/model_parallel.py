"""What fsdp, tp and pp share: Lightning's ModelParallelStrategy with the parallelism applied from outside the module
(`parallelize`), on a mesh of the run's layout; a module that applies its own in `configure_model` gets Lightning's
mesh and nothing on top. Checkpoints are sharded directories (torch.distributed.checkpoint), each save a new one that
`last.ckpt`/`best.ckpt` symlinks then point at atomically."""

import logging
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from starter.atomic_write import room_for
from starter.checkpointing.resume import is_sharded
from starter.checkpointing.sharded import point_atomically
from starter.checkpointing.sharded_read import read_sharded
from starter.errors import UserError, one_line
from starter.topology import Layout
from starter.untrusted import reading

log = logging.getLogger(__name__)


class OutsideModelParallel(ModelParallelStrategy):
    def __init__(self, layout: Layout, save_distributed_checkpoint: bool = True, async_save: bool = True, **kwargs):
        # Lightning's device mesh: (data parallel, tensor parallel), their product the world size (a pipeline's
        # stages count as data parallel to it; a pipelined strategy meshes its processes itself)
        tensor_parallel = layout.tensor_parallel
        super().__init__(
            data_parallel_size=layout.world // tensor_parallel,
            tensor_parallel_size=tensor_parallel,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )
        self.layout = layout  # the process sizes (topology.py), computed once before launch
        self.sharded_checkpoints = save_distributed_checkpoint
        self.async_save, self.saving, self.saving_group = async_save and save_distributed_checkpoint, None, None
        # each called on every rank with (a sharded checkpoint's directory, the name it is saved as, its global step)
        # once this rank's files of it are written: the checkpoint store's uploads (checkpointing/store.py)
        self.written: list = []
        self.parallelized = False  # fit, then test in the same process: parallelize once

    def parallelize(self, module: nn.Module) -> None:
        """Apply this strategy's parallelism to `module` (the LightningModule, on its device) in place."""
        raise NotImplementedError

    def place(self) -> None:
        """Move the module to its device before `parallelize` (fsdp's CPU offload places it otherwise)."""
        self.model_to_device()

    @property
    def module_parallelizes_itself(self) -> bool:
        """A module that overrides `configure_model` applies its own parallelism there, on `self.device_mesh`
        ("data_parallel", "tensor_parallel": Lightning's ModelParallelStrategy contract); nothing goes on top."""
        return is_overridden("configure_model", self.lightning_module)

    def setup(self, trainer) -> None:
        if self.module_parallelizes_itself:
            if getattr(self, "pipelined", False):
                raise UserError(
                    f"strategy={self.strategy_name} cuts the net into pipeline stages itself, and"
                    f" {type(self.lightning_module).__name__} applies its own parallelism in configure_model();"
                    " train it with strategy=fsdp or strategy=tp (pipeline_parallel_size=1)"
                )
            if not self.parallelized:  # it ran once (fit): a test in the same process must not apply it again
                self.lightning_module.configure_model = _applied_already
                self.parallelized = True
            return ModelParallelStrategy.setup(self, trainer)
        # ModelParallelStrategy.setup, with `parallelize` instead of the module's configure_model (the module is
        # built on its device, never on the meta device; the optimizers have no state yet)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.place()
        if not self.parallelized:
            self.parallelize(self.model)
            self.parallelized = True
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def full_state_dict(self) -> dict:
        """The whole model's weights, gathered on rank 0 (empty elsewhere): a collective, every process takes part."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.lightning_module, options=options)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        """Write the shards to a new directory, then repoint `filepath` at it: a kill never leaves a mix. With
        `async_save`, the shards are copied to memory and a thread writes them while training goes on; `filepath`
        moves once every rank's are written, at the next save or load, or when the stage ends. A full disk is one
        line (atomic_write.room_for), the last whole checkpoint still named. The first rank of each node points the
        name on its node's disk (where nodes share none, each disk keeps its ranks' files of the newest version
        only; where they share one, every node points it at the same version)."""
        if not self.sharded_checkpoints:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        self.finish_saving()
        link = Path(filepath)
        version = self.broadcast(f"{link.name}.{time.time_ns():x}")  # one name for every rank's shards
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        step = checkpoint.get("global_step", 0)
        with room_for(link):
            (link.parent / version).mkdir(parents=True, exist_ok=True)
            if self.async_save:
                self._save_meta(checkpoint, link.parent / version)
                self._write_async(state, link, version, step)
                return
            from torch.distributed.checkpoint import save

            save(state, checkpoint_id=link.parent / version)
            self._save_meta(checkpoint, link.parent / version)
        self._tell_written(link, version, step)
        self.barrier()  # every shard written
        if self.local_rank == 0:
            point_atomically(link, version)
        return self.barrier()

    def _save_meta(self, checkpoint: dict, directory: Path) -> None:
        """The rest, as Lightning writes it, by rank 0: through a file object, so that a full disk is an OSError."""
        if self.is_global_zero:
            with open(directory / "meta.pt", "wb") as file:
                torch.save(checkpoint, file)

    def _write_async(self, state: dict, link: Path, version: str, step: int) -> None:
        from torch.distributed import new_group
        from torch.distributed.checkpoint import async_save

        # a group of its own: the writing thread's collectives must not interleave with training's (and need gloo)
        if self.saving_group is None:
            self.saving_group = new_group(backend="gloo")
        written = async_save(state, checkpoint_id=link.parent / version, process_group=self.saving_group)
        self.saving = (written, link, version, step)

    def finish_saving(self) -> None:
        """Wait for the checkpoint being written, then point its name at it (each rank's writing ends once DCP's
        coordinator has written `.metadata`, after every rank's shards)."""
        saving, self.saving = self.saving, None
        if saving is not None:
            written, link, version, step = saving
            with room_for(link):
                written.result()
            self._tell_written(link, version, step)
            if self.local_rank == 0:
                point_atomically(link, version)

    def _tell_written(self, link: Path, version: str, step: int) -> None:
        for tell in self.written:
            tell(link.parent / version, link.name, step)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Lightning's reading of a sharded checkpoint (the model's shards, each optimizer's, then meta.pt: the rest),
        through a reader that takes data only (checkpointing/sharded_read.py); a whole file is Lightning's."""
        if self.saving is not None:
            self.finish_saving()
            self.barrier()  # the name points at what was written last, on every rank
        with reading(checkpoint_path):
            return self._load_checkpoint(Path(self.broadcast(checkpoint_path)))

    def _load_checkpoint(self, path: Path) -> dict:
        if not is_sharded(path):
            return super().load_checkpoint(path, weights_only=True)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        weights = {"state_dict": get_model_state_dict(self.model)}
        read_sharded(weights, path)
        self.model.load_state_dict(weights["state_dict"], strict=self.lightning_module.strict_loading)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            state = {key: get_optimizer_state_dict(self.model, optimizer)}
            read_sharded(state, path)
            set_optimizer_state_dict(self.model, optimizer, state[key], options=StateDictOptions(cpu_offload=True))
        return torch.load(path / "meta.pt", weights_only=True)

    def teardown(self) -> None:
        failing = sys.exc_info()[1]  # torn down on the way out of an error: that one is the run's to say
        try:
            self.finish_saving()
        except Exception as err:
            if failing is None:
                raise
            log.warning("the checkpoint being written as the run failed is left unnamed: %s", one_line(err))
        finally:
            super().teardown()


def _applied_already() -> None:
    """A module's configure_model after its first call in this process: Lightning calls it again for each stage
    (fit, then test), and its parallelism, applied once, must not be applied twice (fully_shard and
    parallelize_module refuse)."""
