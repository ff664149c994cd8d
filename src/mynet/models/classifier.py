"""A LightningModule that trains any net with cross-entropy and reports exact loss and accuracy: evaluation metrics are
sums and counts on the device (no host sync per step) synced once per epoch, exact under any strategy; checkpoints
hold tensors and primitives only (weights-only loads). `label_smoothing`, `norm_weight_decay` and `lr_warmup_epochs` are
torchvision's recipe's knobs; the warm-up scales the configured schedule's rate around each step only, so the schedule
(and its resume) stays the configured one.
"""

from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric

from starter.models.logging_step import is_logging_step


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
        label_smoothing: float = 0.0,
        norm_weight_decay: float | None = None,
        lr_warmup_epochs: float = 0.0,
    ):
        super().__init__()
        self.net = net
        self.make_optimizer, self.make_scheduler = optimizer, scheduler
        self.label_smoothing, self.norm_weight_decay = float(label_smoothing), norm_weight_decay
        self.lr_warmup_epochs = float(lr_warmup_epochs)
        self.val_loss, self.test_loss = SampleMean(), SampleMean()
        self.val_acc, self.test_acc = SampleMean(), SampleMean()  # accuracy: the mean of "the top class is right"
        self.top5 = num_classes > 5
        if self.top5:
            self.val_acc_top5, self.test_acc_top5 = SampleMean(), SampleMean()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = self.criterion(logits, labels)
        # self.log costs ~0.2 ms a call; the logger keeps only every log_every_n_steps-th value anyway. Not on
        # Lightning's progress bar: it would read the value (a host sync) at every later step of the epoch.
        if is_logging_step(self.trainer):
            self.log("train/loss", loss)  # this rank's value, this batch
            hard = labels if labels.dim() == 1 else labels.argmax(dim=-1)  # soft targets: their largest share
            self.log("train/acc", (logits.detach().argmax(dim=-1) == hard).float().mean())
        return loss

    def criterion(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss (pipeline parallel computes it per micro-batch on the last stage)."""
        return F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_loss, self.val_acc)

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_loss, self.test_acc)

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        """The class probabilities of a batch of images (its second element names the samples: predict.py)."""
        return self(batch[0]).float().softmax(dim=-1)

    def _evaluate(self, batch, stage: str, loss_metric: SampleMean, acc_metric: SampleMean) -> None:
        images, labels = batch
        logits = self(images)
        loss_metric.update(F.cross_entropy(logits.float(), labels, reduction="none"))  # mean over samples
        acc_metric.update(logits.argmax(dim=-1) == labels)
        self.log(f"{stage}/loss", loss_metric, prog_bar=stage == "val")
        self.log(f"{stage}/acc", acc_metric, prog_bar=stage == "val")
        if self.top5:
            top5 = getattr(self, f"{stage}_acc_top5")
            top5.update((logits.topk(5, dim=-1).indices == labels[:, None]).any(dim=-1))
            self.log(f"{stage}/acc_top5", top5)

    def configure_optimizers(self):
        optimizer = self.make_optimizer(params=self.parameter_groups())
        if self.make_scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.make_scheduler(optimizer)}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        factor = self.warmup_factor()
        if factor == 1.0:
            return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        planned = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] *= factor
        try:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        finally:  # the schedule goes on from the planned rates
            for group, lr in zip(optimizer.param_groups, planned):
                group["lr"] = lr

    def warmup_factor(self) -> float:
        """0.01 at the first optimizer step, rising linearly to 1 after lr_warmup_epochs epochs of steps."""
        if self.lr_warmup_epochs <= 0:
            return 1.0
        per_epoch = max(1, self.trainer.num_training_batches // self.trainer.accumulate_grad_batches)
        warm_steps = self.lr_warmup_epochs * per_epoch
        step = self.trainer.global_step
        return 1.0 if step >= warm_steps else 0.01 + 0.99 * step / warm_steps

    def parameter_groups(self):
        """All parameters; with norm_weight_decay (null: they decay like the rest), the norm layers' in a group of their
        own."""
        if self.norm_weight_decay is None:
            return self.parameters()
        norms = (
            nn.BatchNorm1d,
            nn.BatchNorm2d,
            nn.BatchNorm3d,
            nn.SyncBatchNorm,
            nn.InstanceNorm1d,
            nn.InstanceNorm2d,
            nn.InstanceNorm3d,
            nn.LayerNorm,
            nn.GroupNorm,
            nn.LocalResponseNorm,
        )
        norm = [p for m in self.modules() if isinstance(m, norms) for p in m.parameters(recurse=False)]
        ids = {id(p) for p in norm}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return [{"params": rest}, {"params": norm, "weight_decay": float(self.norm_weight_decay)}]
