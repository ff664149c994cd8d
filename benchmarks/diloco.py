"""What fault_tolerance.sync_every (DiLoCo) sends and what it costs in loss: on CPU, two replica groups of one process,
digits + MLP (AdamW inside each group, the default), the global batch 64, STEPS steps (10 batches an epoch).

Per mode: the bytes each process hands torchft's all-reduce across the groups, per training step (counted at
`Manager.allreduce`; a ring all-reduce puts about twice that on the wire at many groups), and the validation loss
and accuracy after STEPS steps (each group's own; after the last sync they are equal). Gradients every step (the
default) against DiLoCo with H = 1, 10 and 50 and its outer Nesterov SGD (lr 0.7, momentum 0.9).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L

from benchmarks.common import RESULTS, ROOT, free_port, markdown_table, train_command

STEPS = 200
RUN = ["accelerator=cpu", f"trainer.max_epochs={STEPS // 10}", "trainer.limit_train_batches=10", "test=false",
       "trainer.enable_progress_bar=false", "fault_tolerance=torchft"]  # fmt: skip
MODES = {"gradients every step": []} | {f"DiLoCo, H={h}": [f"fault_tolerance.sync_every={h}"] for h in (1, 10, 50)}


class SentBytes(L.Callback):
    """Counts what this process hands torchft's all-reduce across the groups; writes {bytes, steps} to `output`."""

    def __init__(self, output: str):
        self.output, self.sent, self.counting = Path(output), 0, False

    def on_train_start(self, trainer, pl_module) -> None:
        manager, allreduce = trainer.strategy.manager, trainer.strategy.manager.allreduce

        def counted(tensor, *args, **kwargs):
            self.sent += tensor.numel() * tensor.element_size() * self.counting
            return allreduce(tensor, *args, **kwargs)

        manager.allreduce = counted

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.counting = True  # from the first batch: the groups' joining quorums before it are not training's

    def on_train_end(self, trainer, pl_module) -> None:
        self.output.write_text(json.dumps({"bytes": self.sent, "steps": trainer.global_step}))


def run(scratch: Path, mode: list[str]) -> dict:
    port, procs = free_port(), []
    for number in (0, 1):
        lighthouse = [f"fault_tolerance.lighthouse=http://localhost:{port}"] if number else []
        command = train_command(*RUN, *mode, f"fault_tolerance.replica_group={number}", *lighthouse,
                                f"fault_tolerance.lighthouse_port={port}", f"paths.log_dir={scratch / f'g{number}'}",
                                "+callbacks.sent._target_=benchmarks.diloco.SentBytes",
                                f"+callbacks.sent.output={scratch / f'sent{number}.json'}")  # fmt: skip
        procs.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
    sent = json.loads((scratch / "sent0.json").read_text())
    metrics = [json.loads(next((scratch / f"g{g}").glob("train/runs/*/metrics.json")).read_text()) for g in (0, 1)]
    return {
        "bytes_per_step": sent["bytes"] / sent["steps"],
        "steps": sent["steps"],
        "val_loss": [m["val/loss"] for m in metrics],
        "val_acc": [m["val/acc"] for m in metrics],
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="diloco-"))
    results = {name: run(scratch / str(i), mode) for i, (name, mode) in enumerate(MODES.items())}
    base = results["gradients every step"]["bytes_per_step"]
    rows = [[name, f"{r['bytes_per_step']:,.0f}", f"{r['bytes_per_step'] / base:.3f}",
             " / ".join(f"{v:.4f}" for v in r["val_loss"]), " / ".join(f"{v:.4f}" for v in r["val_acc"])]
            for name, r in results.items()]  # fmt: skip
    table = markdown_table(["2 groups of 1 process", "bytes sent per step", "/ every step", f"val/loss after"
                            f" {STEPS} steps (group 0 / 1)", "val/acc (group 0 / 1)"], rows)  # fmt: skip
    made = (
        "DiLoCo sends 1/H of the bytes: its weights once a sync, where the default sends its gradients (and a flag)"
        f" every step. Its loss after {STEPS} steps is that of another optimisation (an outer Nesterov step over the"
        " groups' AdamW steps, here untuned), not a cost of the transport: with H=1, an outer SGD of lr 1 and an inner"
        f" SGD it is the default's run (tested).\nMade by `python -m benchmarks.diloco` on {os.cpu_count()} CPUs."
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "diloco.md").write_text(table + "\n\n" + made + "\n")
    (RESULTS / "diloco.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table + "\n\n" + made)


if __name__ == "__main__":
    sys.exit(main())
