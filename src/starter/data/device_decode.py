"""`data.decode=gpu`: the loader workers only read each image's encoded bytes; a batch's JPEGs are decoded on the
training device in one call (nvJPEG on a GPU; on a CPU, the same call there), and the recipe's crops, flips and
augmentation applied there image by image, before the batch is stacked and normalised as any other batch. The bytes
stay in host memory until decoded: torchvision's decoder reads them there."""

from functools import partial

import torch

from starter.errors import UserError, first_line

DECODES = ("cpu", "gpu")
JPEG_START = (0xFF, 0xD8, 0xFF)


def check_decode(decode: str) -> str:
    if decode not in DECODES:
        raise UserError(f"data.decode={decode}: choose cpu (loader workers decode) or gpu (the training device does)")
    return decode


def read_encoded(path: str) -> torch.Tensor:
    """An image file's bytes as a 1-D uint8 tensor (the folder's loader under decode=gpu)."""
    from torchvision.io import read_file

    return read_file(path)


def collate_encoded(samples) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(encoded image, label) pairs -> ((their bytes end to end, each one's length), the labels): one buffer a batch
    between processes, not one per image."""
    images = [s[0] for s in samples]
    lengths = torch.tensor([len(image) for image in images])
    return (torch.cat(images), lengths), torch.tensor([int(s[1]) for s in samples])


def decode_batch(images: tuple[torch.Tensor, torch.Tensor], device: torch.device, channels: int, transform):
    """The batch's JPEGs (collate_encoded's bytes and lengths, in host memory) decoded on `device`, each transformed
    there (where there is a transform), stacked: uint8 N x C x H x W."""
    from torchvision.io import ImageReadMode, decode_jpeg

    flat, lengths = images  # on the host: nothing here waits for the device
    starts = lengths.cumsum(0) - lengths
    heads = starts[:, None] + torch.arange(len(JPEG_START))
    if bool((lengths < len(JPEG_START)).any()) or not bool((flat[heads] == torch.tensor(JPEG_START)).all()):
        raise UserError(
            "data.decode=gpu decodes JPEG images only and a batch holds another format (PNG, say):"
            " use data.decode=cpu for this data"
        )
    mode = ImageReadMode.RGB if channels == 3 else ImageReadMode.GRAY
    try:
        images = _decode_aside(partial(decode_jpeg, list(flat.split(lengths.tolist())), mode=mode), device)
    except RuntimeError as err:
        raise UserError(
            f"a JPEG of this batch cannot be decoded on {device}: {first_line(err, named=False)}; run with"
            " data.decode=cpu to have it named"
        ) from err
    return torch.stack([transform(image) for image in images] if transform else images)


_decode_streams: dict[torch.device, torch.cuda.Stream] = {}


def _decode_aside(decode, device: torch.device) -> list[torch.Tensor]:
    """`decode(device=device)`, on a CUDA device on a stream of its own. nvJPEG's hardware decoder writes its outputs
    without waiting for the work already queued where they were allocated (pytorch/vision#9606): on the training
    stream it can be handed memory the previous step is still reading, and the loss turns NaN. On its own stream it
    only gets memory freed there; the training stream waits for the decode, and each image is marked in use by the
    training stream, so its memory goes back to the decoder only once the training stream is done with it. No host
    synchronisation."""
    if device.type != "cuda":
        return decode(device=device)
    if device not in _decode_streams:
        _decode_streams[device] = torch.cuda.Stream(device)
    aside, training = _decode_streams[device], torch.cuda.current_stream(device)
    with torch.cuda.stream(aside):
        images = decode(device=device)
    training.wait_stream(aside)
    for image in images:
        image.record_stream(training)
    return images
