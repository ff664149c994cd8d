"""Pipeline parallel (strategy=pp): the net cut into stages over `pipeline_parallel_size` processes
(strategies/pipeline.py), the remaining processes' pipelines training beside them (pp x dp), holding whole stages whose
gradients one all-reduce per optimizer step averages. Sharded stages instead: strategy=fsdp with pipeline_parallel_size
(3D)."""

import torch
import torch.distributed as dist

from starter.strategies.model_parallel import OutsideModelParallel
from starter.strategies.pipeline import Pipelined


class PipelineStrategy(Pipelined, OutsideModelParallel):
    strategy_name = "pp"
    pipeline_always = True

    def reduce_gradients(self) -> None:
        if self.layout.data_parallel == 1:
            return
        gradients = [p.grad for p in self.lightning_module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in gradients])
        dist.all_reduce(flat, group=self.device_mesh["data_parallel"].get_group())
        flat /= self.layout.data_parallel
        parts = flat.split([g.numel() for g in gradients])
        torch._foreach_copy_(gradients, [part.view_as(g) for part, g in zip(parts, gradients)])
