"""`tf32`: float32 matmuls and convolutions on TF32 tensor cores (Ampere and later), or strictly float32. Process-wide
settings, applied where Lightning sets each process up: ddp_spawn's fresh interpreters would otherwise train in strict
float32."""

import lightning as L
import torch


class TF32(L.Callback):
    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.strategy.root_device.type == "cuda":  # on CPU "high" could let oneDNN use bf16 arithmetic
            torch.set_float32_matmul_precision("high" if self.enabled else "highest")
            torch.backends.cudnn.allow_tf32 = self.enabled
