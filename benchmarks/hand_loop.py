"""The loop a user would write by hand for train.py's net, batch, precision and optimizer on one device: the
baseline that says what the template costs. uint8 images gathered from a pool on the device (as train.py's
`data.on_device=true`), normalised as the data modules do, autocast to the precision, the configured optimizer.
cuDNN autotuning is on, as train.py's trainer config sets it."""

import time
from collections.abc import Callable

import torch
from hydra.utils import instantiate

MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def hand_step(cfg, precision: str, compile: bool, device: torch.device) -> Callable[..., None]:
    """One training step of the net `cfg.model.net` with `cfg.model.optimizer`: `step(read_loss=False)`; with
    read_loss the loss is read on the host (a sync), as a loop that prints its loss every N steps does."""
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    layout = torch.channels_last if cfg.get("channels_last") else torch.contiguous_format
    net = instantiate(cfg.model.net).to(device, memory_format=layout)
    optimizer = instantiate(cfg.model.optimizer)(net.parameters())
    step_net = torch.compile(net) if compile else net
    shape, classes, batch = list(cfg.data.image_shape), cfg.data.num_classes, cfg.data.batch_size
    pool = torch.randint(0, 256, (min(1024, 2 * batch), *shape), dtype=torch.uint8, device=device)
    labels = torch.randint(0, classes, (len(pool),), device=device)
    dtype = MIXED.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def step(read_loss: bool = False) -> None:
        slots = torch.randint(0, len(pool), (batch,), device=device)
        images = ((pool[slots].float() / 255 - 0.5) / 0.5).contiguous(memory_format=layout)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(step_net(images), labels[slots])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if read_loss:
            loss.item()

    step.net = net
    return step


def seconds(step: Callable[..., None], steps: int, device: torch.device, read_every: int = 0) -> float:
    """Wall time of `steps` calls, the device's queued work finished before both clock reads; with `read_every`,
    every read_every-th step reads its loss on the host (train.py's trainer.log_every_n_steps)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for i in range(steps):
        step(read_every > 0 and i % read_every == read_every - 1)
    sync()
    return time.perf_counter() - start


def training_flops_per_image(net: torch.nn.Module, image_shape: list[int], device: torch.device) -> float:
    """Forward + backward FLOPs of one image (torch's FLOP counter over a batch of 2: BatchNorm needs two)."""
    from torch.utils.flop_counter import FlopCounterMode

    images = torch.randn(2, *image_shape, device=device)
    with FlopCounterMode(display=False) as counter:
        net(images).float().sum().backward()
    net.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 2
