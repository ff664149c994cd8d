"""Tensor parallel (Megatron style, DTensor): one layer's weights split over the ranks of a group. The plan is read off
the net's structure, never its class name: attention q, k, v column-wise and proj row-wise (one all-reduce sums the
partial outputs), an MLP's fc1 and fc2 likewise, a Sequential's Linear pairs; the rest is replicated, every rank of the
group seeing the same batch. A net may declare its own plan (torchtitan's way): `tensor_parallel_plan()` returning
{submodule name: ColwiseParallel() | RowwiseParallel() | ...}.
"""

from torch import nn

from starter.errors import UserError
from starter.strategies.model_parallel import OutsideModelParallel

WHAT_SPLITS = (
    "attention blocks with Linear children q, k, v and proj, MLP blocks with fc1 and fc2, a Sequential"
    " of Linear layers, or a tensor_parallel_plan() method of its own"
)


def tensor_parallel_plan(net: nn.Module) -> dict:
    """{submodule name: how to split it}: the plan `net` declares, else the layers the rules above recognise."""
    if callable(getattr(net, "tensor_parallel_plan", None)):
        return dict(net.tensor_parallel_plan())
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for name, module in net.named_modules():
        children = dict(module.named_children())
        path = (lambda child, prefix=name: f"{prefix}.{child}") if name else str
        if {"q", "k", "v", "proj"} <= children.keys():  # attention: heads split over the ranks
            plan |= {path(p): ColwiseParallel() for p in ("q", "k", "v")} | {path("proj"): RowwiseParallel()}
        elif {"fc1", "fc2"} <= children.keys():  # a transformer block's MLP
            plan |= {path("fc1"): ColwiseParallel(), path("fc2"): RowwiseParallel()}
        elif module is net and isinstance(net, nn.Sequential):  # Linear layers with only activations between: pairs
            first = None
            for child, layer in children.items():
                if isinstance(layer, nn.Linear) and first is not None:
                    plan |= {path(first): ColwiseParallel(), path(child): RowwiseParallel()}
                    first = None
                elif isinstance(layer, nn.Linear) or next(layer.parameters(), None) is not None:
                    first = child if isinstance(layer, nn.Linear) else None
    return {name: style for name, style in plan.items() if isinstance(net.get_submodule(name), nn.Linear)}


def check_splits(net: nn.Module, plan: dict, size: int) -> None:
    """Every split layer divides over `size` ranks, and so does every attention block's count of heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    for name, style in plan.items():
        layer = net.get_submodule(name)
        features = layer.out_features if isinstance(style, ColwiseParallel) else layer.in_features
        if features % size:
            raise UserError(
                f"{type(net).__name__}.{name} has {features} features, which do not split over {size}"
                f" tensor-parallel processes; use a multiple of {size}"
            )
    for name, module in net.named_modules():
        head_dim = getattr(module, "head_dim", None)
        if isinstance(head_dim, int) and isinstance(getattr(module, "q", None), nn.Linear):
            heads = module.q.out_features // head_dim
            if heads % size:
                raise UserError(
                    f"{type(net).__name__}.{name} has {heads} attention heads, which do not split over"
                    f" {size} tensor-parallel processes; use a multiple of {size}"
                )


def check_no_split_ties(net: nn.Module, plan: dict) -> None:
    """A layer the plan splits shares no parameter with another module (tied weights): each owner would split it its
    own way, two tensors where there was one."""
    owners: dict[int, list[str]] = {}
    for name, module in net.named_modules(remove_duplicate=False):
        for parameter in module.parameters(recurse=False):
            owners.setdefault(id(parameter), []).append(name)
    for names in owners.values():
        if len(names) > 1 and any(name in plan for name in names):
            a, b = (f"{type(net).__name__}.{name}" for name in names[:2])
            raise UserError(
                f"tensor parallel would split {a} and {b}, which share a parameter (tied weights), into two tensors;"
                " untie them or train with strategy=fsdp or ddp"
            )


def apply_tensor_parallel(module: nn.Module, mesh) -> None:
    """Split the layers of every net inside the LightningModule over `mesh`; nothing to split is refused."""
    nets = [child for child in module.children() if next(child.parameters(), None) is not None]
    if not any(split_layers(net, mesh) for net in nets):
        names = ", ".join(type(net).__name__ for net in nets) or f"{type(module).__name__} (no net)"
        raise UserError(
            f"tensor parallel found nothing to split in {names}: it needs {WHAT_SPLITS}; train it with"
            " strategy=fsdp or ddp instead"
        )


def split_layers(net: nn.Module, mesh) -> bool:
    """Split the layers of `net` (or a pipeline stage) that its plan names over `mesh`; False for an empty plan."""
    from torch.distributed.tensor.parallel import parallelize_module

    if not (plan := tensor_parallel_plan(net)):
        return False
    check_splits(net, plan, mesh.size())
    check_no_split_ties(net, plan)
    parallelize_module(net, mesh, plan)
    return True


class TensorParallelStrategy(OutsideModelParallel):
    """Every process of the run in one tensor-parallel group: each holds 1/N of the split layers' weights."""

    strategy_name = "tp"

    def parallelize(self, module: nn.Module) -> None:
        apply_tensor_parallel(module, self.device_mesh["tensor_parallel"])

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        step_one_by_one_where_split_and_replicated_mix(self.optimizers)


def step_one_by_one_where_split_and_replicated_mix(optimizers) -> None:
    """torch's multi-tensor (foreach) optimizer kernels, the default on CUDA, refuse DTensors (split layers) and
    plain tensors (replicated ones) in one parameter group: such a group steps one by one (same maths)."""
    from torch.distributed.tensor import DTensor

    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if "foreach" in group and len({isinstance(p, DTensor) for p in group["params"]}) > 1:
                group["foreach"] = False
