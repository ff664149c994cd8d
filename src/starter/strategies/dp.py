"""DataParallel (dp), which Lightning 2 removed: one process, each forward split over the visible GPUs (the batch
scattered, replicas run in threads, outputs gathered on the first GPU). The step around it runs once on the whole
batch, so it equals one device's, and checkpoints have no `module.` prefix.
"""

from contextlib import nullcontext

import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn


class _ClassForward(nn.Module):
    """Calls the class's own `forward` of the wrapped module (bypassing the strategy's override below)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        # the caller's autocast, copied into each replica per call: a replica's thread would default to fp16
        self.autocast: tuple[bool, torch.dtype] = (False, torch.float32)

    def forward(self, *args, **kwargs):
        enabled, dtype = self.autocast
        with torch.autocast("cuda", dtype=dtype) if enabled else nullcontext():
            return type(self.module).forward(self.module, *args, **kwargs)


class DataParallelStrategy(ParallelStrategy):
    strategy_name = "dp"

    def __init__(self, accelerator=None, parallel_devices=None, checkpoint_io=None, precision_plugin=None):
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._data_parallel: nn.DataParallel | None = None

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0]

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": 1, "rank": 0}  # one process loads the whole global batch

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def setup(self, trainer) -> None:
        self.model_to_device()
        super().setup(trainer)
        device_ids = [d.index for d in self.parallel_devices if d.type == "cuda"]
        self._data_parallel = nn.DataParallel(_ClassForward(self.lightning_module), device_ids=device_ids or None)
        # until teardown, the module's forward (in every step) splits: an instance attribute shadows the class's
        self.lightning_module.forward = self._forward_on_all_devices

    def _forward_on_all_devices(self, *args, **kwargs):
        self._data_parallel.module.autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        return self._data_parallel(*args, **kwargs)

    def reduce(self, tensor, *args, **kwargs):
        return tensor  # one process: nothing to reduce across

    def barrier(self, *args, **kwargs) -> None:
        pass

    def broadcast(self, obj, src: int = 0):
        return obj

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        return tensor

    def teardown(self) -> None:
        if self.lightning_module is not None:
            vars(self.lightning_module).pop("forward", None)
        self._data_parallel = None
        super().teardown()
