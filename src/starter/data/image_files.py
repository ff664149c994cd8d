"""Image files as a data set: each image decoded to a uint8 tensor, an unreadable one named in its error (or left
out of its batch, and counted). torch, torchvision and PIL only: loader workers unpickle it in a fork server that
imports this module, not Lightning."""

import logging
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision.datasets import ImageFolder

from starter.errors import UserError

log = logging.getLogger(__name__)


def load_image(path: str, mode: str = "RGB") -> torch.Tensor:
    """The image as a uint8 CxHxW tensor. JPEG, PNG, WebP and GIF are decoded by torchvision straight into a
    tensor (1.4x the images/s of PIL per loader worker with the crop done on the tensor, benchmarks/data_paths.py);
    other formats by PIL."""
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2.functional import pil_to_tensor

    try:
        return decode_image(path, mode=ImageReadMode.RGB if mode == "RGB" else ImageReadMode.GRAY)
    except RuntimeError as err:  # "<function>, <source>:<line>, <reason>"
        if "Unsupported image file" not in str(err):
            raise UserError(f"cannot read image {path}: {str(err).split(', ')[-1]}") from err
    try:
        with Image.open(path) as image:
            return pil_to_tensor(image.convert(mode))
    except (OSError, SyntaxError, ValueError) as err:  # PIL's errors for truncated / non-image files
        raise UserError(f"cannot read image {path}: {err}") from err


class ImageFiles(ImageFolder):
    """ImageFolder that, with skip_unreadable, leaves unreadable images out of their batch and counts them."""

    def __init__(self, directory: Path, transform, loader, skip_unreadable: bool):
        super().__init__(str(directory), transform=transform, loader=loader)
        # One flag per image, in shared memory: DataLoader workers set them, this process counts them.
        self.unreadable = torch.zeros(len(self), dtype=torch.bool).share_memory_() if skip_unreadable else None

    def __getitem__(self, index: int):
        try:
            return super().__getitem__(index)
        except UserError as err:
            if self.unreadable is None:
                raise
            if not self.unreadable[index]:
                log.warning("skipping it (data.skip_unreadable=true): %s", err)
            self.unreadable[index] = True
            return None

    def collate_fn(self, samples):
        readable = [s for s in samples if s is not None]
        if not readable:
            raise UserError(f"every image of a batch in {self.root} is unreadable (the warnings above name them)")
        return default_collate(readable)

    def skipped(self) -> list[str]:
        return [] if self.unreadable is None else [self.samples[int(i)][0] for i in self.unreadable.nonzero()]
