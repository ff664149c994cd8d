"""GPU scaling: images/s for 1..N GPUs of ResNet-50 and ViT-S/16 at 224x224, bf16-mixed, under ddp at every
count (one worker at 1 GPU too, so the scaling efficiency compares the same program), through `python train.py`.

Made to be trusted the day it runs: the images live on the GPU (`data.on_device=true`: the loader yields pool
indices only), so neither decoding nor the host-to-device copy can be the bottleneck; the timer synchronises
the GPU before it reads the clock at the first and the last timed step (benchmarks.common.StepTimer); WARMUP
steps (cudnn autotuning, compilation) are left out of STEPS timed ones. `--compile` adds torch.compile.
At one device the same net, batch, precision and optimizer also run in a plain PyTorch loop in this process
(`hand_loop`): the ratio train.py / hand loop is what the template costs on that device.

`make bench` runs it when CUDA is present. `--tiny --accelerator cpu` runs the same path at toy sizes
(ResNet-18 and a 3-block ViT at 32x32, 1..2 CPU processes): that is how the test suite checks it without a GPU.
Writes results/gpu_scaling.{md,json}.
"""

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, compose_config, markdown_table, timed_training

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


def hand_loop(model: list[str], args, scratch: Path) -> dict:
    """The same net, batch, precision and optimizer on one device in a hand-written loop (benchmarks.hand_loop):
    images/s without reading anything on the host, and reading the loss every `trainer.log_every_n_steps` steps as
    train.py's logging does; and the forward + backward FLOPs of one image (for the model FLOPs utilisation)."""
    import torch

    from benchmarks.hand_loop import hand_step, seconds, training_flops_per_image

    cfg = compose_config(overrides(model, 1, args), scratch / "hand")
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    step = hand_step(cfg, args.precision, args.compile, device)
    for _ in range(args.warmup):
        step()
    batch, every = cfg.data.batch_size, int(cfg.trainer.log_every_n_steps)
    figures = {"images_per_s": batch * args.steps / seconds(step, args.steps, device),
               "logging_images_per_s": batch * args.steps / seconds(step, args.steps, device, read_every=every),
               "flops_per_image": training_flops_per_image(step.net, list(cfg.data.image_shape), device)}  # fmt: skip
    print(f"{model[0]} in a hand-written loop: {figures['images_per_s']:,.0f} images/s, reading its loss every"
          f" {every} steps {figures['logging_images_per_s']:,.0f}", flush=True)  # fmt: skip
    return figures


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
    parser.add_argument("--models", nargs="+", default=None, help=f"in this order (default: all of {list(MODELS)})")
    parser.add_argument("--peak-flops", type=float, default=989e12, help="the device's dense bf16 peak (H100 SXM)")
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
    models = TINY if args.tiny else MODELS
    for name in args.models or models:
        model = models[name]
        results[name] = {n: images_per_s(model, n, args, scratch) for n in counts}
        base = results[name][1]
        hand = results[name]["hand loop, 1 device"] = hand_loop(model, args, scratch)
        flops = hand["flops_per_image"]
        for n, ips in results[name].items():
            if n not in counts:
                continue
            logging, silent = hand["logging_images_per_s"], hand["images_per_s"]
            vs_hand = [f"{base / logging:.2f} / {base / silent:.2f}", f"{logging:,.0f} / {silent:,.0f}"]
            mfu = f"{flops * ips / n / args.peak_flops:.1%}"
            rows.append([name, n, f"{ips:,.0f}", f"{ips / (n * base):.2f}", mfu, *(vs_hand if n == 1 else ["", ""])])
    size = "32x32, CPU (a check of the path, not a speed)" if args.tiny else "224x224"
    compiled = ", torch.compile" if args.compile else ""
    header = (f"{size}, {args.precision}, strategy={args.strategy} at every count (one process: no DDP wrapper),"
              f" {args.batch_per_device} images per device per step, images on the device, {args.steps} steps timed"
              f" after {args.warmup}{compiled}; MFU = training FLOPs per image (torch's counter) x images/s per"
              f" device / {args.peak_flops / 1e12:.0f} TFLOP/s")  # fmt: skip
    columns = [
        "model",
        "devices",
        "images/s",
        "scaling efficiency",
        "MFU",
        "train.py / hand loop (loss read every 10 steps / never)",
        "hand loop images/s (same)",
    ]
    table = markdown_table(columns, rows)
    args.results.mkdir(exist_ok=True)
    name = "gpu_scaling_tiny" if args.tiny else "gpu_scaling"
    (args.results / f"{name}.md").write_text(header + ".\n\n" + table + "\n")
    (args.results / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    print(header + "\n" + table)


if __name__ == "__main__":
    main()
