"""The GPU form of the strategy benchmark: ResNet-50 on synthetic 224x224 images, bf16-mixed, channels_last,
optionally torch.compile; images/s per GPU and scaling efficiency for 1..N GPUs (1 = one process, N > 1 = ddp).

`make bench` runs it when CUDA is present. `--tiny --accelerator cpu` runs the same path at toy sizes
(ResNet-18, 32x32, 1..2 CPU processes): that is how the test suite checks it on machines without a GPU.
Writes results/gpu_scaling.{md,json}.
"""

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, markdown_table, timed_training


def images_per_s(devices: int, args, scratch: Path) -> float:
    model, size, per_device = ("resnet18", 32, 8) if args.tiny else ("resnet50", 224, args.batch_per_device)
    figures = timed_training(["data=synthetic", f"model={model}", f"strategy={'ddp' if devices > 1 else 'auto'}",
                              f"devices={devices}", f"accelerator={args.accelerator}", f"precision={args.precision}",
                              f"data.image_shape=[3,{size},{size}]", f"data.batch_size={per_device * devices}",
                              f"data.train_size={per_device * devices * (args.steps + 3)}",
                              f"data.num_workers={args.workers}", "channels_last=true", f"compile={args.compile}",
                              "trainer.max_epochs=1", "trainer.limit_val_batches=1",
                              "trainer.enable_progress_bar=false"], scratch, warmup=3)  # fmt: skip
    return figures["samples"] / figures["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--max-devices", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--batch-per-device", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="ResNet-18 at 32x32: checks the path, not the speed")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.tiny:
        args.workers, args.steps, args.precision = 0, 4, "32"
    if args.max_devices is None:
        import torch

        args.max_devices = torch.cuda.device_count() if args.accelerator == "gpu" else 2
    scratch = Path(tempfile.mkdtemp(prefix="gpu-scaling-"))
    counts = [n for n in (1, 2, 4, 8, 16) if n <= args.max_devices]
    results = {n: images_per_s(n, args, scratch) for n in counts}
    base = results[1]
    rows = [[n, f"{ips:,.0f}", f"{ips / n:,.0f}", f"{ips / (n * base):.2f}"] for n, ips in results.items()]
    what = "ResNet-18 32x32 (tiny check)" if args.tiny else f"ResNet-50 224x224, {args.precision}"
    what += ", channels_last"
    header = f"{what}, {args.batch_per_device if not args.tiny else 8} images per device per step"
    header += ", torch.compile" if args.compile else ""
    table = markdown_table(["devices", "images/s", "images/s per device", "scaling efficiency"], rows)
    args.results.mkdir(exist_ok=True)
    name = "gpu_scaling_tiny" if args.tiny else "gpu_scaling"
    (args.results / f"{name}.md").write_text(header + ".\n\n" + table + "\n")
    (args.results / f"{name}.json").write_text(json.dumps({"devices": results}, indent=1) + "\n")
    print(header + "\n" + table)


if __name__ == "__main__":
    main()
