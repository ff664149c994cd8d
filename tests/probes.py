"""Callbacks that tests add to a run (`+callbacks.x._target_=probes.X`); importable by every process of the run
because the tests put this folder on PYTHONPATH."""

import json
import os
import signal
from pathlib import Path

import lightning as L


class SigtermAtStep(L.Callback):
    """Sends SIGTERM to this process after training step `step`, as a scheduler's preemption would."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class RecordCompiledGraphs(L.Callback):
    """Writes `<output>/rank<r>.json`: the graphs torch.compile made in this process by the end of training."""

    def __init__(self, output: str):
        self.output = Path(output)

    def on_train_end(self, trainer, pl_module) -> None:
        from torch._dynamo.utils import counters

        self.output.mkdir(parents=True, exist_ok=True)
        figures = {"pid": os.getpid(), "parent": os.getppid(), "graphs": counters["stats"]["unique_graphs"]}
        (self.output / f"rank{trainer.global_rank}.json").write_text(json.dumps(figures))


class RecordConvInputLayout(L.Callback):
    """Writes `<output>/rank<r>.txt`: the memory format of the last Conv2d's input in a training step (the
    first one's input may have one channel, for which both formats are the same)."""

    def __init__(self, output: str):
        self.output = Path(output)
        self.hook = None

    def on_train_start(self, trainer, pl_module) -> None:
        import torch

        def record(module, args):
            layout = "channels_last" if args[0].is_contiguous(memory_format=torch.channels_last) else "contiguous"
            self.output.mkdir(parents=True, exist_ok=True)
            (self.output / f"rank{trainer.global_rank}.txt").write_text(layout)
            self.hook.remove()

        conv = [m for m in pl_module.modules() if isinstance(m, torch.nn.Conv2d)][-1]
        self.hook = conv.register_forward_pre_hook(record)


class NanWeightsAtStep(L.Callback):
    """Fills the weights with NaN before training step `step`: its loss is the first that is not finite."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            import torch

            with torch.no_grad():
                for parameter in pl_module.parameters():
                    parameter.fill_(float("nan"))


class RecordShardFractions(L.Callback):
    """Writes `<output>/rank<r>.json`: for each DTensor parameter, the fraction of its elements this rank holds."""

    def __init__(self, output: str):
        self.output = Path(output)

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.tensor import DTensor

        fractions = {name: p.to_local().numel() / p.numel() for name, p in pl_module.named_parameters()
                     if isinstance(p, DTensor)}  # fmt: skip
        self.output.mkdir(parents=True, exist_ok=True)
        (self.output / f"rank{trainer.global_rank}.json").write_text(json.dumps(fractions))


class RecordLearningRates(L.Callback):
    """Writes `<output>`: the learning rate each optimizer step ran with (read inside the step)."""

    def __init__(self, output: str):
        self.output, self.rates = Path(output), []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.rates.append(optimizer.param_groups[0]["lr"])

    def on_train_end(self, trainer, pl_module) -> None:
        self.output.write_text(json.dumps(self.rates))
