"""ImageNet-shaped random images, for throughput runs: a pool of uint8 images made once from the seed, sample i being
pool image i % pool with its own label, fetched a batch at a time. `data.on_device=true`: the pool lives on the compute
device and the loader yields indices only, so neither loader nor copy is what a run measures."""

import torch
from lightning.pytorch.trainer.states import RunningStage

from mynet.data.in_memory import random_images
from starter.data.base import ShardedDataModule


class SyntheticDataModule(ShardedDataModule):
    split_by = ("seed",)  # what draws its split (starter/checkpointing/data_split.py)

    def __init__(
        self,
        batch_size: int = 64,
        train_size: int = 2048,
        eval_size: int = 256,
        seed: int = 42,
        on_device: bool = False,
        **kw,
    ):
        super().__init__(batch_size=batch_size, seed=seed, **kw)
        self.train_size, self.eval_size, self.on_device = int(train_size), int(eval_size), bool(on_device)
        self._device_pools: dict[str, torch.Tensor] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        shape, classes = self.image_shape, self.num_classes
        self.train_set = random_images(self.train_size, shape, classes, self.seed)
        self.val_set = random_images(self.eval_size, shape, classes, self.seed + 1)
        self.test_set = random_images(self.eval_size, shape, classes, self.seed + 2)
        for dataset in (self.train_set, self.val_set, self.test_set):
            dataset.indices_only = self.on_device

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        if not self.on_device:
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        split = {RunningStage.TRAINING: "train", RunningStage.TESTING: "test"}.get(self.trainer.state.stage, "val")
        if split not in self._device_pools:  # once per split: the pool's copy to the device
            self._device_pools[split] = getattr(self, f"{split}_set").images.to(device)
        slots, labels = batch
        return self._device_pools[split][slots.to(device, non_blocking=True)], labels.to(device, non_blocking=True)
