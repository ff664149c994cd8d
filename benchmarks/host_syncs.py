"""Host-device synchronisations and collectives per training step, logging steps and the others apart.

    python -m benchmarks.host_syncs [--json=FILE] [train.py overrides ...]   e.g. strategy=fsdp devices=2

Trains with `python train.py OVERRIDES` and a callback that counts, from one training batch's start to the
next (so every hook of the loop is inside), in each rank:
- on CUDA: every synchronising CUDA call, as `torch.cuda.set_sync_debug_mode` reports them;
- on CPU, where nothing waits for a device: the Python-level calls that would synchronise on a GPU
  (`Tensor.item`, `bool(tensor)`, `float(tensor)`, `.tolist()`, `.cpu()`, ...) made outside torch itself
  (torch's optimizers read CPU-resident step counters), and collectives other than the all-gathers and
  reduce-scatters that the mode needs (`all_reduce`, `broadcast`, `barrier`, ...). DDP's gradient all-reduce
  runs in C++ and is not seen.
Prints the counts and the places they come from; adds them to results/host_syncs.json (or writes FILE).
"""

import json
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path

import lightning as L

from benchmarks.common import RESULTS, train_command
from starter.models.logging_step import is_logging_step

CONVERSIONS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object", "broadcast_object_list",
               "gather", "scatter", "reduce", "monitored_barrier")  # fmt: skip


def caller_outside_torch() -> str | None:
    """`file:line function` of the innermost frame outside torch (None if torch itself asked)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if __file__ in frame.filename or "warnings" in frame.filename:
            continue
        if "/torch/" in frame.filename:
            return None
        return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}"
    return None


class SyncCounter(L.Callback):
    """Counts, per rank, the syncs of training steps `warmup` to the first epoch's last but one."""

    def __init__(self, output: str, warmup: int = 3):
        self.output, self.warmup = Path(output), warmup
        self.steps: list[dict] = []
        self.current: dict | None = None
        self.undo: list = []

    def _record(self, kind: str, site: str | None) -> None:
        if self.current is not None and site is not None:
            self.current[kind] += 1
            self.current["sites"].append(f"{kind}: {site}")

    def _start(self, on_cuda: bool) -> None:
        import torch

        if on_cuda:
            catching = warnings.catch_warnings()
            catching.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *a, **k: self._record("syncs", caller_outside_torch())
            torch.cuda.set_sync_debug_mode("warn")
            self.undo.append(lambda: (torch.cuda.set_sync_debug_mode("default"), catching.__exit__(None, None, None)))
        else:
            for name in CONVERSIONS:
                self._wrap(torch.Tensor, name, "syncs")
        if torch.distributed.is_initialized():
            for name in COLLECTIVES:
                self._wrap(torch.distributed, name, "collectives")

    def _wrap(self, owner, name: str, kind: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self._record(kind, caller_outside_torch())
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        self.undo.append(lambda: setattr(owner, name, original))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.current is not None:
            self.steps.append(self.current)
            self.current = None
        if trainer.current_epoch != 0 or batch_idx < self.warmup:
            return
        if not self.undo:
            self._start(on_cuda=pl_module.device.type == "cuda")
        logging_step = is_logging_step(trainer)
        self.current = {"step": trainer.global_step, "logging_step": logging_step, "syncs": 0, "collectives": 0,
                        "sites": []}  # fmt: skip

    def on_validation_start(self, trainer, pl_module) -> None:
        self.current = None  # the epoch's last training step runs on into validation: not counted

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.undo:
            self.current = {"step": batch_idx, "evaluation": True, "syncs": 0, "collectives": 0, "sites": []}

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx=0) -> None:
        if self.current is not None:
            self.steps.append(self.current)
            self.current = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo, self.current = [], None  # the epoch's last step ends in epoch-end work: not counted
        if self.steps:
            self.output.mkdir(parents=True, exist_ok=True)
            (self.output / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))
            self.steps = []


def summarise(steps: list[dict]) -> dict:
    summary = {}
    training = [s for s in steps if not s.get("evaluation")]
    for name, chosen in (("non_logging", [s for s in training if not s["logging_step"]]),
                         ("logging", [s for s in training if s["logging_step"]]),
                         ("evaluation", [s for s in steps if s.get("evaluation")])):  # fmt: skip
        summary[f"{name}_steps"] = len(chosen)
        for kind in ("syncs", "collectives"):
            summary[f"{kind}_per_{name}_step"] = max((s[kind] for s in chosen), default=0)
        summary[f"{name}_sites"] = dict(Counter(site for s in chosen for site in s["sites"]).most_common())
    return summary


def count(overrides: list[str], scratch: Path) -> dict[str, dict]:
    """{rank: summary} of `python train.py OVERRIDES` (one epoch, no test)."""
    import subprocess

    output = scratch / "syncs"
    command = train_command("test=false", "trainer.max_epochs=1", "trainer.limit_val_batches=3",
                            f"paths.log_dir={scratch / 'logs'}", *overrides,
                            "+callbacks.syncs._target_=benchmarks.host_syncs.SyncCounter",
                            f"+callbacks.syncs.output={output}")  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0 or not output.exists():
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {p.stem: summarise(json.loads(p.read_text())) for p in sorted(output.glob("rank*.json"))}


def main() -> None:
    own = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--json=")]
    overrides = [a for a in sys.argv[1:] if not a.startswith("--json=")]
    result = count(overrides, Path(tempfile.mkdtemp(prefix="host-syncs-")))
    if own:
        Path(own[0]).write_text(json.dumps(result, indent=1) + "\n")
        return
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "host_syncs.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[" ".join(overrides) or "(defaults)"] = result
    path.write_text(json.dumps(runs, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
