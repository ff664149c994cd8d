"""LightningModules that parallelize themselves, written as Lightning's tensor-parallel and FSDP2 docs write them
(`examples/pytorch/tensor_parallel`, the ModelParallelStrategy guide): plain layers built in `__init__`, the
parallelism applied in `configure_model()` on `self.device_mesh`. The tensor-parallel one owns its loaders
(`train_dataloader()` on the module, as Lightning's examples and BoringModel do): it runs with `data=none`. Their steps
take no `batch_idx`, as those docs write them: Lightning passes a step only what its signature takes."""

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def digits() -> TensorDataset:
    from sklearn.datasets import load_digits

    loaded = load_digits()
    return TensorDataset(torch.tensor(loaded.data, dtype=torch.float32) / 16, torch.tensor(loaded.target))


class FeedForward(nn.Module):
    """Lightning's tensor-parallel example's block: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TensorParallelDigits(L.LightningModule):
    def __init__(self, hidden_dim: int = 128, lr: float = 3e-3, batch_size: int = 64):
        super().__init__()
        self.save_hyperparameters()
        self.model = FeedForward(64, hidden_dim)
        self.head = nn.Linear(64, 10)

    def configure_model(self):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        # Lightning sets up `self.device_mesh`
        tp_mesh = self.device_mesh["tensor_parallel"]
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
        parallelize_module(self.model, tp_mesh, plan)

    def forward(self, x):
        return self.head(self.model(x))

    def training_step(self, batch):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch):
        x, y = batch
        self.log("val_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(digits(), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(digits(), batch_size=self.hparams.batch_size)


class ShardedDigits(L.LightningModule):
    """An MLP whose layers FSDP2 shards over the data-parallel processes, each a unit, then the root."""

    def __init__(self, hidden_dim: int = 128, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.layers = nn.Sequential(nn.Linear(64, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 10))

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        dp_mesh = self.device_mesh["data_parallel"]
        for layer in self.layers:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=dp_mesh)
        fully_shard(self.layers, mesh=dp_mesh)

    def forward(self, x):
        return self.layers(x.flatten(1))

    def training_step(self, batch):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch):
        x, y = batch
        self.log("val/acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch):
        x, y = batch
        self.log("test/acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class DigitsWithOwnLoaders(L.LightningModule):
    """A module that owns its loaders and nothing else of note (Lightning's BoringModel's shape): data=none."""

    def __init__(self, batch_size: int = 64):
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(64, 10)

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.layer(x), y)

    def validation_step(self, batch):
        x, y = batch
        self.log("val/acc", (self.layer(x).argmax(1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch):
        x, y = batch
        self.log("test/acc", (self.layer(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(digits(), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(digits(), batch_size=self.hparams.batch_size)

    test_dataloader = val_dataloader
