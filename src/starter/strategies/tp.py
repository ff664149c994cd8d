"""Tensor parallel (Megatron style, DTensor): one layer's weights split over the ranks of a group.

The plan is read off the net's structure, not written into it: an attention block's q, k and v projections
are split column-wise (each rank computes its share of the heads) and its output projection row-wise (one
all-reduce sums the partial outputs); a transformer MLP's first layer column-wise and second row-wise; in a
plain stack of Linear layers, consecutive pairs likewise. The activation between a pair stays split, so each
pair costs one all-reduce in forward and one in backward. Everything else (embedding, norms, the head) is
replicated: every rank of the group sees the same batch and computes the same values for it.
Nets made of such layers: `mlp`, `vit` (preflight.TENSOR_PARALLEL_NETS, checked before launch).
"""

from torch import nn

from starter.strategies.model_parallel import OutsideModelParallel


def tensor_parallel_plan(net: nn.Module) -> dict:
    """{submodule name: how to split it} for the layers of `net` that the rules above recognise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name, module in net.named_modules():
        children = dict(module.named_children())
        path = (lambda child, prefix=name: f"{prefix}.{child}") if name else str
        if {"q", "k", "v", "proj"} <= children.keys():  # attention: heads split over the ranks
            plan |= {path(p): ColwiseParallel() for p in ("q", "k", "v")} | {path("proj"): RowwiseParallel()}
        elif {"fc1", "fc2"} <= children.keys():  # a transformer block's MLP
            plan |= {path("fc1"): ColwiseParallel(), path("fc2"): RowwiseParallel()}
        elif module is net and isinstance(net, nn.Sequential):  # a stack of Linear layers: pairs
            linears = [child for child, layer in children.items() if isinstance(layer, nn.Linear)]
            for first, second in zip(linears[0:-1:2], linears[1::2]):
                plan |= {path(first): ColwiseParallel(), path(second): RowwiseParallel()}
    return plan


def apply_tensor_parallel(module: nn.Module, mesh) -> None:
    """Split the layers of every net inside `module` (the LightningModule) over the ranks of `mesh`."""
    for child in module.children():
        split_layers(child, mesh)


def split_layers(net: nn.Module, mesh) -> None:
    """Split the layers of `net` (a net, or a pipeline stage of one) that the plan recognises over `mesh`."""
    from torch.distributed.tensor.parallel import parallelize_module

    if plan := tensor_parallel_plan(net):
        parallelize_module(net, mesh, plan)


class TensorParallelStrategy(OutsideModelParallel):
    """Every process of the run in one tensor-parallel group: each holds 1/N of the split layers' weights."""

    strategy_name = "tp"

    def parallelize(self, module: nn.Module) -> None:
        apply_tensor_parallel(module, self.device_mesh["tensor_parallel"])

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        step_one_by_one_where_split_and_replicated_mix(self.optimizers)


def step_one_by_one_where_split_and_replicated_mix(optimizers) -> None:
    """The split layers' parameters are DTensors, the replicated ones plain tensors: torch's multi-tensor
    (foreach) optimizer kernels, the default on CUDA, refuse the two in one parameter group. Such a group
    steps its parameters one by one (same maths); under 2D every parameter is a DTensor and nothing changes."""
    from torch.distributed.tensor import DTensor

    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if "foreach" in group and len({isinstance(p, DTensor) for p in group["params"]}) > 1:
                group["foreach"] = False
