"""The task the engine's tests train: cross-entropy over any net, exact evaluation metrics (sums and counts on the
device, synced once per epoch), the protocol the engine relies on (`criterion` for pipeline parallel's last stage,
`predict_step` for predict.py)."""

from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric

from starter.models.logging_step import is_logging_step


class SampleMean(Metric):
    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        self.total += values.double().sum()
        self.count += values.numel()

    def compute(self) -> torch.Tensor:
        return (self.total / self.count).float()


class Classifier(L.LightningModule):
    def __init__(self, net: nn.Module, num_classes: int, optimizer: Callable, scheduler: Callable | None = None,
                 label_smoothing: float = 0.0):  # fmt: skip
        super().__init__()
        self.net, self.make_optimizer, self.make_scheduler = net, optimizer, scheduler
        self.label_smoothing = float(label_smoothing)
        self.top5 = num_classes > 5
        self.metrics = nn.ModuleDict({f"{stage}_{name}": SampleMean() for stage in ("val", "test")
                                      for name in ("loss", "acc", "acc_top5")})  # fmt: skip

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def criterion(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = self.criterion(logits, labels)
        if is_logging_step(self.trainer):  # no host sync at the other steps
            self.log("train/loss", loss)
            hard = labels if labels.dim() == 1 else labels.argmax(dim=-1)
            self.log("train/acc", (logits.detach().argmax(dim=-1) == hard).float().mean())
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).float().softmax(dim=-1)

    def _evaluate(self, batch, stage: str) -> None:
        images, labels = batch
        logits = self(images)
        values = {"loss": F.cross_entropy(logits.float(), labels, reduction="none"),
                  "acc": logits.argmax(dim=-1) == labels}  # fmt: skip
        if self.top5:
            values["acc_top5"] = (logits.topk(5, dim=-1).indices == labels[:, None]).any(dim=-1)
        for name, value in values.items():
            metric = self.metrics[f"{stage}_{name}"]
            metric.update(value)
            self.log(f"{stage}/{name}", metric, prog_bar=stage == "val" and name != "acc_top5")

    def configure_optimizers(self):
        optimizer = self.make_optimizer(params=self.parameters())
        if self.make_scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.make_scheduler(optimizer)}
