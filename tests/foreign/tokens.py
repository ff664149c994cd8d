"""A non-image task: a small language model predicting each next token of sequences streamed by an IterableDataset,
which gives each process (and each loader worker) every N-th sequence itself, as such data sets do."""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class Sequences(IterableDataset):
    """`count` sequences of `length` tokens: a seeded random start, then each token the previous one plus 1."""

    def __init__(self, count: int, length: int, vocab: int, seed: int):
        starts = torch.randint(0, vocab, (count, 2), generator=torch.Generator().manual_seed(seed))
        steps = torch.arange(length - 2).expand(count, -1) + 1
        self.sequences = torch.cat([starts, (starts[:, 1:] + steps) % vocab], dim=1)

    def __iter__(self):
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        worker = get_worker_info()
        shard = rank * (worker.num_workers if worker else 1) + (worker.id if worker else 0)
        shards = world * (worker.num_workers if worker else 1)
        for index in range(shard, len(self.sequences), shards):
            yield self.sequences[index]


class TokenStream(LightningDataModule):
    def __init__(self, batch_size: int = 16, vocab: int = 32, length: int = 12):
        super().__init__()
        self.batch_size, self.vocab, self.length = batch_size, vocab, length

    def setup(self, stage=None):
        self.train, self.val, self.test = (
            Sequences(count, self.length, self.vocab, seed) for count, seed in ((256, 0), (64, 1), (64, 2))
        )

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=self.batch_size)


class NextToken(LightningModule):
    def __init__(self, vocab: int = 32, width: int = 32, lr: float = 3e-3, tie: bool = False):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(2 * width, width)
        self.out = nn.Linear(width, vocab)
        if tie:  # the output layer shares the embedding's weight, as GPT-2's (tie_word_embeddings)
            self.out.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        previous = F.pad(x, (0, 0, 1, 0))[:, :-1]
        return self.out(torch.relu(self.mix(torch.cat([x, previous], dim=-1))))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def training_step(self, tokens, batch_idx):
        loss = self.loss(tokens)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, tokens, batch_idx):
        self.log("val/loss", self.loss(tokens), sync_dist=True)

    def test_step(self, tokens, batch_idx):
        loss = self.loss(tokens)
        self.log("test/loss", loss, sync_dist=True)
        self.log("test/perplexity", math.e**loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
