"""Which mode when, measured: per-rank bytes of parameters, gradients and optimizer state, peak memory and
samples/s of one process, ddp, fsdp, tp, pp (1f1b), 2D (fsdp x tp), pp x dp and 3D (fsdp x pp x tp) on a ViT
large enough for the split to show (8 blocks of width 512, 17M parameters, AdamW), through `python train.py` as
a user runs it.

Bytes are what each rank holds (`callbacks=state_bytes`, after the second step); "vs ddp" divides by ddp's.
Peak memory on CPU is the resident set of each process, libraries included (about 0.7 GB before any tensor).
Writes results/model_parallel_memory.{md,json}.
"""

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, markdown_table, timed_training

VIT = ["model=vit", "model.net.patch_size=4", "model.net.dim=512", "model.net.depth=8", "model.net.heads=8",
       "data=synthetic", "data.image_shape=[3,32,32]", "data.num_classes=10"]  # fmt: skip
MODES = {
    "one process": ["strategy=auto", "devices=1"],
    "ddp": ["strategy=ddp", "devices=2"],
    "fsdp": ["strategy=fsdp", "devices=2"],
    "tp": ["strategy=tp", "devices=2"],
    "pp (1f1b, 4 micro-batches)": ["strategy=pp", "devices=2"],
    "2D: fsdp x tp (2 x 2)": ["strategy=fsdp", "strategy.tensor_parallel_size=2", "devices=4"],
    "pp x dp (2 stages x 2)": ["strategy=pp", "strategy.pipeline_parallel_size=2", "devices=4"],
    "3D: fsdp x pp x tp (2 x 2 x 2)": [
        "strategy=fsdp",
        "strategy.pipeline_parallel_size=2",
        "strategy.tensor_parallel_size=2",
        "devices=8",
    ],
}
KINDS = ("parameters", "gradients", "optimizer")


def measure(overrides: list[str], batch: int, steps: int, scratch: Path) -> dict:
    run = scratch / f"run{len(list(scratch.iterdir()))}"
    figures = timed_training(
        [
            *VIT,
            *overrides,
            "accelerator=cpu",
            "callbacks=state_bytes",
            f"data.batch_size={batch}",
            f"data.train_size={batch * steps}",
            "trainer.max_epochs=1",
            "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false",
            f"hydra.run.dir={run}",
        ],
        scratch,
        warmup=3,
    )
    ranks = [json.loads(p.read_text()) for p in sorted((run / "state_bytes").glob("rank*.json"))]
    return {"processes": len(ranks), "samples_per_s": figures["samples"] / figures["seconds"],
            **{kind: max(r[kind] for r in ranks) for kind in (*KINDS, "peak_memory")}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="mp-memory-"))
    results = {}
    for name, overrides in MODES.items():
        results[name] = measure(overrides, args.batch, args.steps, scratch)
        print(name, results[name], flush=True)
    ddp = results["ddp"]
    state = sum(ddp[kind] for kind in KINDS)
    rows = [[name, r["processes"], *(f"{r[kind] / 2**20:.0f}" for kind in KINDS),
             f"{sum(r[kind] for kind in KINDS) / state:.2f}", f"{r['peak_memory'] / 2**20:.0f}",
             f"{r['samples_per_s']:.1f}"] for name, r in results.items()]  # fmt: skip
    table = markdown_table(["mode", "processes", "parameters MB/rank", "gradients MB/rank", "optimizer MB/rank",
                            "state vs ddp", "peak memory MB/rank", "samples/s"], rows)  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    header = (f"ViT (8 blocks of width 512, 17M parameters), synthetic 3x32x32, global batch {args.batch}, AdamW, fp32,"
              " CPU (gloo). The largest rank's figures.\n\n")  # fmt: skip
    (RESULTS / "model_parallel_memory.md").write_text(header + table + "\n")
    (RESULTS / "model_parallel_memory.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table)


if __name__ == "__main__":
    main()
