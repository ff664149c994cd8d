"""Pipeline parallel for the model-parallel strategies (torch.distributed.pipelining), the LightningModule left as it
is. The net's nn.Sequential is cut into stages of about equal parameter counts; as in torchtitan each process keeps its
copy of the module with the layers it does not own dropped, so names, checkpoints and model.pt stay the plain net's.
A schedule runs forward and backward per micro-batch with the module's `criterion`; the module's steps run where the
outputs are, the other processes' evaluation steps with an empty batch, so metrics sync exact totals (docs/modes.md).
"""

from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from starter.checkpointing.sharded_read import read_sharded
from starter.errors import UserError
from starter.models.logging_step import is_logging_step, steps_optimizer
from starter.strategies.pipeline_plan import PIPELINE_SCHEDULES, stages_per_process
from starter.topology import per_process_batch
from starter.untrusted import reading


def pipelined_net(module: nn.Module) -> nn.Sequential:
    """The nn.Sequential child of the LightningModule that holds its parameters (Classifier.net)."""
    for child in module.children():
        if isinstance(child, nn.Sequential) and next(child.parameters(), None) is not None:
            return child
    raise UserError(
        f"a pipeline cuts an nn.Sequential net into stages; {type(module).__name__} has none"
        " (nets that are: mlp, cnn, vit)"
    )


def check_ties(net: nn.Sequential, bounds: list[tuple[int, int]], strategy: str) -> None:
    """A parameter two layers share (tied weights) stays in one stage: each stage holds its own parameters."""
    first_held = {}
    for stage, (first, end) in enumerate(bounds):
        for layer in range(first, end):
            for parameter in net[layer].parameters():
                held = first_held.setdefault(id(parameter), (stage, layer))
                if held[0] != stage:
                    raise UserError(
                        f"strategy={strategy} cuts the net into {len(bounds)} stages, and its layers {held[1]} and"
                        f" {layer} share a parameter (tied weights) across two of them; keep them in one stage or"
                        " train with strategy=fsdp"
                    )


def balanced_stages(layers: list[nn.Module], stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of `layers`, each holding parameters, the largest as small as it can be;
    layers without parameters (ReLU, Flatten) stay with the layer before them."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    holders = [i for i, size in enumerate(sizes) if size]
    if len(holders) < stages:
        raise UserError(
            f"the pipeline needs {stages} stages and the net has {len(holders)} layers with parameters;"
            " use fewer stages (strategy.pipeline_parallel_size, strategy.stages_per_rank)"
        )
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


class Pipelined:
    """Mixed into a model-parallel strategy: the net runs as a pipeline when the layout has a pipeline dimension,
    or always (`pipeline_always`, strategy=pp); the strategy's own parallelism goes to each stage or the whole net."""

    pipeline_always = False

    def __init__(
        self, *args, schedule: str = "1f1b", microbatches: int = 4, stages_per_rank: int | None = None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.schedule_name, self.microbatches = schedule, int(microbatches)
        self.stages_per_rank = stages_per_process(schedule, stages_per_rank)
        self.schedule, self.batch_rows, self.gradients = None, 0, []
        self.is_first = self.is_last = False
        self.output_source = 0  # the global rank of the first pipeline's last stage (rank 0 logs its output)
        self.output_tail: tuple[int, ...] | None = None  # an output's shape without the batch dimension

    @property
    def pipelined(self) -> bool:
        return self.pipeline_always or self.layout.pipeline_parallel > 1

    def parallelize_whole(self, module: nn.Module) -> None:
        """This strategy's parallelism for the whole net (when there is no pipeline)."""
        raise NotImplementedError

    def parallelize_stage(self, stage: nn.Module) -> None:
        """This strategy's parallelism for one stage (an nn.Sequential of the net's layers)."""

    def reduce_gradients(self) -> None:
        """Once per optimizer step: make the data-parallel pipelines' gradients one (the strategy's way)."""

    pipeline_mesh = None

    @property
    def device_mesh(self):
        """Lightning's mesh has no pipeline dimension: a pipelined run's is (pipeline, data, tensor)."""
        return self.pipeline_mesh if self.pipeline_mesh is not None else super().device_mesh

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.pipelined:
            from torch.distributed.device_mesh import init_device_mesh

            sizes = (self.layout.pipeline_parallel, self.layout.data_parallel, self.layout.tensor_parallel)
            self.pipeline_mesh = init_device_mesh(
                self.root_device.type, sizes, mesh_dim_names=("pipeline_parallel", "data_parallel", "tensor_parallel")
            )

    def parallelize(self, module: nn.Module) -> None:
        if not self.pipelined:
            return self.parallelize_whole(module)
        from torch.distributed import pipelining

        net, mesh = pipelined_net(module), self.device_mesh["pipeline_parallel"]
        size, rank = mesh.size(), mesh.get_local_rank()
        count = size * self.stages_per_rank
        bounds = balanced_stages(list(net), count)
        check_ties(net, bounds, self.strategy_name)
        mine = [s for s in range(count) if s % size == rank]
        owned = {i for s in mine for i in range(*bounds[s])}
        modules = [nn.Sequential(*(net[i] for i in range(*bounds[s]))) for s in mine]
        for i in range(len(net)):
            if i not in owned:
                net[i] = nn.Identity()  # names of the owned layers are kept: net.<i>.<...>
        for stage in modules:
            self.parallelize_stage(stage)
        group = mesh.get_group()
        stages = [pipelining.PipelineStage(m, s, count, self.root_device, group=group) for m, s in zip(modules, mine)]
        self.is_first, self.is_last = 0 in mine, count - 1 in mine
        self.output_source = (count - 1) % size * (self.layout.world // size)  # pipeline 0: ranks 0, W/P, 2W/P...
        if hasattr(self.precision_plugin, "pipeline_group"):  # clipping: the stages' norms add up over the pipeline
            self.precision_plugin.pipeline_group = group
        schedule = getattr(pipelining, PIPELINE_SCHEDULES[self.schedule_name])
        self.schedule = schedule(
            stages if self.stages_per_rank > 1 else stages[0],
            n_microbatches=self.microbatches,
            loss_fn=self._loss,
            scale_grads=False,
        )

    def _loss(self, output, target):
        """A micro-batch's share of the optimizer step's loss, times the fp16 loss scale where there is one (the
        backward starts here, not in Lightning's precision plugin)."""
        shares = self.microbatches * self.lightning_module.trainer.accumulate_grad_batches
        loss = self.lightning_module.criterion(output, target) / shares
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler.scale(loss) if scaler is not None else loss

    def _inputs(self, images):
        return (images,) if self.is_first else ()

    # The steps take what Lightning passes: `batch_idx` only where the module's step takes one (its
    # is_param_in_hook_signature rule), and hand the module's step exactly that.
    def training_step(self, batch, *args, **kwargs):
        if not self.pipelined:
            return super().training_step(batch, *args, **kwargs)
        images, labels = batch
        trainer = self.lightning_module.trainer
        parameters = list(self.lightning_module.parameters())
        if (
            trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0
        ):  # a new optimizer step: the schedule adds to .grad
            for parameter in parameters:
                parameter.grad = None
        with self.precision_plugin.train_step_context():
            output = self.schedule.step(*self._inputs(images), target=labels if self.is_last else None)
            # Lightning zeroes gradients between training_step and backward (where a training_step only did the
            # forward): the schedule's are set aside here and put back in `backward`.
            self.gradients = [parameter.grad for parameter in parameters]
            for parameter in parameters:
                parameter.grad = None
            if is_logging_step(trainer):  # rank 0 writes this step's logs: it needs the first pipeline's output
                mine = self.global_rank == self.output_source
                shared = self.broadcast(output.detach().cpu() if mine else None, src=self.output_source)
                if self.is_global_zero and not self.is_last:
                    return self._with_output(shared.to(self.root_device), "training_step", batch, *args, **kwargs)
            if self.is_last:
                return self._with_output(output.detach().to(self.root_device), "training_step", batch, *args, **kwargs)
        return torch.zeros((), device=self.root_device)  # this stage has no loss; its backward is done

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        if not self.pipelined:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        self.precision_plugin.pre_backward(closure_loss, module)  # the hooks around backward, as in every mode
        for parameter, gradient in zip(module.parameters(), self.gradients):
            parameter.grad = gradient  # the schedule ran backward, micro-batch by micro-batch
        if steps_optimizer(module.trainer):
            self.reduce_gradients()
        self.precision_plugin.post_backward(closure_loss, module)
        return closure_loss

    def validation_step(self, batch, *args, **kwargs):
        if not self.pipelined:
            return super().validation_step(batch, *args, **kwargs)
        return self._evaluate("validation_step", batch, *args, **kwargs)

    def test_step(self, batch, *args, **kwargs):
        if not self.pipelined:
            return super().test_step(batch, *args, **kwargs)
        return self._evaluate("test_step", batch, *args, **kwargs)

    def _evaluate(self, hook: str, batch, *args, **kwargs):
        images, labels = batch
        rows = len(labels)
        if not self.batch_rows:  # the batch the stages are shaped for: this pipeline's share of the global batch
            global_batch = getattr(self.lightning_module.trainer.datamodule, "batch_size", None)
            self.batch_rows = per_process_batch(global_batch, self.layout.data_parallel) if global_batch else rows
        padded = [images, labels]
        if rows < self.batch_rows:  # the last, smaller batch: padded for the stages, cut off again below
            padded = [torch.cat([t, t[-1:].expand(self.batch_rows - rows, *t.shape[1:])]) for t in padded]
        with torch.inference_mode(False), torch.no_grad(), self.precision_plugin.val_step_context():
            # the schedule computes the loss of the last stage's micro-batches in eval too: it needs the targets
            output = self.schedule.eval(*self._inputs(padded[0]), target=padded[1] if self.is_last else None)
            if self.output_tail is None:  # once: a last stage tells the others the shape of an output
                mine = self.global_rank == self.output_source
                self.output_tail = self.broadcast(tuple(output.shape[1:]) if mine else None, self.output_source)
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
        state = super().optimizer_state(optimizer)
        return self._per_stage(state) if self.pipelined else state

    def _per_stage(self, state: dict) -> dict:
        """Parameter groups per pipeline rank (torch.distributed.checkpoint keeps one copy of what is not a tensor)."""
        rank = self.device_mesh["pipeline_parallel"].get_local_rank()
        return {"state": state["state"], f"param_groups_of_stage{rank}": state["param_groups"]}

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Each process reads its stages' weights (by name, whatever the cut that saved them) and optimizer state
        (same cut only: checked before launch); returns the rest of the checkpoint."""
        with reading(checkpoint_path):
            return self._load_stages(checkpoint_path)

    def _load_stages(self, checkpoint_path) -> dict:
        if not self.pipelined:
            return super().load_checkpoint(checkpoint_path, weights_only=True)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if path.is_file():  # one file of the whole model (another strategy's): each process takes its stages'
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
                raise UserError(
                    f"ckpt_path={path}: a pipeline resumes from its own sharded checkpoint (evaluating"
                    " this one works: train=false)"
                )
            saved = torch.load(path, map_location="cpu", weights_only=True)
            weights = saved.pop("state_dict")
            mine = {name: weights[name] for name in get_model_state_dict(self.model)}
            set_model_state_dict(self.model, mine, options=StateDictOptions(full_state_dict=True))
            return saved
        weights = {"state_dict": get_model_state_dict(self.model)}
        read_sharded(weights, path)
        set_model_state_dict(self.model, weights["state_dict"])
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING  # testing: fit's optimizers linger
        rank = self.device_mesh["pipeline_parallel"].get_local_rank()
        for index, optimizer in enumerate(self.optimizers if fitting else []):
            state = {f"optimizer_{index}": self._per_stage(get_optimizer_state_dict(self.model, optimizer))}
            read_sharded(state, path)
            mine = state[f"optimizer_{index}"]
            mine = {"state": mine["state"], "param_groups": mine[f"param_groups_of_stage{rank}"]}
            set_optimizer_state_dict(self.model, optimizer, mine, options=StateDictOptions(cpu_offload=True))
        return torch.load(path / "meta.pt", weights_only=True)

    def full_state_dict(self) -> dict:
        """The plain net's full state dict, gathered from every stage on rank 0 (empty elsewhere)."""
        if not self.pipelined:
            return super().full_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        stage = get_model_state_dict(self.lightning_module, options=StateDictOptions(full_state_dict=True))
        mine = {k: v.detach().cpu() for k, v in stage.items()}
        parts = [None] * self.world_size if self.is_global_zero else None
        dist.gather_object(mine, parts, dst=0)
        return {k: v for part in parts for k, v in part.items()} if self.is_global_zero else {}
