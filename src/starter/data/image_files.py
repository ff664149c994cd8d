"""Image files as a data set: each decoded to a uint8 tensor, an unreadable one named in its error (or skipped and
counted). torch, torchvision and PIL only: loader workers unpickle it in a fork server without Lightning."""

import logging
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset, default_collate
from torchvision.datasets import ImageFolder

from starter.errors import UserError

log = logging.getLogger(__name__)


def load_image(path: str, mode: str = "RGB") -> torch.Tensor:
    """The image file as a uint8 CxHxW tensor (decode_image_data); one that cannot be read is a UserError naming it."""
    try:
        return decode_image_data(path, mode)
    except ValueError as err:
        raise UserError(f"cannot read image {path}: {err}") from err


def decode_image_data(source: str | bytes | torch.Tensor, mode: str = "RGB") -> torch.Tensor:
    """An image file (its path) or its encoded bytes (or a 1-D uint8 tensor of them) as a uint8 CxHxW tensor: JPEG,
    PNG, WebP and GIF decoded by torchvision (1.4x PIL's images/s, benchmarks/data_paths.py), other formats by PIL; no
    image: ValueError, saying why."""
    import io

    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2.functional import pil_to_tensor

    if isinstance(source, bytes):
        source = torch.frombuffer(bytearray(source), dtype=torch.uint8)
    try:
        return decode_image(source, mode=ImageReadMode.RGB if mode == "RGB" else ImageReadMode.GRAY)
    except RuntimeError as err:  # "<function>, <source>:<line>, <reason>"
        if "Unsupported image file" not in str(err):
            raise ValueError(str(err).split(", ")[-1]) from err
    try:
        with Image.open(source if isinstance(source, str) else io.BytesIO(source.numpy().tobytes())) as image:
            return pil_to_tensor(image.convert(mode))
    except (OSError, SyntaxError, ValueError) as err:  # PIL's errors for truncated / non-image files
        raise ValueError(str(err)) from err


def evaluation_transform(resize: int | None, crop: int | None, size: list[int] | None = None):
    """uint8 image -> uint8 crop as evaluation sees it: resized (shorter side) and centre-cropped, or, without a crop,
    resized to `size` (H, W) (an image of that size stays as it is)."""
    from torchvision.transforms import v2

    if crop is not None:
        return v2.Compose([v2.Resize(resize, antialias=True), v2.CenterCrop(crop)])
    return v2.Resize(list(size), antialias=True)


class ImageFiles(ImageFolder):
    """ImageFolder that, with skip_unreadable, leaves unreadable images out of their batch and counts them."""

    def __init__(self, directory: Path, transform, loader, skip_unreadable: bool, collate=default_collate):
        super().__init__(str(directory), transform=transform, loader=loader)
        self.collate = collate  # default_collate; data.decode=gpu's keeps the encoded images, of many lengths
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
        return self.collate(readable)

    def skipped(self) -> list[str]:
        return [] if self.unreadable is None else [self.samples[int(i)][0] for i in self.unreadable.nonzero()]


class FilesToPredict(Dataset):
    """Image files in a given order, each as evaluation sees it, with its place in that order; with
    `skip_unreadable`, an unreadable one is left out of its batch with a warning naming it."""

    def __init__(self, paths: list[str], image_shape: list[int], transform, skip_unreadable: bool):
        self.paths, self.image_shape, self.transform = paths, list(image_shape), transform
        self.mode, self.skip_unreadable = ("RGB" if image_shape[0] == 3 else "L"), skip_unreadable

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        try:
            return self.transform(load_image(self.paths[index], self.mode)), index
        except UserError as err:
            if not self.skip_unreadable:
                raise
            log.warning("skipping it (skip_unreadable=true): %s", err)
            return None

    def collate_fn(self, samples):
        readable = [s for s in samples if s is not None]
        if readable:
            return default_collate(readable)
        return torch.empty(0, *self.image_shape, dtype=torch.uint8), torch.empty(0, dtype=torch.long)
