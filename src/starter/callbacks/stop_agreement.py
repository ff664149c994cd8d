"""How the ranks of a run agree on the step at which a stop signal stops them, through the run's store: no collective,
nothing read from the device, and nothing at all until a signal arrives; and the one line a stopped run ends with.
Lightning-free: the launcher and the watchdogs read what it writes. Where the signal arrived, what was saved and that
the line was said carry the job token's proof (job_token.py): a stranger's stop is none, and a rank counts as knowing
only by a proven record of its own (a counter anyone could add to would let the decision pass a rank that has not
the request: it would step on alone)."""

import os
from pathlib import Path

from starter.job_token import opened, read_signed, signed
from starter.loggers.report import shown
from starter.run_store import client
from starter.topology import key_prefix

STOP_KEY = "stop"  # under the run's key prefix: the agreed step (`at`), the ranks that know (`knows/<rank>`), where the
# signal arrived (`origin`), what was saved, who has read it (`read/<node>`)


class StopAgreement:
    """The optimizer step at which every rank stops, agreed through the run's store. The ranks of a run step together
    (each step's gradient collective waits for all), so a rank that has the request at the end of step s proposes
    s + 1, which no rank has passed. A rank counts itself in once it has the request (its own signal: torch's agent,
    torchrun and SLURM signal every rank; or its watchdog relaying another rank's, from this store); at the agreed
    step the first rank there decides for all: stop where every rank has counted itself in, else one step later."""

    def __init__(self, world: int, rank: int = 0):
        self.world, self.rank, self.prefix = world, rank, f"{key_prefix()}/{STOP_KEY}"
        self.counted, self._store = False, None

    def store(self):
        if self._store is None:  # every process of the run reaches its store there (launch/)
            self._store = client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s=10)
        return self._store

    def stop_at(self, step: int, origin: str) -> bool:
        """Whether this rank, at the end of optimizer step `step`, stops (every rank gets the same answer there).
        `origin`: "signal|node|phase", where this rank's request came; the first rank's is the run's (a rank its
        watchdog relayed the request to comes after it). False where the store is gone (its launcher killed): a
        logging step's collective decides then."""
        try:
            return self._stop_at(step, origin)
        except (OSError, RuntimeError):  # connection refused or reset; torch's DistNetworkError, DistStoreError
            return False

    def _stop_at(self, step: int, origin: str) -> bool:
        store = self.store()
        knows = f"{self.prefix}/knows/{self.rank}"
        store.set(knows, signed(knows, "1"))  # each step it stops at: a stranger's overwrite lasts a step at most
        if not self.counted:
            key = f"{self.prefix}/origin"  # before `at`: the watchdogs relay a proven origin
            if opened(key, store.compare_set(key, "", signed(key, origin))) is None:  # a stranger's first
                store.set(key, signed(key, origin))
            self.counted = True
        at_key = f"{self.prefix}/at"
        at = opened(at_key, store.compare_set(at_key, "", signed(at_key, str(step + 1))))
        if at is None or not at.isdigit():  # a stranger's: the step is ours to propose
            store.set(at_key, signed(at_key, at := str(step + 1)))
        if step < int(at):
            return False
        everyone = self._everyone_knows(store)
        key = f"{self.prefix}/decided/{step}"
        decided = opened(key, store.compare_set(key, "", signed(key, "stop" if everyone else "go")))
        if decided == "go":
            store.compare_set(at_key, signed(at_key, str(step)), signed(at_key, str(step + 1)))
        return decided == "stop"

    def _everyone_knows(self, store) -> bool:
        keys = [f"{self.prefix}/knows/{rank}" for rank in range(self.world)]
        if not store.check(keys):
            return False
        return all(opened(key, value) == "1" for key, value in zip(keys, store.multi_get(keys), strict=True))

    def say_saved(self, step: int) -> None:
        """Rank 0, once last.ckpt is in place: what the launcher's line may then say (where it still listens)."""
        self._set("saved", str(step))

    def say_told(self) -> None:
        """Rank 0, once it has said the run's stop line: the launcher says none of its own."""
        self._set("told", "1")

    def _set(self, key: str, value: str) -> None:
        try:
            self.store().set(f"{self.prefix}/{key}", signed(f"{self.prefix}/{key}", value))
        except (OSError, RuntimeError):
            pass


def stop_origin(store, prefix: str) -> tuple[str, int, str] | None:
    """(signal, node, phase) where the run's stop signal arrived first; None where none was agreed on."""
    key = f"{prefix}/{STOP_KEY}/origin"
    try:
        record = read_signed(store, key)
    except Exception:  # the store is gone
        return None
    signal, node, phase = record.split("|", 2) if record and record.count("|") >= 2 else ("", "", "")
    return (signal, int(node), phase) if node.isdigit() else None


def stop_requested(store, prefix: str) -> bool:
    """Whether a rank of the run has asked the others to stop (a watchdog relays it to a rank no signal reached)."""
    return stop_origin(store, prefix) is not None


def saved_step(store, prefix: str) -> int | None:
    """The step at which the run saved last.ckpt on a stop signal; None where it did not."""
    key = f"{prefix}/{STOP_KEY}/saved"
    try:
        step = read_signed(store, key) if store is not None else None
    except Exception:  # the store is gone
        return None
    return int(step) if step and step.isdigit() else None


def told(store, prefix: str) -> bool:
    """Whether rank 0 has said the run's stop line (StopAgreement.say_told)."""
    try:
        key = f"{prefix}/{STOP_KEY}/told"
        return read_signed(store, key) is not None
    except Exception:  # the store is gone
        return False


def stop_line(cause: str, run_dir, phase: str | None = None, saved_step: int | None = None, why: str = "") -> str:
    """The one line a run stopped on request ends with, wherever it is said (run.py, the launcher, Oversight), from
    what is on disk: "after saving" only where this stop saved checkpoints/last.ckpt at `saved_step` (rank 0's word)
    and the file there holds that step; else what last.ckpt holds, if anything. `why`: why nothing was saved now."""
    last = Path(run_dir) / "checkpoints" / "last.ckpt"
    during, because = f" during {phase}" if phase else "", f"{why}; " if why else ""
    step = checkpoint_step(last)
    resume = f"resume with ckpt_path={shown(last)}"
    if saved_step is not None and step == saved_step:
        return f"stopped by {cause}{during} at step {step} after saving checkpoints/last.ckpt; {resume}"
    if saved_step is not None and step is None:  # another node's disk: its ranks' shards at most
        return f"stopped by {cause}{during} at step {saved_step}; rank 0 saved checkpoints/last.ckpt on its node"
    if step is None:
        return f"stopped by {cause}{during}; {because}nothing was saved (this run has no checkpoints/last.ckpt)"
    return f"stopped by {cause}{during}; {because}checkpoints/last.ckpt holds step {step}, saved before; {resume}"


def checkpoint_step(path: Path) -> int | None:
    """The optimizer step a checkpoint (a sharded one: its meta.pt) was saved at; None where there is none to read."""
    import torch

    try:
        saved = torch.load(path / "meta.pt" if path.is_dir() else path, mmap=True, weights_only=True)
        return int(saved["global_step"])
    except Exception:  # none there, or one cut short
        return None
