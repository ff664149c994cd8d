"""GPU scaling: images/s for 1..N GPUs of ResNet-50 and ViT-S/16 at 224x224, bf16-mixed, under ddp at every
count (one worker at 1 GPU too, so the scaling efficiency compares the same program), through `python train.py`.

Made to be trusted the day it runs: the images live on the GPU (`data.on_device=true`: the loader yields pool
indices only), so neither decoding nor the host-to-device copy can be the bottleneck; the timer synchronises
the GPU before it reads the clock at the first and the last timed step (benchmarks.common.StepTimer); WARMUP
steps (cudnn autotuning, compilation) are left out of STEPS timed ones. `--compile` adds torch.compile.
At one device the same net, batch, precision and optimizer also run in a plain PyTorch loop in this process
(`hand_loop_images_per_s`): the ratio train.py / hand loop is what the template costs on that device.

`make bench` runs it when CUDA is present. `--tiny --accelerator cpu` runs the same path at toy sizes
(ResNet-18 and a 3-block ViT at 32x32, 1..2 CPU processes): that is how the test suite checks it without a GPU.
Writes results/gpu_scaling.{md,json}.
"""

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, compose, markdown_table, timed_training

MODELS = {"ResNet-50": ["model=resnet50", "channels_last=true"], "ViT-S/16": ["model=vit_s16"]}
TINY = {"ResNet-18": ["model=resnet18", "channels_last=true"], "ViT (3 blocks, patch 4)": ["model=vit"]}


def overrides(model: list[str], devices: int, args) -> list[str]:
    size = 32 if args.tiny else 224
    steps = args.warmup + args.steps
    return [
        *model,
        "data=synthetic",
        "data.on_device=true",
        f"strategy={args.strategy}",
        f"devices={devices}",
        f"accelerator={args.accelerator}",
        f"precision={args.precision}",
        f"data.image_shape=[3,{size},{size}]",
        f"data.batch_size={args.batch_per_device * devices}",
        f"data.train_size={args.batch_per_device * devices * steps}",
        f"compile={args.compile}",
        "trainer.max_epochs=1",
        "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false",
    ]


def images_per_s(model: list[str], devices: int, args, scratch: Path) -> float:
    figures = timed_training(overrides(model, devices, args), scratch, warmup=args.warmup)
    print(f"{model[0]} on {devices}: {figures['samples'] / figures['seconds']:,.0f} images/s", flush=True)
    return figures["samples"] / figures["seconds"]


def hand_loop_images_per_s(model: list[str], args, scratch: Path) -> float:
    """The net and optimizer of train.py's config for one device, trained by a loop a user would write by hand:
    uint8 images gathered from a pool on the device, normalised, autocast to the precision, SGD/AdamW step."""
    import time

    import torch
    from hydra.utils import instantiate

    cfg = compose(overrides(model, 1, args), scratch / "hand")
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    torch.manual_seed(0)
    net = instantiate(cfg.model.net).to(device)
    layout = torch.channels_last if cfg.get("channels_last") else torch.contiguous_format
    net = net.to(memory_format=layout)
    optimizer = instantiate(cfg.model.optimizer)(net.parameters())
    step_net = torch.compile(net) if args.compile else net
    shape, classes, batch = list(cfg.data.image_shape), cfg.data.num_classes, cfg.data.batch_size
    pool = torch.randint(0, 256, (min(1024, 2 * batch), *shape), dtype=torch.uint8, device=device)
    labels = torch.randint(0, classes, (len(pool),), device=device)
    mean = torch.full((1, shape[0], 1, 1), 0.5, device=device)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(args.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def step() -> None:
        slots = torch.randint(0, len(pool), (batch,), device=device)
        images = ((pool[slots].float() / 255 - mean) / 0.25).contiguous(memory_format=layout)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(step_net(images), labels[slots])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = batch * args.steps / (time.perf_counter() - start)
    print(f"{model[0]} in a hand-written loop: {rate:,.0f} images/s", flush=True)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--max-devices", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--batch-per-device", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--strategy", default="ddp", help="e.g. auto at one device: is ddp's wrapper the cost?")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on CPU: checks the path, not the speed")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.tiny:
        args.batch_per_device, args.warmup, args.steps, args.precision = 8, 2, 3, "32"
    if args.max_devices is None:
        import torch

        args.max_devices = torch.cuda.device_count() if args.accelerator == "gpu" else 2
    scratch = Path(tempfile.mkdtemp(prefix="gpu-scaling-"))
    counts = [n for n in (1, 2, 4, 8, 16) if n <= args.max_devices]
    results, rows = {}, []
    for name, model in (TINY if args.tiny else MODELS).items():
        results[name] = {n: images_per_s(model, n, args, scratch) for n in counts}
        base = results[name][1]
        hand = results[name]["hand loop, 1 device"] = hand_loop_images_per_s(model, args, scratch)
        rows += [[name, n, f"{ips:,.0f}", f"{ips / n:,.0f}", f"{ips / (n * base):.2f}",
                  f"{base / hand:.2f} ({hand:,.0f})" if n == 1 else ""]
                 for n, ips in results[name].items() if n in counts]  # fmt: skip
    size = "32x32, CPU (a check of the path, not a speed)" if args.tiny else "224x224"
    compiled = ", torch.compile" if args.compile else ""
    header = (f"{size}, {args.precision}, {args.strategy} at every count, {args.batch_per_device} images per device "
              f"per step, images on the device, {args.steps} steps timed after {args.warmup}{compiled}")  # fmt: skip
    columns = [
        "model",
        "devices",
        "images/s",
        "images/s per device",
        "scaling efficiency",
        "train.py / hand loop (its images/s)",
    ]
    table = markdown_table(columns, rows)
    args.results.mkdir(exist_ok=True)
    name = "gpu_scaling_tiny" if args.tiny else "gpu_scaling"
    (args.results / f"{name}.md").write_text(header + ".\n\n" + table + "\n")
    (args.results / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    print(header + "\n" + table)


if __name__ == "__main__":
    main()
