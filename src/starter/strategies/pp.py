"""Pipeline parallel (torch.distributed.pipelining): the net cut into stages, micro-batches flowing through them.

The net must be an nn.Sequential (mlp, cnn, vit are): its layers are cut into `devices x num_nodes x
stages_per_rank` contiguous stages of about equal parameter counts, each stage keeping at least one layer
with parameters, and stage s runs on rank s mod N (as torchtitan does: every rank keeps a copy of the
module and drops the layers it does not own, so parameter names, checkpoints and model.pt stay those of the
plain net). Each training step splits the batch into `microbatches` and runs the schedule (`gpipe`: all
forwards, then all backwards; `1f1b`: one forward, one backward, in steady state; `interleaved_1f1b`: several
stages per rank, smaller bubbles), which also runs backward: the loss is the LightningModule's `criterion`
per micro-batch, gradients scaled to the full batch's mean. Every rank loads the same batches.

The LightningModule stays as it is. Its training_step runs on the last stage with `forward` answering the
pipeline's output (and, at logging steps, on rank 0 too, with that output broadcast: rank 0 writes the logs).
Its validation and test steps run on every rank: the last stage with the real outputs, the others with an
empty batch, so torchmetrics syncs exact totals across all ranks. An evaluation batch smaller than the
others is padded for the pipeline and the padding cut off before the metrics see it.
"""

from functools import cache
from pathlib import Path

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from starter.errors import UserError
from starter.logging_step import is_logging_step
from starter.strategies.model_parallel import OutsideModelParallel

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def pipelined_net(module: nn.Module) -> nn.Sequential:
    """The nn.Sequential child of the LightningModule that holds its parameters (Classifier.net)."""
    for child in module.children():
        if isinstance(child, nn.Sequential) and next(child.parameters(), None) is not None:
            return child
    raise UserError(f"strategy=pp cuts an nn.Sequential net into stages; {type(module).__name__} has none"
                    " (nets that are: mlp, cnn, vit)")  # fmt: skip


def balanced_stages(layers: list[nn.Module], stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of `layers`, each holding parameters, the largest stage as small as it can
    be. A stage starts at the first layer or at a layer with parameters: layers without (ReLU, Flatten) stay
    with the layer before them."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    holders = [i for i, size in enumerate(sizes) if size]
    if len(holders) < stages:
        raise UserError(f"strategy=pp: the net has {len(holders)} layers with parameters, too few for {stages}"
                        " stages; use fewer devices or stages_per_rank")  # fmt: skip
    starts = [0] + holders[1:]
    total = [0]
    for size in sizes:
        total.append(total[-1] + size)

    @cache
    def best(i: int, left: int) -> tuple[int, tuple[int, ...]]:  # `left` stages from starts[i] to the end
        if left == 1:
            return total[-1] - total[starts[i]], (starts[i],)
        options = []
        for j in range(i + 1, len(starts) - left + 2):
            largest, rest = best(j, left - 1)
            options.append((max(total[starts[j]] - total[starts[i]], largest), (starts[i], *rest)))
        return min(options)

    chosen = best(0, stages)[1]
    return list(zip(chosen, [*chosen[1:], len(layers)]))


class PipelineStrategy(OutsideModelParallel):
    strategy_name = "pp"

    def __init__(self, schedule: str = "1f1b", microbatches: int = 4, stages_per_rank: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if schedule not in SCHEDULES:
            raise UserError(f"strategy.schedule={schedule}: choose one of {', '.join(SCHEDULES)}")
        self.schedule_name, self.microbatches = schedule, int(microbatches)
        self.stages_per_rank = int(stages_per_rank or (2 if schedule == "interleaved_1f1b" else 1))
        self.schedule = None
        self.is_first = self.is_last = False
        self.last_rank = 0
        self.output_tail: tuple[int, ...] | None = None  # an output's shape without the batch dimension
        self.batch_rows = 0
        self.gradients: list = []

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": 1, "rank": 0}  # every stage sees the same batches

    def parallelize(self, module: nn.Module) -> None:
        from torch.distributed import pipelining

        net, world, rank = pipelined_net(module), self.world_size, self.global_rank
        count = world * self.stages_per_rank
        bounds = balanced_stages(list(net), count)
        mine = [s for s in range(count) if s % world == rank]
        owned = {i for s in mine for i in range(*bounds[s])}
        stages = [pipelining.PipelineStage(nn.Sequential(*(net[i] for i in range(*bounds[s]))), s, count,
                                           self.root_device) for s in mine]  # fmt: skip
        for i in range(len(net)):
            if i not in owned:
                net[i] = nn.Identity()  # names of the owned layers are kept: net.<i>.<...>
        self.is_first, self.is_last, self.last_rank = 0 in mine, count - 1 in mine, (count - 1) % world
        schedule = getattr(pipelining, SCHEDULES[self.schedule_name])
        self.schedule = schedule(stages if self.stages_per_rank > 1 else stages[0], n_microbatches=self.microbatches,
                                 loss_fn=self._loss, scale_grads=False)  # fmt: skip

    def _loss(self, output, target):
        """A micro-batch's share of the loss of the optimizer step (the schedule does not scale gradients)."""
        shares = self.microbatches * self.lightning_module.trainer.accumulate_grad_batches
        return self.lightning_module.criterion(output, target) / shares

    def _inputs(self, images):
        return (images,) if self.is_first else ()

    def training_step(self, batch, batch_idx, *args, **kwargs):
        images, labels = batch
        trainer = self.lightning_module.trainer
        parameters = list(self.lightning_module.parameters())
        if batch_idx % trainer.accumulate_grad_batches == 0:  # a new optimizer step: the schedule adds to .grad
            for parameter in parameters:
                parameter.grad = None
        with self.precision_plugin.train_step_context():
            output = self.schedule.step(*self._inputs(images), target=labels if self.is_last else None)
            # Lightning zeroes gradients between training_step and backward (where a training_step only did the
            # forward): the schedule's are set aside here and put back in `backward`.
            self.gradients = [parameter.grad for parameter in parameters]
            for parameter in parameters:
                parameter.grad = None
            if is_logging_step(trainer):  # rank 0 writes this step's logs: it needs the output
                output = self.broadcast(output.detach().cpu() if self.is_last else None, src=self.last_rank)
                if self.is_global_zero and not self.is_last:
                    return self._with_output(output.to(self.root_device), "training_step", batch, batch_idx)
            if self.is_last:
                return self._with_output(output.detach().to(self.root_device), "training_step", batch, batch_idx)
        return torch.zeros((), device=self.root_device)  # this stage has no loss; its backward is done

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        for parameter, gradient in zip(self.lightning_module.parameters(), self.gradients):
            parameter.grad = gradient  # the schedule ran backward, micro-batch by micro-batch
        return closure_loss

    def validation_step(self, batch, batch_idx, *args, **kwargs):
        return self._evaluate("validation_step", batch, batch_idx, *args, **kwargs)

    def test_step(self, batch, batch_idx, *args, **kwargs):
        return self._evaluate("test_step", batch, batch_idx, *args, **kwargs)

    def _evaluate(self, hook: str, batch, *args, **kwargs):
        images, labels = batch
        rows = len(labels)
        if not self.batch_rows:  # the batch size the stages are shaped for (every rank loads the global batch)
            self.batch_rows = getattr(self.lightning_module.trainer.datamodule, "batch_size", rows)
        padded = [images, labels]
        if rows < self.batch_rows:  # the last, smaller batch: padded for the stages, cut off again below
            padded = [torch.cat([t, t[-1:].expand(self.batch_rows - rows, *t.shape[1:])]) for t in padded]
        with torch.inference_mode(False), torch.no_grad(), self.precision_plugin.val_step_context():
            # the schedule computes the loss of the last stage's micro-batches in eval too: it needs the targets
            output = self.schedule.eval(*self._inputs(padded[0]), target=padded[1] if self.is_last else None)
            if self.output_tail is None:  # once: the last stage tells the others the shape of an output
                self.output_tail = self.broadcast(tuple(output.shape[1:]) if self.is_last else None, self.last_rank)
            if not self.is_last:  # no outputs here: an empty batch, so the metrics still take part in the sync
                output, rows = torch.empty(0, *self.output_tail, device=self.root_device), 0
            return self._with_output(output[:rows], hook, (images[:rows], labels[:rows]), *args, **kwargs)

    def _with_output(self, output: torch.Tensor, hook: str, *args, **kwargs):
        """Run the LightningModule's `hook` with its forward answering `output` (the pipeline did the forward)."""
        module = self.lightning_module
        module.forward = lambda *_, **__: output  # an instance attribute shadows the class's forward
        try:
            return getattr(module, hook)(*args, **kwargs)
        finally:
            del module.forward

    def optimizer_state(self, optimizer) -> dict:
        return self._per_rank(super().optimizer_state(optimizer))

    def _per_rank(self, state: dict) -> dict:
        """An optimizer state whose parameter groups are saved per rank: torch.distributed.checkpoint keeps one copy
        of what is not a tensor, as if every rank had the same; a stage's groups name that stage's parameters."""
        return {"state": state["state"], f"param_groups_of_rank{self.global_rank}": state["param_groups"]}

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Each rank reads its stages' weights and optimizer state from the sharded checkpoint (Lightning's own
        loader expects DTensor parameters, which a pipeline does not have); returns the rest of the checkpoint."""
        from torch.distributed import checkpoint
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if path.is_file():  # one file of the whole model (another strategy's): each rank takes its stages' weights
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
                raise UserError(f"ckpt_path={path}: a pipeline resumes from its own sharded checkpoint (evaluating"
                                " this one works: train=false)")  # fmt: skip
            saved = torch.load(path, map_location="cpu", weights_only=weights_only)
            weights = saved.pop("state_dict")
            self.model.load_state_dict({name: weights[name] for name in self.model.state_dict()})
            return saved
        weights = {"state_dict": get_model_state_dict(self.model)}
        checkpoint.load(weights, checkpoint_id=path)
        self.model.load_state_dict(weights["state_dict"])
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING  # testing: fit's optimizers linger
        for index, optimizer in enumerate(self.optimizers if fitting else []):
            state = {f"optimizer_{index}": self._per_rank(get_optimizer_state_dict(self.model, optimizer))}
            checkpoint.load(state, checkpoint_id=path)
            mine = state[f"optimizer_{index}"]
            mine = {"state": mine["state"], "param_groups": mine[f"param_groups_of_rank{self.global_rank}"]}
            set_optimizer_state_dict(self.model, optimizer, mine, options=StateDictOptions(cpu_offload=True))
        return torch.load(path / "meta.pt", weights_only=weights_only)

    def full_state_dict(self) -> dict:
        """Every stage's weights, gathered on rank 0 (empty elsewhere): the plain net's state dict."""
        mine = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        parts = [None] * self.world_size if self.is_global_zero else None
        torch.distributed.gather_object(mine, parts, dst=0)
        return {k: v for part in parts for k, v in part.items()} if self.is_global_zero else {}
