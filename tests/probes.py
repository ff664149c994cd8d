"""Callbacks that tests add to a run (`+callbacks.x._target_=probes.X`); importable by every process of the run
because the tests put this folder on PYTHONPATH."""

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import Dataset

from bed.data import Digits, TensorPairs, already_batched


class AugmentedDigits(Digits):
    """The digits, each training batch shifted by a pixel or none each way as it reaches the device: drawn from the
    training process's own generator, as any augmentation there draws (on the device, or with data.num_workers=0)."""

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        images, labels = batch
        if self.trainer is not None and self.trainer.training:
            images = torch.roll(images, shifts=torch.randint(-1, 2, (2,)).tolist(), dims=(-2, -1))
        return super().on_after_batch_transfer((images, labels), dataloader_idx)


class SigtermAtStep(L.Callback):
    """Sends SIGTERM (or `signal`) to this process after training step `step`, as a scheduler's preemption would."""

    def __init__(self, step: int, signal: str = "SIGTERM"):
        self.step, self.signal = step, signal

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.Signals[self.signal])


class SignalInPhase(L.Callback):
    """Sends `signal` to this process as the run enters `phase` (setup, the sanity check, the test), as a scheduler's
    preemption would there."""

    def __init__(self, phase: str, signal: str = "SIGTERM"):
        self.phase, self.signal = phase, signal

    def _send(self, phase: str) -> None:
        if phase == self.phase:
            os.kill(os.getpid(), signal.Signals[self.signal])

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._send("setup" if stage == "fit" else f"setup of {stage}")

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._send("the sanity check")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx == 0:
            self._send("test")


class SlowSteps(L.Callback):
    """Each training step takes `seconds` longer, as a large model's does (with `until`: until that file exists);
    rank 0 writes when each step ended (its global step, monotonic time) to `output`, a line each."""

    def __init__(self, seconds: float, output: str, until: str | None = None):
        self.seconds, self.output, self.until = seconds, Path(output), until and Path(until)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.until is None or not self.until.exists():
            time.sleep(self.seconds)  # within the step, before the callbacks that end it

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.is_global_zero:
            with self.output.open("a") as f:
                f.write(f"{trainer.global_step} {time.monotonic()}\n")


class AloneAtFirst(L.Callback):
    """In torchrun's first attempt of one process, each step takes `seconds` longer: that attempt lasts until another
    node comes (its agent restarts it with the node), and later attempts train at full speed."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.world_size == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            time.sleep(self.seconds)


class StepsWhileWriting(L.Callback):
    """A sharded checkpoint's shards (torch.distributed.checkpoint's FileSystemWriter) are written only once training
    has made 2 more steps, or another save began, or training ended, or after 10 s: a save that held the step would
    wait out the 10 s. Rank 0 writes "<step the write began at> <step when it went on>" to `output`, a line each."""

    def __init__(self, output: str):
        self.output, self.step, self.saves, self.ended = Path(output), 0, 0, False

    def setup(self, trainer, pl_module, stage: str) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        write_data, probe, rank = FileSystemWriter.write_data, self, trainer.global_rank

        def after_two_steps(writer, plan, planner):
            began, saves, deadline = probe.step, probe.saves, time.monotonic() + 10
            while probe.step < began + 2 and probe.saves == saves and not probe.ended and time.monotonic() < deadline:
                time.sleep(0.01)
            if rank == 0:
                with probe.output.open("a") as f:
                    f.write(f"{began} {probe.step}\n")
            return write_data(writer, plan, planner)

        FileSystemWriter.write_data = after_two_steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.step = trainer.global_step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saves += 1  # the next save waits for this one's write (checkpoint names move in order)

    def on_train_end(self, trainer, pl_module) -> None:
        self.ended = True


class SlowSaves(L.Callback):
    """Every checkpoint saved after step `after` (`stopping`: the one a stop signal asks for) takes `seconds` longer to
    write, as a large model's does."""

    def __init__(self, seconds: float, after: int = 0, stopping: bool = False):
        self.seconds, self.after, self.stopping = seconds, after, stopping

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        from starter.callbacks.preemption import SaveOnSigterm

        asked = SaveOnSigterm.listening is not None and SaveOnSigterm.listening.received is not None
        if trainer.global_step > self.after and (asked or not self.stopping):
            time.sleep(self.seconds)


class HangingUploads(L.Callback):
    """Rank 0's checkpoint store sends the second last.ckpt `seconds` slower, writing its key to `output` as it starts
    (a kill lands mid-upload); where `output` exists already (a later run of the same config), nothing is slower."""

    def __init__(self, seconds: float, output: str):
        self.seconds, self.output, self.sent = seconds, Path(output), 0

    def setup(self, trainer, pl_module, stage: str) -> None:
        uploads = next((c.uploads for c in trainer.callbacks if getattr(c, "uploads", None)), None)
        if uploads is None or self.output.exists():
            return
        objects, put = uploads.store.objects, uploads.store.objects.put

        def hanging(key: str, body) -> None:
            if "/last.ckpt.versions/" in key:
                self.sent += 1
                if self.sent == 2:
                    self.output.write_text(key)
                    body.read(1000)
                    time.sleep(self.seconds)
            put(key, body)

        objects.put = hanging


class RecordCompiledGraphs(L.Callback):
    """Writes `<output>/rank<r>.json`: the graphs torch.compile made in this process by the end of training."""

    def __init__(self, output: str):
        self.output = Path(output)

    def on_train_end(self, trainer, pl_module) -> None:
        from torch._dynamo.utils import counters

        self.output.mkdir(parents=True, exist_ok=True)
        figures = {"pid": os.getpid(), "parent": os.getppid(), "graphs": counters["stats"]["unique_graphs"]}
        (self.output / f"rank{trainer.global_rank}.json").write_text(json.dumps(figures))


class RecordConvInputLayout(L.Callback):
    """Writes `<output>/rank<r>.txt`: the memory format of the last Conv2d's input in a training step (the
    first one's input may have one channel, for which both formats are the same)."""

    def __init__(self, output: str):
        self.output = Path(output)
        self.hook = None

    def on_train_start(self, trainer, pl_module) -> None:
        import torch

        def record(module, args):
            layout = "channels_last" if args[0].is_contiguous(memory_format=torch.channels_last) else "contiguous"
            self.output.mkdir(parents=True, exist_ok=True)
            (self.output / f"rank{trainer.global_rank}.txt").write_text(layout)
            self.hook.remove()

        conv = [m for m in pl_module.modules() if isinstance(m, torch.nn.Conv2d)][-1]
        self.hook = conv.register_forward_pre_hook(record)


class NanWeightsAtStep(L.Callback):
    """Fills the weights with NaN before training step `step`: its loss is the first that is not finite."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            import torch

            with torch.no_grad():
                for parameter in pl_module.parameters():
                    parameter.fill_(float("nan"))


class RecordShardFractions(L.Callback):
    """Writes `<output>/rank<r>.json`: for each DTensor parameter, the fraction of its elements this rank holds."""

    def __init__(self, output: str):
        self.output = Path(output)

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.distributed.tensor import DTensor

        fractions = {name: p.to_local().numel() / p.numel() for name, p in pl_module.named_parameters()
                     if isinstance(p, DTensor)}  # fmt: skip
        self.output.mkdir(parents=True, exist_ok=True)
        (self.output / f"rank{trainer.global_rank}.json").write_text(json.dumps(fractions))


class RecordLearningRates(L.Callback):
    """Writes `<output>`: the learning rate each optimizer step ran with (read inside the step)."""

    def __init__(self, output: str):
        self.output, self.rates = Path(output), []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.rates.append(optimizer.param_groups[0]["lr"])

    def on_train_end(self, trainer, pl_module) -> None:
        self.output.write_text(json.dumps(self.rates))


class RecordGradientNorms(L.Callback):
    """Writes `<output>`: the norm of the whole gradient before each optimizer step, before clipping (one process)."""

    def __init__(self, output: str):
        self.output, self.norms = Path(output), []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        import torch

        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def on_train_end(self, trainer, pl_module) -> None:
        self.output.write_text(json.dumps(self.norms))


class InfGradientAtStep(L.Callback):
    """Makes one gradient element inf on rank `rank` only, after the backward of optimizer step `step`: an fp16
    overflow that one process meets."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            from torch.distributed.tensor import DTensor

            local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in pl_module.parameters()
                     if p.grad is not None]  # fmt: skip
            next(g for g in local if g.numel()).view(-1)[0] = float("inf")  # a shard of this rank may be empty


class RecordLossScale(L.Callback):
    """Writes `<output>/rank<r>.json`: the fp16 loss scale at the start and at the end of training."""

    def __init__(self, output: str):
        self.output, self.start = Path(output), None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = trainer.precision_plugin.scaler.get_scale()

    def on_train_end(self, trainer, pl_module) -> None:
        self.output.mkdir(parents=True, exist_ok=True)
        scale = {"start": self.start, "end": trainer.precision_plugin.scaler.get_scale()}
        (self.output / f"rank{trainer.global_rank}.json").write_text(json.dumps(scale))


class RaiseAtStep(L.Callback):
    """Raises an ordinary exception (a bug in a user's code) on rank `rank` only, after training step `step`."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            raise ValueError(f"a bug at step {self.step}")


class CutShortByCtrlC(L.Callback):
    """Rank `rank` waits at the start of epoch 1, having touched `marker`, in a call that turns Ctrl-C's
    KeyboardInterrupt into an error of its own, as torch.save cut short mid-write does (a RuntimeError of its zip
    writer: "unexpected pos", which a full disk also makes), inside the check every save's write is in."""

    def __init__(self, marker: str, rank: int = 0):
        self.marker, self.rank = Path(marker), rank

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch != 1 or trainer.global_rank != self.rank:
            return
        from starter.atomic_write import room_for

        self.marker.touch()
        with room_for(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"):
            try:
                while True:
                    time.sleep(0.05)
            except KeyboardInterrupt:
                raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 73280 vs 73232") from None


class RecordProcess(L.Callback):
    """Writes `<output>/rank<r>.json`: what the process a rank runs in was given (name, threads, start method)."""

    def __init__(self, output: str):
        self.output = Path(output)

    def on_train_start(self, trainer, pl_module) -> None:
        import multiprocessing

        import torch

        self.output.mkdir(parents=True, exist_ok=True)
        process = {"name": Path("/proc/self/comm").read_text().strip(), "threads": torch.get_num_threads(),
                   "start_method": multiprocessing.get_start_method(), "RANK": os.environ.get("RANK")}  # fmt: skip
        (self.output / f"rank{trainer.global_rank}.json").write_text(json.dumps(process))


class DigitsFromDisk(Digits):
    """Digits that need `folder` on this node's disk first, as a data set read from local files does: where it is
    missing, the user's error, met in prepare_data (by local rank 0 of each node; the node's others wait at a
    barrier)."""

    def __init__(self, folder: str, **kwargs):
        super().__init__(**kwargs)
        self.folder = folder

    def prepare_data(self) -> None:
        from starter.errors import UserError

        if not Path(self.folder).is_dir():
            raise UserError(f"digits not found in {self.folder}: this data set reads its files from the node's disk")


class HangingDigits(Digits):
    """Digits whose training loader, on rank `rank`, waits forever at its `fetch`-th batch (as a loader deadlocked on
    a lock would), while the process's other threads run on; touches `marker` when it begins to wait."""

    def __init__(self, rank: int, fetch: int, marker: str, **kwargs):
        super().__init__(**kwargs)
        self.hanging_rank, self.fetch, self.marker = rank, fetch, Path(marker)

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self.trainer.global_rank == self.hanging_rank:
            self.train_set = HangsAtFetch(self.train_set, self.fetch, self.marker)


class HangsAtFetch(Dataset):
    def __init__(self, inner: TensorPairs, fetch: int, marker: Path):
        self.inner, self.fetch, self.marker, self.fetched = inner, fetch, marker, 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitems__(self, indices: list[int]):
        self.fetched += 1
        if self.fetched == self.fetch:
            self.marker.touch()
            threading.Event().wait()
        return self.inner.__getitems__(indices)

    collate_fn = staticmethod(already_batched)


def wait_for_a_stop_signal(cfg) -> None:
    """A stand-in for a worker's job: says it is ready, then writes the name of the first stop signal it gets beside
    its log file, as `rank<RANK>`, and exits 143 as a worker that saved (rank 0 saying so, at step 0)."""
    import time

    got = []
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, lambda number, frame: got.append(signal.Signals(number).name))
    folder, rank = Path(cfg.log_file).parent, os.environ["RANK"]
    (folder / f"ready{rank}").touch()
    while not got:
        time.sleep(0.01)
    (folder / f"rank{rank}").write_text(got[0])
    if rank == "0":  # as rank 0 says once last.ckpt is in place
        from starter.callbacks.stop_agreement import StopAgreement

        (folder / "checkpoints").mkdir()
        torch.save({"global_step": 0}, folder / "checkpoints" / "last.ckpt")
        StopAgreement(2).say_saved(0)
    raise SystemExit(143)


class TakesBranches(torch.nn.Module):
    """A net whose forward branches on its input's values: what a traced export cannot follow."""

    def __init__(self, in_shape, num_classes: int):
        super().__init__()
        self.linear = torch.nn.Linear(int(torch.tensor(in_shape).prod()), num_classes)

    def forward(self, images):
        logits = self.linear(images.flatten(1))
        return logits if float(images.mean()) > 0 else -logits


class DiffersWhenTraced(TakesBranches):
    """A net whose output differs when it is traced for an export (torch.compiler.is_exporting), as a net does whose
    Python side changes what it computes: the exported model's logits are not the model's."""

    def forward(self, images):
        return self.linear(images.flatten(1)) + (1.0 if torch.compiler.is_exporting() else 0.0)


class RecordModules(L.Callback):
    """At the end of the test, writes which modules of the engine (starter) and of the test bed (bed) the process
    has imported."""

    def __init__(self, output: str):
        self.output = Path(output)

    def on_test_end(self, trainer, pl_module) -> None:
        import sys

        self.output.write_text(json.dumps(sorted(m for m in sys.modules if m.startswith(("starter.", "bed.")))))


def sample_ids(batch) -> list[int]:
    """A number for each sample of a batch: the CRC of its first tensor's row (a tuple's, list's or dict's first)."""
    import zlib

    while not isinstance(batch, torch.Tensor):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return [zlib.crc32(row.contiguous().cpu().numpy().tobytes()) for row in batch]


class RecordSamples(L.Callback):
    """Appends a line per training batch to `<output>/rank<r>.jsonl`: the epoch, the step and the batch's sample_ids
    (written as it goes: a run stopped and resumed into the same output keeps both parts)."""

    def __init__(self, output: str):
        self.output = Path(output)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.output.mkdir(parents=True, exist_ok=True)
        line = {"epoch": trainer.current_epoch, "step": trainer.global_step, "ids": sample_ids(batch)}
        with (self.output / f"rank{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")


class KilledAtStep(L.Callback):
    """SIGKILLs this process as training step `step` begins (mid-epoch), as a lost machine ends it (or sends it another
    `signal`: SIGTERM, a scheduler's preemption, once). `whole`: rank 0 sends it to its whole process group (its
    train.py, every worker), which the test started in a session of its own. `host`: rank 0 sends it to every process
    of its test host (tests/hosts.py), itself last: the host lost."""

    def __init__(self, step: int, signal: str = "SIGKILL", whole: bool = False, host: bool = False):
        self.step, self.signal, self.whole, self.host = step, signal, whole, host

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and self.signal:
            if self.host and trainer.is_global_zero:
                from hosts import MARK, marked

                for pid in sorted(marked(os.environ[MARK]), key=lambda pid: pid == os.getpid()):
                    os.kill(pid, getattr(signal, self.signal))
            elif not self.whole and not self.host:
                os.kill(os.getpid(), getattr(signal, self.signal))
            elif self.whole and trainer.is_global_zero:
                assert os.getpgid(0) == os.getsid(0), "whole=true needs train.py started in a session of its own"
                os.killpg(os.getpgid(0), getattr(signal, self.signal))
            self.signal = None


class RefusedCommitAtStep(L.Callback):
    """Makes torchft's quorum refuse training step `step` once in this replica group (None: the `after`th step this
    process trains, or with `epoch_end` the first after it that ends an epoch), after its gradients were averaged
    with the others' (as an error this group alone met there would), and writes each training step's number as its
    backward ends into `output`, from rank 0 (a step trained again appears twice)."""

    def __init__(self, output: str, step: int | None = None, after: int = 5, epoch_end: bool = False):
        self.step, self.after, self.epoch_end, self.output, self.refused = step, after, epoch_end, Path(output), False

    def on_after_backward(self, trainer, pl_module) -> None:
        step = trainer.global_step + 1
        if trainer.is_global_zero:
            with self.output.open("a") as f:
                f.write(f"{step}\n")
        if self.step is None:  # with epoch_end, the first that ends an epoch (the others then cross it first)
            self.step = step + self.after - 1
            while self.epoch_end and self.step % trainer.num_training_batches:
                self.step += 1
        if step == self.step and not self.refused:
            self.refused, manager = True, trainer.strategy.manager
            commit = manager.should_commit

            def refuse(*args, **kwargs):
                del manager.should_commit  # once
                manager.report_error(RuntimeError("refused by a probe"))
                return commit(*args, **kwargs)

            manager.should_commit = refuse


class SlowWhileAlone(L.Callback):
    """Under fault_tolerance=torchft, each training step takes `seconds` longer while this replica group trains
    without all the others (so that one started again finds it training); rank 0 writes when each step ended
    (its global step, monotonic time) to `output`, a line each."""

    def __init__(self, seconds: float, output: str):
        self.seconds, self.output = seconds, Path(output)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if len(trainer.strategy.groups) < trainer.strategy.ft.replica_groups:
            time.sleep(self.seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.is_global_zero:
            with self.output.open("a") as f:
                f.write(f"{trainer.global_step} {time.monotonic()}\n")


class StarvedAtStep(L.Callback):
    """Rank `rank` holds the interpreter for `seconds` as step `step` begins: a C call that keeps the GIL (libc's
    sleep through ctypes.PyDLL), so none of its threads runs, its watchdog's beat neither, as a process starved on a
    loaded machine: alive, not stopped, silent."""

    def __init__(self, step: int, seconds: float, rank: int = 1):
        self.step, self.seconds, self.rank = step, seconds, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            import ctypes

            ctypes.PyDLL(None).sleep(int(self.seconds))


class SharedBlockMLP(nn.Module):
    """ALBERT's shape on the MLP's config: one block applied `depth` times, held at two places (by name, and in the
    list of its uses)."""

    def __init__(self, in_shape: list[int], num_classes: int, width: int = 256, depth: int = 2, dropout: float = 0.0):
        super().__init__()
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), width), nn.ReLU())
        self.block = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.uses = nn.ModuleList([self.block] * depth)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.stem(x)
        for block in self.uses:
            x = block(x)
        return self.head(x)
