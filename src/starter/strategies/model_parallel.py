"""What fsdp, tp and pp share: Lightning's ModelParallelStrategy with the parallelism applied from outside.

Lightning's ModelParallelStrategy expects the LightningModule to parallelize itself in `configure_model`;
here a subclass does it in `parallelize`, so the module stays strategy-agnostic. The device mesh has the sizes
of the run's layout (topology.py), handed over when the strategy is built. Checkpoints are sharded
directories (one file per rank + metadata, torch.distributed.checkpoint); each save writes a new directory
that `last.ckpt`/`best.ckpt` (symlinks) then point at atomically, so a kill never leaves a mix.
"""

import shutil
import time
from pathlib import Path

from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from starter.checkpointing.sharded import point_atomically
from starter.topology import Layout


class OutsideModelParallel(ModelParallelStrategy):
    def __init__(self, layout: Layout, save_distributed_checkpoint: bool = True, **kwargs):
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.layout = layout  # the process sizes (topology.py), computed once before launch
        self.parallelized = False  # fit, then test in the same process: parallelize once

    def mesh_sizes(self) -> tuple[int, int]:
        """(data parallel, tensor parallel) sizes of Lightning's device mesh; their product is the world size (a
        pipeline's stages count as data parallel to the mesh, which the pipeline does not use)."""
        return self.layout.world // self.layout.tensor_parallel, self.layout.tensor_parallel

    def parallelize(self, module: nn.Module) -> None:
        """Apply this strategy's parallelism to `module` (the LightningModule, on its device) in place."""
        raise NotImplementedError

    def place(self) -> None:
        """Move the module to its device before `parallelize` (fsdp's CPU offload places it otherwise)."""
        self.model_to_device()

    @property
    def optimizer_state_on_device(self) -> bool:
        return True

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = self.mesh_sizes()
        super().setup_environment()

    def setup(self, trainer) -> None:
        # ModelParallelStrategy.setup, with `parallelize` instead of the module's configure_model.
        self.accelerator.setup(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.place()
        if not self.parallelized:
            self.parallelize(self.model)
            self.parallelized = True
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and self.optimizer_state_on_device:
            _optimizers_to_device(self.optimizers, self.root_device)

    def full_state_dict(self) -> dict:
        """The whole model's weights, gathered on rank 0 (empty elsewhere): a collective, every process takes part."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.lightning_module, options=options)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        """Write the shards to a new directory, then repoint `filepath` at it: a kill never leaves a mix."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        link = Path(filepath)
        version = self.broadcast(f"{link.name}.{time.time_ns():x}")  # one name for every rank's shards
        super().save_checkpoint(checkpoint, link.parent / version, storage_options)
        self.barrier()  # every shard written
        if self.is_global_zero:
            point_atomically(link, version)
        self.barrier()

    def remove_checkpoint(self, filepath) -> None:
        link = Path(filepath)
        if self.is_global_zero and link.is_symlink():
            shutil.rmtree(link.resolve(), ignore_errors=True)
            link.unlink()
        else:
            super().remove_checkpoint(filepath)
