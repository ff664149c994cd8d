"""`callbacks=state_bytes`: per rank, the bytes held of parameters, gradients and optimizer state (local shards or
stages under fsdp, tp, pp) and the peak memory (GPU: allocated; CPU: resident set), measured after the second optimizer
step into <run_dir>/state_bytes/rank<r>.json."""

import json
from pathlib import Path

import lightning as L
import torch

from starter.atomic_write import replacing


def local_bytes(tensors) -> int:
    """The bytes of this rank's part of each tensor among `tensors` (a DTensor's local shard)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in local)


def state_bytes(module: torch.nn.Module, optimizers) -> dict[str, int]:
    params = list(module.parameters())
    optimizer_tensors = [v for opt in optimizers for state in opt.state.values() for v in state.values()]
    return {
        "parameters": local_bytes(params),
        "gradients": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_bytes(optimizer_tensors),
    }


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


class StateBytes(L.Callback):
    def __init__(self, output_dir: str):
        self.output_dir = Path(output_dir)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != 2:
            return
        figures = state_bytes(pl_module, trainer.optimizers)  # the torch optimizers, not Lightning's wrappers
        figures["peak_memory"] = peak_memory(pl_module.device)
        directory = self.output_dir / "state_bytes"
        directory.mkdir(parents=True, exist_ok=True)
        with replacing(directory / f"rank{trainer.global_rank}.json") as file:
            file.write(json.dumps(figures) + "\n")
