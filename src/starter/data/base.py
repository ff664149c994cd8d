"""What every DataModule here shares: a global batch size, and sharding that is the same for any world size. One seeded
permutation per epoch of which data-parallel rank r takes every N-th index, so the ranks' batches at step k make up the
single-process batch k; evaluation unpadded, so metrics sync exact totals; mid-epoch resume (resumable.py). Images
travel as uint8 (a quarter of float32's bytes) and are normalised on the compute device: `(x / value_range - mean) /
std`, per channel.
"""

from functools import partial

import lightning as L
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from starter.data.repeated_augmentation import RepeatedAugmentationSampler
from starter.data.resumable import ResumableBatches, ResumableLoader
from starter.data.worker_seed import seed_worker
from starter.errors import UserError
from starter.topology import data_parallel_place, per_process_batch


class ShardedDataModule(L.LightningDataModule):
    # What this starter reads to run a DataModule this way (any DataModule may declare it): `batch_size` is global,
    # and its loaders shard the data themselves, so no sampler of Lightning's is put in (preflight.py, run.py).
    shards_itself = True
    # Its arguments that draw which samples are test (and validation) samples: a checkpoint is continued or evaluated
    # on the split it was trained on (checkpointing/data_split.py).
    split_by: tuple[str, ...] = ()

    def __init__(
        self,
        batch_size: int,
        image_shape: list[int],
        num_classes: int,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = True,
        persistent_workers: bool = False,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        ra_reps: int = 0,
    ):
        super().__init__()
        self.batch_size, self.image_shape, self.num_classes = int(batch_size), tuple(image_shape), int(num_classes)
        self.seed, self.num_workers, self.pin_memory = int(seed), int(num_workers), bool(pin_memory)
        self.persistent_workers = bool(persistent_workers) and self.num_workers > 0
        # What normalise() applies to uint8 images; each data set sets its own (value_range: x's full scale).
        self.value_range, self.mean, self.std = 255.0, (0.5,) * self.image_shape[0], (0.5,) * self.image_shape[0]
        self.classes = [str(i) for i in range(self.num_classes)]  # the class names, where a data set has them
        self.eval_resize = self.eval_crop = None  # evaluation's resize and centre crop; None: resized to image_shape
        self._statistics: list[torch.Tensor] | None = None
        self.mix = batch_mixing(float(mixup_alpha), float(cutmix_alpha), self.num_classes)
        self.ra_reps = int(ra_reps)  # repeated augmentation: each image this many times an epoch (0: off)
        self.train_set = self.val_set = self.test_set = None  # each a Dataset once set up

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, "train")

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, "val")

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, "test")

    def _loader(self, dataset: Dataset, split: str) -> DataLoader:
        world, rank = data_parallel_place(self.trainer)
        if len(dataset) == 0:
            raise UserError(f"the {split} split is empty; give it samples (for digits: data.split)")
        if len(dataset) < world:
            raise UserError(f"the {split} split has {len(dataset)} samples, fewer than the {world} processes")
        batch_size = per_process_batch(self.batch_size, world)
        # collate_fn: a data set may batch itself (TensorPairs). Pinned host memory: a copy from pageable memory would
        # wait for the GPU's queued work every step.
        # A generator of the loader's own: its iterators draw their workers' seeds from it, not from the process's
        # generators (which dropout draws from, and a resume restores: callbacks/random_state.py).
        options = dict(
            collate_fn=getattr(dataset, "collate_fn", None),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and self._feeds_cuda(),
            persistent_workers=self.persistent_workers,
            generator=torch.Generator().manual_seed(self.seed),
        )
        if self.num_workers:  # workers seeded by the data-parallel place (worker_seed.py), forked from this
            # process's fork server, never from this threaded process; it imports what the workers unpickle
            from starter.fork_server import fork_server

            unpickled_from = (type(dataset).__module__, seed_worker.__module__)
            options |= dict(
                worker_init_fn=partial(seed_worker, rank=rank), multiprocessing_context=fork_server(unpickled_from)
            )
        if split == "train":
            if self.ra_reps > 0:
                sampler = RepeatedAugmentationSampler(dataset, world, rank, self.ra_reps, seed=self.seed)
            else:
                sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=self.seed, drop_last=True)
            if len(sampler) < batch_size:  # whole batches only: not one step would run, and nothing would say so
                most = len(sampler) * world
                raise UserError(
                    f"the train split's {len(dataset)} samples make no whole batch of data.batch_size="
                    f"{self.batch_size}; use data.batch_size={most} or less"
                )
            batches = ResumableBatches(sampler, batch_size, drop_last=True)
            return ResumableLoader(
                dataset, batch_sampler=batches, progress=self._training_progress, epoch=self._epoch, **options
            )
        sampler = UnrepeatedDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(dataset, sampler=sampler, batch_size=batch_size, **options)  # Lightning's predict keeps it

    def _feeds_cuda(self) -> bool:
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)  # None: no trainer yet
        return device.type == "cuda" if device is not None else torch.cuda.is_available()

    def _training_progress(self) -> tuple[int, int]:
        """(batches trained in this epoch, batches an epoch trains), for resuming mid-epoch."""
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed, self.trainer.num_training_batches

    def _epoch(self) -> int:
        return getattr(self.trainer, "current_epoch", 0)  # 0 without a trainer

    def inference(self) -> dict:
        """What predicting from raw images needs, saved with the weights (checkpointing/inference.py)."""
        return {
            "image_shape": list(self.image_shape),
            "value_range": float(self.value_range),
            "mean": list(self.mean),
            "std": list(self.std),
            "classes": list(self.classes),
            "resize": self.eval_resize,
            "crop": self.eval_crop,
        }

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float32, zero mean and unit variance per channel, on the device they are on."""
        if self._statistics is None or self._statistics[0].device != images.device:  # once: a copy to the device
            shape = (1, -1) + (1,) * (images.dim() - 2)
            self._statistics = [torch.tensor(v).view(shape).to(images.device) for v in (self.mean, self.std)]
        mean, std = self._statistics
        return (images.float() / self.value_range - mean) / std

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        images, labels = batch
        normalised = images.dtype == torch.uint8
        if normalised:
            images = self.normalise(images)
        if self.mix is not None and self.trainer is not None and self.trainer.training:
            with torch.random.fork_rng(devices=[]):  # drawn alike by every process (a pipeline's first stage mixes
                # the images, its last the labels), whatever else each has drawn from the global generator
                torch.manual_seed(self.seed * 1_000_003 + self.trainer.fit_loop.epoch_loop.batch_progress.total.ready)
                images, labels = self.mix(images, labels)  # labels become soft targets, rows summing to 1
        if normalised and self.trainer is not None:  # the precision's input dtype (bf16-true), as for float input
            images = self.trainer.precision_plugin.convert_input(images)
        return images, labels

    def _check_shape(self, name: str, shape: tuple[int, ...], num_classes: int) -> None:
        if tuple(shape) != self.image_shape or num_classes != self.num_classes:
            config = f"data.image_shape={list(self.image_shape)} data.num_classes={self.num_classes}"
            raise UserError(
                f"{name} has images of shape {list(shape)} in {num_classes} classes, but the config says {config}"
            )


def batch_mixing(mixup_alpha: float, cutmix_alpha: float, num_classes: int):
    """torchvision's batch-level MixUp / CutMix (one of the two per batch when both are on), or None."""
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return None
    from torchvision.transforms import v2

    mixes = [v2.MixUp(alpha=mixup_alpha, num_classes=num_classes)] if mixup_alpha > 0 else []
    mixes += [v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes)] if cutmix_alpha > 0 else []
    return mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)


class ImagesToPredict(ShardedDataModule):
    """Image files to predict (predict.py), each prepared as the model's evaluation saw its data (the inference record
    its weights carry); each process its unpadded share, in the files' order."""

    def __init__(
        self, paths: list[str], inference: dict, batch_size: int, num_workers: int = 0, skip_unreadable: bool = False
    ):
        from starter.data.image_files import FilesToPredict, evaluation_transform

        shape = inference["image_shape"]
        super().__init__(batch_size, shape, len(inference["classes"]), num_workers=num_workers)
        self.value_range, self.mean, self.std = inference["value_range"], inference["mean"], inference["std"]
        transform = evaluation_transform(inference["resize"], inference["crop"], shape[1:])
        self.predict_set = FilesToPredict(paths, shape, transform, skip_unreadable)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_set, "predict")
