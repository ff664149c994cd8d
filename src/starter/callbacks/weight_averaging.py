"""An exponential moving average of the weights (`model.ema_decay`), torchvision's `--model-ema`.

Lightning's EMAWeightAveraging keeps the average beside the model, swaps it in for validation, saves it as the
checkpoint's `state_dict` (the raw weights as `current_model_state`) and copies it into the model when training
ends, so model.pt holds it too. One change: evaluating a checkpoint (the test that follows fit included) uses
its averaged weights. Lightning's callback, still holding the average from fit, would load the raw weights into
the model there, and the run would test weights that neither best.ckpt nor model.pt holds.
"""

from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn


class AveragedWeights(EMAWeightAveraging):
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if trainer.state.fn == TrainerFn.FITTING:  # a resume: the raw weights train on, the average goes on
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
