"""Fully sharded data parallel with FSDP2 (`torch.distributed.fsdp.fully_shard`), applied from outside the model.

Lightning's ModelParallelStrategy expects the LightningModule to shard itself in `configure_model`; this
subclass does it in the strategy instead, so the module stays strategy-agnostic. Each rank holds 1/N of
every parameter, gradient and optimizer state; a sharding unit's parameters are all-gathered for its
forward and backward and freed after (`reshard_after_forward`), gradients are reduce-scattered. Order of
application, as in torchtitan: activation checkpointing, then sharding units (innermost first), then roots.
Runs on CPU (gloo) and GPU (nccl). Checkpoints are sharded directories (one file per rank + metadata),
each save a new directory that `last.ckpt`/`best.ckpt` (symlinks) then point at atomically.
"""

import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.fsdp import FSDPModule

# Outermost modules of these classes become sharding units: the residual blocks of a ResNet, else each
# Linear/Conv2d layer. A unit is the granularity of all-gather and free: bigger units, fewer collectives.
DEFAULT_UNITS = ("BasicBlock", "Bottleneck", "Linear", "Conv2d")


def sharding_units(module: nn.Module, class_names: Iterable[str]) -> list[nn.Module]:
    """The outermost submodules whose class name is in `class_names` (a unit inside a unit is not split again)."""
    names, units = set(class_names), []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if type(child).__name__ in names:
                units.append(child)
            else:
                visit(child)

    visit(module)
    return units


def apply_activation_checkpointing(units: list[nn.Module]) -> None:
    """Recompute each unit's activations in backward instead of keeping them (memory for compute)."""
    from torch.distributed._composable import checkpoint  # keeps parameter names unchanged, unlike a wrapper

    for unit in units:
        checkpoint(unit)


def apply_fsdp(module: nn.Module, mesh, units: list[nn.Module], reshard_after_forward: bool, cpu_offload: bool):
    """Shard every unit, then each parameter-holding child of `module` as a root for what the units leave."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    for unit in units:
        fully_shard(unit, **kwargs)
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, **kwargs)


def move_state_but_parameters(module: nn.Module, device) -> None:
    """Every tensor but the parameters to `device`: buffers, and the states of parameter-free submodules such as
    torchmetrics metrics. With CPU offload the parameter shards stay in CPU memory (FSDP2 places them)."""
    for submodule in module.modules():
        if next(submodule.parameters(), None) is None:
            submodule.to(device)
        else:
            for name, buffer in submodule.named_buffers(recurse=False):
                setattr(submodule, name, buffer.to(device))


class FSDP2Strategy(ModelParallelStrategy):
    strategy_name = "fsdp"

    def __init__(
        self,
        sharding_units: Iterable[str] = DEFAULT_UNITS,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        **kwargs,
    ):
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.unit_names = tuple(sharding_units)
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.activation_checkpointing = activation_checkpointing

    def setup_environment(self) -> None:
        # Pure data parallelism: every process is one shard (ModelParallelStrategy's "auto" means tensor parallel).
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def setup(self, trainer) -> None:
        # ModelParallelStrategy.setup, with the sharding done here instead of in the module's configure_model.
        self.accelerator.setup(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        if self.cpu_offload:
            move_state_but_parameters(self.model, self.root_device)  # metrics, buffers: where the batch is
        else:
            self.model_to_device()
        if not any(isinstance(m, FSDPModule) for m in self.model.modules()):  # fit, then test: shard once
            units = sharding_units(self.model, self.unit_names)
            if self.activation_checkpointing:
                apply_activation_checkpointing(units)
            mesh = self.device_mesh["data_parallel"]
            apply_fsdp(self.model, mesh, units, self.reshard_after_forward, self.cpu_offload)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.cpu_offload:
            _optimizers_to_device(self.optimizers, self.root_device)

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


def point_atomically(link: Path, target: str) -> None:
    """Make `link` a symlink to the sibling directory `target` with one rename, then delete its older versions
    (also those a killed save left half-written)."""
    temporary = link.with_name(f".{target}.link")
    os.symlink(target, temporary)  # relative: the run directory can be moved
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)  # a plain sharded directory (written without this strategy)
    os.replace(temporary, link)
    for old in link.parent.glob(f"{link.name}.*"):
        if old.name != target:
            shutil.rmtree(old, ignore_errors=True)
