"""A LightningModule that trains any net with cross-entropy and reports exact loss and accuracy.

Evaluation metrics are torchmetrics objects: their states (sums and counts) are synced across processes once
per epoch, so val/test numbers are exact under any strategy, also when ranks hold unequal shards (or, in a
pipeline, none). Sums and counts on the device: no per-step argument checks, each a host-device sync on a GPU.
Only primitive hyper-parameters and tensors go into checkpoints, so they load with torch.load(weights_only=True).
"""

from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric


class SampleMean(Metric):
    """The mean of per-sample values over every sample seen, from batch sums and counts (no checks, no syncs)."""

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
        self.val_loss, self.test_loss = SampleMean(), SampleMean()
        self.val_acc, self.test_acc = SampleMean(), SampleMean()  # accuracy: the mean of "the top class is right"

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = self.criterion(self(images), labels)
        # self.log costs ~0.2 ms a call; the logger keeps only every log_every_n_steps-th value anyway. Not on
        # Lightning's progress bar: it would read the value (a host sync) at every later step of the epoch.
        if self.trainer.global_step % self.trainer.log_every_n_steps == self.trainer.log_every_n_steps - 1:
            self.log("train/loss", loss)  # this rank's value
        return loss

    def criterion(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss (pipeline parallel computes it per micro-batch on the last stage)."""
        return F.cross_entropy(logits, labels)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_loss, self.val_acc)

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_loss, self.test_acc)

    def _evaluate(self, batch, stage: str, loss_metric: SampleMean, acc_metric: SampleMean) -> None:
        images, labels = batch
        logits = self(images)
        loss_metric.update(F.cross_entropy(logits.float(), labels, reduction="none"))  # mean over samples
        acc_metric.update(logits.argmax(dim=-1) == labels)
        self.log(f"{stage}/loss", loss_metric, prog_bar=stage == "val")
        self.log(f"{stage}/acc", acc_metric, prog_bar=stage == "val")

    def configure_optimizers(self):
        optimizer = self.make_optimizer(params=self.parameters())
        if self.make_scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.make_scheduler(optimizer)}
