"""An exponential moving average of the weights (`callbacks.weight_averaging.decay`), torchvision's `--model-ema`:
Lightning's EMAWeightAveraging (validation with the average, saved as the checkpoint's `state_dict`, copied into the
model at the end) with two changes. A checkpoint is evaluated on its averaged weights (Lightning's loads the raw ones:
the test after fit would evaluate weights neither best.ckpt nor model.pt holds), and the update is one multi-tensor lerp
with the count on the host (torch's AveragedModel syncs the host twice a step). As in torchvision, the average restarts
from the weights during the warm-up epochs.
"""

import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn


def weight_averaging(decay: float | None, warmup_epochs: float = 0) -> "AveragedWeights | None":
    """The callback for `decay` (conf/callbacks/base/every_run.yaml); None when it is null (no averaging)."""
    return None if decay is None else AveragedWeights(float(decay), int(warmup_epochs or 0))


class AveragedWeights(EMAWeightAveraging):
    def __init__(self, decay: float, warmup_epochs: int = 0):
        super().__init__(decay=decay)
        self.decay, self.warmup_epochs = decay, warmup_epochs
        self.updates: int | None = None  # read from the average once per fit: a resume continues its count
        self.tensors: dict[str, tuple[list, list]] = {}  # (average, current) tensor lists, made once per fit

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit":
            self.updates, self.tensors = None, {}
            self._average_model.update_parameters = self.update_without_sync

    def update_without_sync(self, model) -> None:
        """`model`: the LightningModule being trained."""
        average = self._average_model
        if self.updates is None:
            self.updates = int(average.n_averaged)
            self.tensors = self._paired_tensors(model)
        if self.updates == 0 or model.trainer.current_epoch < self.warmup_epochs:  # (re)start from the weights
            torch._foreach_copy_(*self.tensors["all"])
        else:
            torch._foreach_lerp_(*self.tensors["floating"], 1 - self.decay)
            if self.tensors["integer"][0]:  # integer buffers (BatchNorm's batch count) take the current value
                torch._foreach_copy_(*self.tensors["integer"])
        average.n_averaged += 1  # on the device, not read
        self.updates += 1

    def _paired_tensors(self, model) -> dict[str, tuple[list, list]]:
        """The average's tensors and the model's (all, floating point, integer), the same objects for a whole fit."""
        average = self._average_model
        pairs = list(zip(average.module.parameters(), model.parameters()))
        if average.use_buffers:
            pairs += zip(average.module.buffers(), model.buffers())

        def lists(chosen) -> tuple[list, list]:
            return [a.detach() for a, _ in chosen], [c.detach() for _, c in chosen]

        floating = [(a, c) for a, c in pairs if a.is_floating_point()]
        integer = [(a, c) for a, c in pairs if not a.is_floating_point()]
        return {"all": lists(pairs), "floating": lists(floating), "integer": lists(integer)}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # a resume: the raw weights train on, the average goes on
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
