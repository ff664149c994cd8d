"""The shape of the best-known Lightning + Hydra template's MNIST example, on scikit-learn's digits: the net and the
`_partial_` optimizer and scheduler saved with `save_hyperparameters`, ReduceLROnPlateau on `val/loss`, torchmetrics
objects logged per epoch, a DataModule that makes its own DataLoaders (shuffle=True) of a batch it divides by the
world size itself."""

import torch
from lightning import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification.accuracy import Accuracy


class SimpleDenseNet(nn.Module):
    def __init__(self, input_size: int = 64, lin1_size: int = 64, lin2_size: int = 64, output_size: int = 10):
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_size, lin1_size),
            nn.BatchNorm1d(lin1_size),
            nn.ReLU(),
            nn.Linear(lin1_size, lin2_size),
            nn.ReLU(),
            nn.Linear(lin2_size, output_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.view(x.size(0), -1))


class DigitsLitModule(LightningModule):
    def __init__(self, net: nn.Module, optimizer, scheduler, compile: bool = False):
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = net
        self.criterion = torch.nn.CrossEntropyLoss()
        self.train_acc = Accuracy(task="multiclass", num_classes=10)
        self.val_acc = Accuracy(task="multiclass", num_classes=10)
        self.test_acc = Accuracy(task="multiclass", num_classes=10)
        self.train_loss, self.val_loss, self.test_loss = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_start(self) -> None:
        self.val_loss.reset()
        self.val_acc.reset()
        self.val_acc_best.reset()

    def model_step(self, batch):
        x, y = batch
        logits = self.forward(x)
        return self.criterion(logits, y), torch.argmax(logits, dim=1), y

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, preds, targets = self.model_step(batch)
        self.train_loss(loss)
        self.train_acc(preds, targets)
        self.log("train/loss", self.train_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.test_loss(loss)
        self.test_acc(preds, targets)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True, prog_bar=True)

    def setup(self, stage: str) -> None:
        if self.hparams.compile and stage == "fit":
            self.net = torch.compile(self.net)

    def configure_optimizers(self):
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        if self.hparams.scheduler is not None:
            scheduler = self.hparams.scheduler(optimizer=optimizer)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss", "interval": "epoch", "frequency": 1},
            }
        return {"optimizer": optimizer}


class DigitsDataModule(LightningDataModule):
    def __init__(self, train_val_test_split=(1197, 300, 300), batch_size: int = 64, num_workers: int = 0,
                 pin_memory: bool = False):  # fmt: skip
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.data_train = self.data_val = self.data_test = None
        self.batch_size_per_device = batch_size

    def setup(self, stage: str | None = None) -> None:
        if self.trainer is not None:
            if self.hparams.batch_size % self.trainer.world_size != 0:
                raise RuntimeError(
                    f"Batch size ({self.hparams.batch_size}) is not divisible by the number of devices "
                    f"({self.trainer.world_size})."
                )
            self.batch_size_per_device = self.hparams.batch_size // self.trainer.world_size
        if not self.data_train and not self.data_val and not self.data_test:
            from sklearn.datasets import load_digits

            digits = load_digits()
            images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16
            dataset = TensorDataset(images, torch.tensor(digits.target))
            self.data_train, self.data_val, self.data_test = random_split(
                dataset, lengths=self.hparams.train_val_test_split, generator=torch.Generator().manual_seed(42)
            )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data_train, batch_size=self.batch_size_per_device, num_workers=self.hparams.num_workers,
                          pin_memory=self.hparams.pin_memory, shuffle=True)  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data_val, batch_size=self.batch_size_per_device, num_workers=self.hparams.num_workers,
                          pin_memory=self.hparams.pin_memory, shuffle=False)  # fmt: skip

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.data_test, batch_size=self.batch_size_per_device, num_workers=self.hparams.num_workers,
                          pin_memory=self.hparams.pin_memory, shuffle=False)  # fmt: skip
