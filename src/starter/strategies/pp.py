"""Pipeline parallel (strategy=pp): the net cut into stages over `pipeline_parallel_size` processes (all of them by
default), the pipelines of the remaining processes training side by side on their shares of the global batch
(pp x dp). How the net is cut and run: strategies/pipeline.py.

The data-parallel pipelines hold whole copies of their stages: their gradients are averaged by one all-reduce per
optimizer step (of the stage's gradients flattened into one buffer), after the schedule has run the step's last
micro-batch; each replica then takes the same optimizer step. For stages sharded over the data-parallel processes
instead (less memory per process, an all-gather per stage forward): strategy=fsdp with pipeline_parallel_size (3D).
"""

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
