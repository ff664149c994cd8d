"""A LightningModule that trains any net with cross-entropy and reports exact loss and accuracy.

Evaluation metrics are torchmetrics objects: their states (sums and counts) are synced across processes once
per epoch, so val/test numbers are exact under any strategy, also when ranks hold unequal shards.
Only primitive hyper-parameters and tensors go into checkpoints, so they load with torch.load(weights_only=True).
"""

from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy


class Classifier(L.LightningModule):
    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
    ):
        super().__init__()
        self.net = net
        self.make_optimizer, self.make_scheduler = optimizer, scheduler
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        # self.log costs ~0.2 ms a call; the logger keeps only every log_every_n_steps-th value anyway.
        if self.trainer.global_step % self.trainer.log_every_n_steps == self.trainer.log_every_n_steps - 1:
            self.log("train/loss", loss, prog_bar=True)  # this rank's value
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_loss, self.val_acc)

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_loss, self.test_acc)

    def _evaluate(self, batch, stage: str, loss_metric: MeanMetric, acc_metric: MulticlassAccuracy) -> None:
        images, labels = batch
        logits = self(images)
        loss_metric.update(F.cross_entropy(logits.float(), labels), weight=len(labels))  # mean over samples
        acc_metric.update(logits, labels)
        self.log(f"{stage}/loss", loss_metric, prog_bar=stage == "val")
        self.log(f"{stage}/acc", acc_metric, prog_bar=stage == "val")

    def configure_optimizers(self):
        optimizer = self.make_optimizer(params=self.parameters())
        if self.make_scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.make_scheduler(optimizer)}
