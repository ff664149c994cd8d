"""Fully sharded data parallel with FSDP2 (`torch.distributed.fsdp.fully_shard`), applied from outside the model in
torchtitan's order: tensor parallel (2D), activation checkpointing, sharding units (innermost first), roots; per
pipeline stage with `pipeline_parallel_size` (3D).
"""

from collections.abc import Iterable

import torch
from torch import nn

from starter.errors import UserError
from starter.strategies.model_parallel import OutsideModelParallel
from starter.strategies.pipeline import Pipelined
from starter.strategies.tp import apply_tensor_parallel, split_layers

# Outermost modules of these classes become sharding units (ResNet's residual blocks, ViT's blocks, else each layer):
# the granularity of all-gather and free, bigger units making fewer collectives.
DEFAULT_UNITS = ("BasicBlock", "Bottleneck", "Block", "Linear", "Conv2d")
MIXED_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}  # what parameters are computed with
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def sharding_units(module: nn.Module, class_names: Iterable[str]) -> list[nn.Module]:
    """The outermost submodules whose class name is in `class_names` (a unit inside a unit is not split again); each
    once, where the model holds it at several places (one block applied at each: ALBERT's)."""
    names, units, seen = set(class_names), [], set()

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            if type(child).__name__ in names:
                units.append(child)
            else:
                visit(child)

    visit(module)
    return units


def tied(module: nn.Module, units: list[nn.Module]) -> tuple[list[nn.Module], list[list[nn.Module]]]:
    """FSDP2 shards a parameter in one group. Where modules share one (tied weights: an output layer sharing the
    embedding's), a unit holding only some of its owners is no unit (the group around it takes them all), and the
    module's children holding them are sharded together. Returns (units, groups of the module's children to shard)."""
    owners: dict[int, list[nn.Module]] = {}
    for owner in module.modules():
        for parameter in owner.parameters(recurse=False):
            owners.setdefault(id(parameter), []).append(owner)
    ties = [found for found in owners.values() if len(found) > 1]

    def holds(outer: nn.Module, owner: nn.Module) -> bool:
        return any(owner is inner for inner in outer.modules())

    units = [u for u in units if all(len({holds(u, owner) for owner in tie}) == 1 for tie in ties)]
    roots = [c for c in module.children() if next(c.parameters(), None) is not None and c not in units]
    if any(len([c for c in roots if any(holds(c, owner) for owner in tie)]) > 1 for tie in ties):
        return units, [[module]]  # tied across its children: the module is the group, its steps its forward
    return units, [[root] for root in roots]


def apply_fsdp(
    roots: list[list[nn.Module]],
    mesh,
    units: list[nn.Module],
    reshard_after_forward: bool,
    cpu_offload: bool,
    param_dtype=None,
):
    """Shard every unit, then every group of roots (one FSDP group each) for what the units leave. `param_dtype` (bf16
    or fp16): parameters are all-gathered and computed with in it, gradients reduce-scattered in fp32; BatchNorm stays
    in fp32."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mixed = MixedPrecisionPolicy(param_dtype, torch.float32) if param_dtype else MixedPrecisionPolicy()
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mixed,
        offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    )
    if param_dtype:  # BatchNorm keeps fp32 weights and running statistics (as FSDP1's mixed precision does): a
        # half-precision weight beside the fp32 statistics fails in its kernels; each becomes a unit of its own, its
        # input left as it comes (batch norm takes half-precision input with fp32 weights)
        norm = dict(kwargs, mp_policy=MixedPrecisionPolicy(torch.float32, torch.float32, cast_forward_inputs=False))
        for root in [root for group in roots for root in group]:
            for batch_norm in [m for m in root.modules() if isinstance(m, BATCH_NORMS)]:
                fully_shard(batch_norm, **norm)
    for unit in units:
        fully_shard(unit, **kwargs)
    for group in roots:
        fully_shard(group if len(group) > 1 else group[0], **kwargs)


def move_state_but_parameters(module: nn.Module, device) -> None:
    """Every tensor but the parameters (CPU-offloaded shards, placed by FSDP2) to `device`: buffers, metrics."""
    for submodule in module.modules():
        if next(submodule.parameters(), None) is None:
            submodule.to(device)
        else:
            for name, buffer in submodule.named_buffers(recurse=False):
                setattr(submodule, name, buffer.to(device))


class FSDP2Strategy(Pipelined, OutsideModelParallel):
    """FSDP2 over the data-parallel processes; tensor parallel first within groups of `tensor_parallel_size` (2D);
    both per pipeline stage with `pipeline_parallel_size` > 1 (3D)."""

    strategy_name = "fsdp"

    def __init__(
        self,
        sharding_units: Iterable[str] = DEFAULT_UNITS,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        activation_checkpointing: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.unit_names, self.reshard_after_forward = tuple(sharding_units), reshard_after_forward
        self.cpu_offload, self.activation_checkpointing = cpu_offload, activation_checkpointing

    def place(self) -> None:
        if self.cpu_offload:
            move_state_but_parameters(self.model, self.root_device)  # metrics, buffers: where the batch is
        else:
            self.model_to_device()

    def parallelize_whole(self, module: nn.Module) -> None:
        # torchtitan's order: tensor parallel, then activation checkpointing, then FSDP.
        if self.layout.tensor_parallel > 1:
            apply_tensor_parallel(module, self.device_mesh["tensor_parallel"])
        if own := [name for name, _ in module.named_parameters(recurse=False)]:
            raise UserError(
                f"strategy=fsdp shards the module's submodules, and {', '.join(own)} are parameters of"
                f" {type(module).__name__} itself; hold them in a submodule (an nn.Module attribute)"
            )
        units, roots = tied(module, sharding_units(module, self.unit_names))
        self._shard(roots, units)
        if roots == [[module]]:  # its parameters all-gathered for each step, which Lightning calls, not forward
            from torch.distributed.fsdp import register_fsdp_forward_method

            for step in ("training_step", "validation_step", "test_step", "predict_step"):
                register_fsdp_forward_method(module, step)

    def parallelize_stage(self, stage: nn.Module) -> None:
        if self.layout.tensor_parallel > 1:
            split_layers(stage, self.device_mesh["tensor_parallel"])
        units, _ = tied(stage, sharding_units(stage, self.unit_names))
        self._shard([[stage]], units)  # the stage is its own root: torch's pipeline reduce-scatters its gradients
        # after the step's last micro-batch

    def _shard(self, roots: list[list[nn.Module]], units: list[nn.Module]) -> None:
        if self.activation_checkpointing:  # each unit's activations recomputed in backward instead of kept
            from torch.distributed._composable import checkpoint  # keeps parameter names, unlike a wrapper

            for unit in units:
                checkpoint(unit)
        param_dtype = MIXED_DTYPES.get(getattr(self.precision_plugin, "precision", ""))
        apply_fsdp(
            roots, self.device_mesh["data_parallel"], units, self.reshard_after_forward, self.cpu_offload, param_dtype
        )
