"""An ImageFolder tree (root/train/<class>/*, root/val/<class>/*) with torchvision's reference ImageNet augmentation:
RandomResizedCrop, flip, optionally auto-augment and random erasing; val (also the test split) resized to 256/224 of the
crop and centre-cropped. uint8 out; normalised on the device (data/base.py). ImageNet's archives become such a tree once
with data/imagenet_archives.py."""

import logging
from functools import partial
from pathlib import Path

from starter.data.base import ShardedDataModule
from starter.data.device_decode import check_decode, collate_encoded, decode_batch, read_encoded
from starter.data.image_files import ImageFiles, evaluation_transform, load_image
from starter.data.imagenet_archives import COMMAND, needs_preparing
from starter.errors import UserError

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
log = logging.getLogger(__name__)


def imagenet_transforms(
    train: bool,
    train_crop_size: int,
    val_resize_size: int,
    val_crop_size: int,
    auto_augment: str | None = None,
    random_erase: float = 0.0,
):
    """uint8 image -> uint8 crop, as torchvision's recipe builds it; random erasing fills with the mean colour (the
    recipe's zero after normalisation, which happens on the device)."""
    from torchvision.transforms import v2

    if not train:
        return evaluation_transform(val_resize_size, val_crop_size)
    steps = [v2.RandomResizedCrop(train_crop_size, antialias=True), v2.RandomHorizontalFlip()]
    policies = {
        "ta_wide": v2.TrivialAugmentWide,
        "ra": v2.RandAugment,
        "imagenet": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET),
    }
    if auto_augment is not None:
        if auto_augment not in policies:
            raise UserError(f"data.auto_augment={auto_augment}: choose one of {', '.join(policies)} or null")
        steps.append(policies[auto_augment]())
    if random_erase > 0:
        steps.append(v2.RandomErasing(p=random_erase, value=[round(255 * m) for m in IMAGENET_MEAN]))
    return v2.Compose(steps)


class ImageFolderDataModule(ShardedDataModule):
    def __init__(
        self,
        root: str,
        batch_size: int = 256,
        num_workers: int = 8,
        seed: int = 42,
        skip_unreadable: bool = False,
        train_crop_size: int | None = None,
        val_resize_size: int | None = None,
        val_crop_size: int | None = None,
        auto_augment: str | None = None,
        random_erase: float = 0.0,
        decode: str = "cpu",
        **kwargs,
    ):
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed, **kwargs)
        self.decode = check_decode(decode)
        self.pin_memory = self.pin_memory and self.decode == "cpu"  # decode=gpu: the decoder reads host memory
        self.root, self.skip_unreadable = Path(root), bool(skip_unreadable)
        self.train_crop_size = int(train_crop_size or self.image_shape[-1])
        self.val_crop_size = int(val_crop_size or self.image_shape[-1])
        self.val_resize_size = int(val_resize_size or round(self.val_crop_size * 256 / 224))
        self.auto_augment, self.random_erase = auto_augment, float(random_erase)
        if self.image_shape[0] == 3:
            self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD
        self.eval_resize, self.eval_crop = self.val_resize_size, self.val_crop_size
        self._device_recipes = {}  # decode=gpu: training and evaluation's, made once

    def unreadable_images(self) -> list[str]:
        """The images this process has skipped so far (with skip_unreadable; val is also the test split)."""
        return [path for split in (self.train_set, self.val_set) if split is not None for path in split.skipped()]

    def teardown(self, stage: str) -> None:
        if skipped := self.unreadable_images():
            where = f" by rank {self.trainer.global_rank}" if self.trainer and self.trainer.world_size > 1 else ""
            log.warning("%d unreadable image(s) skipped%s (data.skip_unreadable=true)", len(skipped), where)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if reason := needs_preparing(self.root):
            raise UserError(f"{reason}; prepare it once with: {COMMAND} {self.root}")
        train, val = self._folder("train", train=True), self._folder("val", train=False)
        if train.classes != val.classes:
            only_train = sorted(set(train.classes) - set(val.classes))
            only_val = sorted(set(val.classes) - set(train.classes))
            raise UserError(
                f"class folders of {self.root}/train and {self.root}/val differ: only in train"
                f" {only_train}, only in val {only_val}; every class needs a folder in both"
            )
        if len(train.classes) != self.num_classes:
            raise UserError(
                f"{self.root}/train has {len(train.classes)} class folders but data.num_classes="
                f"{self.num_classes}; set data.num_classes={len(train.classes)}"
            )
        self.train_set, self.val_set, self.test_set = train, val, val
        self.classes = train.classes

    def recipe(self, train: bool):
        """torchvision's recipe for a training or an evaluation image (uint8 in, uint8 out)."""
        return imagenet_transforms(
            train, self.train_crop_size, self.val_resize_size, self.val_crop_size, self.auto_augment, self.random_erase
        )

    def transfer_batch_to_device(self, batch, device, dataloader_idx: int):
        if self.decode == "cpu":
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        encoded, labels = batch  # the encoded images stay on the host: the decoder reads them there
        return encoded, labels.to(device, non_blocking=True)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if self.decode == "gpu":
            encoded, labels = batch
            training = self.trainer is not None and self.trainer.training
            if training not in self._device_recipes:
                self._device_recipes[training] = self.recipe(training)
            batch = decode_batch(encoded, labels.device, self.image_shape[0], self._device_recipes[training]), labels
        return super().on_after_batch_transfer(batch, dataloader_idx)

    def _folder(self, split: str, train: bool):
        directory = self.root / split
        if not directory.is_dir():
            raise UserError(
                f"no directory {directory}: data=imagenet expects {self.root}/train/<class>/*.JPEG and"
                f" {self.root}/val/<class>/*.JPEG; point data.root at such a tree"
            )
        loader = partial(load_image, mode="RGB" if self.image_shape[0] == 3 else "L")
        on_host = self.decode == "cpu"  # else the loader workers only read the files' bytes
        try:
            if on_host:
                return ImageFiles(directory, self.recipe(train), loader, self.skip_unreadable)
            return ImageFiles(directory, None, read_encoded, self.skip_unreadable, collate_encoded)
        except FileNotFoundError as err:  # a class folder without images, or no class folders at all
            raise UserError(f"{directory}: {err}") from err
