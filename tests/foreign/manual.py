"""A module with manual optimization and two optimizers (the body with SGD, the head with Adam) whose batches are
dicts and which logs no `val/*` metric (`valid_acc`), and a DataModule with no key at all: its batch size is its
own, 50 a process."""

import torch
import torch.nn.functional as F
from lightning import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset


class DigitDicts(Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"image": self.images[index], "label": self.labels[index]}


class DictDigits(LightningDataModule):
    def setup(self, stage=None):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.data, dtype=torch.float32) / 16
        labels = torch.tensor(digits.target)
        self.train, self.val = (
            DigitDicts(images[:1000], labels[:1000]),
            DigitDicts(images[1000:1400], labels[1000:1400]),
        )
        self.test = DigitDicts(images[1400:], labels[1400:])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=50, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=50)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=50)


class TwoOptimizers(LightningModule):
    def __init__(self, body_lr: float = 0.1, head_lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.body = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        body_optimizer, head_optimizer = self.optimizers()
        loss = F.cross_entropy(self(batch["image"]), batch["label"])
        body_optimizer.zero_grad()
        head_optimizer.zero_grad()
        self.manual_backward(loss)
        body_optimizer.step()
        head_optimizer.step()
        self.log("train_loss", loss, prog_bar=True)

    def validation_step(self, batch, batch_idx):
        accuracy = (self(batch["image"]).argmax(dim=1) == batch["label"]).float().mean()
        self.log("valid_acc", accuracy, sync_dist=True)

    def test_step(self, batch, batch_idx):
        accuracy = (self(batch["image"]).argmax(dim=1) == batch["label"]).float().mean()
        self.log("test_acc", accuracy, sync_dist=True)

    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.body.parameters(), lr=self.hparams.body_lr),
            torch.optim.Adam(self.head.parameters(), lr=self.hparams.head_lr),
        ]
