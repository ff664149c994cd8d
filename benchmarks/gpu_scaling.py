"""GPU scaling: images/s for 1..N GPUs of ResNet-50 and ViT-S/16 at 224x224, bf16-mixed, under ddp at every
count (one worker at 1 GPU too, so the scaling efficiency compares the same program), through `python train.py`.

Made to be trusted the day it runs: the images live on the GPU (`data.on_device=true`: the loader yields pool
indices only), so neither decoding nor the host-to-device copy can be the bottleneck; the timer synchronises
the GPU before it reads the clock at the first and the last timed step (benchmarks.common.StepTimer); WARMUP
steps (cudnn autotuning, compilation) are left out of STEPS timed ones. `--compile` adds torch.compile.

`make bench` runs it when CUDA is present. `--tiny --accelerator cpu` runs the same path at toy sizes
(ResNet-18 and a 3-block ViT at 32x32, 1..2 CPU processes): that is how the test suite checks it without a GPU.
Writes results/gpu_scaling.{md,json}.
"""

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, markdown_table, timed_training

MODELS = {"ResNet-50": ["model=resnet50", "channels_last=true"], "ViT-S/16": ["model=vit_s16"]}
TINY = {"ResNet-18": ["model=resnet18", "channels_last=true"], "ViT (3 blocks, patch 4)": ["model=vit"]}


def images_per_s(model: list[str], devices: int, args, scratch: Path) -> float:
    size = 32 if args.tiny else 224
    steps = args.warmup + args.steps
    figures = timed_training(
        [
            *model,
            "data=synthetic",
            "data.on_device=true",
            "strategy=ddp",
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
        ],
        scratch,
        warmup=args.warmup,
    )
    return figures["samples"] / figures["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--max-devices", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--batch-per-device", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compile", action="store_true")
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
        rows += [[name, n, f"{ips:,.0f}", f"{ips / n:,.0f}", f"{ips / (n * base):.2f}"]
                 for n, ips in results[name].items()]  # fmt: skip
    header = (f"{'32x32, CPU (a check of the path, not a speed)' if args.tiny else '224x224'}, {args.precision}, "
              f"ddp at every count, {args.batch_per_device} images per device per step, images on the device, "
              f"{args.steps} steps timed after {args.warmup}{', torch.compile' if args.compile else ''}")  # fmt: skip
    table = markdown_table(["model", "devices", "images/s", "images/s per device", "scaling efficiency"], rows)
    args.results.mkdir(exist_ok=True)
    name = "gpu_scaling_tiny" if args.tiny else "gpu_scaling"
    (args.results / f"{name}.md").write_text(header + ".\n\n" + table + "\n")
    (args.results / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    print(header + "\n" + table)


if __name__ == "__main__":
    main()
