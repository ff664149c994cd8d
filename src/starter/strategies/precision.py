"""Lightning's precision plugins, made to hold for sharded, split and staged gradients as for whole ones: clipping by
the norm of the whole model's gradient (DTensor norms reduced over their mesh, a pipeline's stages adding theirs, as
torchtitan does), and fp16 loss scaling whose overflow decision every rank shares (one all-reduce per optimizer step).
Built from the `precision` key, not by Lightning from the string: Lightning turns 16-mixed on CPU into bf16-mixed and
refuses it with its ModelParallelStrategy, while torch 2.14 has fp16 autocast and a GradScaler on CPU.
"""

from collections import defaultdict

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.distributed.tensor import DTensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a DTensor's local shard (sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def global_norm(grads: list[torch.Tensor], pipeline_group=None) -> torch.Tensor:
    """The 2-norm of the model's whole gradient, of which `grads` are what this process holds."""
    squares = []
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if plain:
        squares.append(torch.nn.utils.get_total_norm(plain, 2.0).float() ** 2)
    on_mesh = defaultdict(list)
    for g in grads:
        if isinstance(g, DTensor):
            on_mesh[g.device_mesh].append(g)
    for same_mesh in on_mesh.values():  # reduced over the mesh: the norm of the full tensors
        squares.append(torch.nn.utils.get_total_norm(same_mesh, 2.0).full_tensor().float() ** 2)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pipeline_group is not None:  # the other stages' parts of the model
        dist.all_reduce(total, group=pipeline_group)
    return total.sqrt()


class GlobalNormClipping:
    """Mixed into a Lightning precision plugin: clipping by the norm of the whole model's gradient."""

    pipeline_group = None  # set by a pipelined strategy: the processes whose stages make up one model

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]
        factor = torch.clamp(clip_val / (global_norm(grads, self.pipeline_group) + 1e-6), max=1.0)
        for same_device in _by_device([local_part(g) for g in grads]):
            torch._foreach_mul_(same_device, factor.to(same_device[0].device))

    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        for p in self.main_params(optimizer):
            if p.grad is not None:
                local_part(p.grad).clamp_(-clip_val, clip_val)


def _by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return list(groups.values())


class SharedOverflowScaler(torch.amp.GradScaler):
    """torch's GradScaler over each gradient's local part (DTensor shards and plain tensors apart: torch's kernel
    refuses them together), the found-inf flag all-reduced where `shared`, as torch's FSDP1 ShardedGradScaler does."""

    def __init__(self, device: str, shared: bool):
        super().__init__(device)
        self.shared = shared

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        local = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not allow_fp16 and p.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                local.append(local_part(p.grad))
        found = torch.zeros(1, dtype=torch.float32, device=found_inf.device)
        for same_device in _by_device(local):
            device = same_device[0].device
            here = found.to(device)
            torch._amp_foreach_non_finite_check_and_unscale_(same_device, here, inv_scale.to(device))
            found = torch.maximum(found, here.to(found.device))
        if self.shared and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # an inf on any process skips the step on all
        return {found.device: found}


class FullPrecision(GlobalNormClipping, Precision):
    pass


class AutocastPrecision(GlobalNormClipping, MixedPrecision):
    pass


class TruePrecision(GlobalNormClipping, HalfPrecision):
    pass


def precision_plugin(precision: str, device_type: str, whole_weights: bool = True) -> Precision:
    """The plugin for `precision` on `device_type` (cuda | cpu); `whole_weights`: the strategy's trait."""
    if precision == "32":
        return FullPrecision()
    if precision == "16-mixed":
        scaler = SharedOverflowScaler(device_type, shared=not whole_weights)
        return AutocastPrecision("16-mixed", device_type, scaler=scaler)
    if precision == "bf16-mixed":
        return AutocastPrecision("bf16-mixed", device_type)
    if precision == "bf16-true":
        return TruePrecision("bf16-true")
    raise ValueError(f"precision={precision}")
