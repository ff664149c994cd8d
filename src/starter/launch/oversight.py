"""What torch's elastic agent does not do, done beside it in the job: end this node's workers when another node's
process has reported a failure; kill a stopped worker as soon as the agent is stopping it (it cannot act on the agent's
SIGTERM, after which the agent waits 30 s before a SIGKILL; not before: the agent names the first worker that ended,
not one killed here); name the first failure, and how a stop ended, in one line."""

import os
import signal
import threading
import time
from pathlib import Path

from starter.callbacks.stop_agreement import STOP_KEY, saved_step, stop_line, stop_origin, told
from starter.errors import PREEMPTED_EXIT_CODE, WorkerFailed
from starter.job_token import read_signed
from starter.launch.watchdog import pid_here, where
from starter.process_state import process_state
from starter.run_failure import failure, report, said
from starter.run_store import answers
from starter.topology import node_rank

STOPPED = ("T", "t")  # process states of a process that cannot act on a signal: stopped, or held by a debugger


class Oversight:
    def __init__(self, store, prefix: str, layout, run_dir: Path, grace_s: float, linger_s: float):
        self.store, self.prefix, self.node, self.per_node = store, prefix, node_rank(), layout.processes_per_node
        self.nodes, self.run_dir, self.grace_s, self.linger_s = layout.nodes, run_dir, grace_s, linger_s
        self.reported_failure: WorkerFailed | None = None
        self.pids: dict[int, int] = {}  # rank: pid, of this node's workers
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="oversight", daemon=True)
        self.thread.start()

    def failed(self, failures: dict) -> WorkerFailed:
        """WorkerFailed for the agent's failures ({global rank: ProcessFailure}): the first a signal ended (its peers
        here leave at once, unsaid: this names it), else the first."""
        rank, process = min(failures.items(), key=lambda failed: (failed[1].exitcode >= 0, failed[1].timestamp))
        if reported := self._reported(wait_s=2.0):
            return reported
        if process.exitcode < 0:  # a signal ended it: it could not say so; said here and told to the other nodes
            killed = process.signal_name() + (" (out of memory?)" if process.exitcode == -signal.SIGKILL else "")
            line = f"{where(rank, self.per_node)} was killed by {killed}; every process of the run stops"
            report(self.store, 128 - process.exitcode, line, self.node, self.prefix)
            return WorkerFailed(None, 128 - process.exitcode)
        if process.exitcode == PREEMPTED_EXIT_CODE:
            return self.stopped("a stop signal", wait_s=self.grace_s)
        return WorkerFailed(None, process.exitcode)  # it said why

    def stopped(self, cause: str, wait_s: float = 1.0) -> WorkerFailed:
        """What a stop ended with (a worker's exit 143; a stop signal to the launcher, `cause`, after the agent gave
        the workers stop_grace_s to save and end): rank 0's line on node 0 (waited for `wait_s`), on every other node
        the same, from where the signal arrived, what rank 0 said it saved and what is on disk. Node 0 holds the store
        until every node has read it; no node calls it once it has gone (torch would print its C++ traces)."""
        deadline = time.monotonic() + wait_s
        while answers(self.store) and not told(self.store, self.prefix) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = answers(self.store)
        origin, step = (
            (stop_origin(self.store, self.prefix), saved_step(self.store, self.prefix)) if alive else [None] * 2
        )
        said = alive and self.node == 0 and told(self.store, self.prefix)  # by rank 0, here
        if alive:
            self.store.set(f"{self.prefix}/{STOP_KEY}/read/{self.node}", "")
        if self.node == 0:
            self._wait_for_the_other_nodes()
        if said:
            return WorkerFailed(None, PREEMPTED_EXIT_CODE)
        phase, why = None, ""
        unsaved = step is None and cause != "a stop signal"  # the launcher's signal, and nothing saved since
        began = unsaved and self._began()
        if began:  # the workers had begun and had their grace (whoever recorded where the signal arrived)
            why = f"the workers did not save within stop_grace_s={self.grace_s:g} (raise it above a step and a save)"
        if origin is not None:
            cause, phase = f"{origin[0]} (sent to node {origin[1]})", origin[2]
        elif unsaved and not began:
            phase = "the workers' start"  # they had nothing to save: ended at the signal
        return WorkerFailed(stop_line(cause, self.run_dir, phase, step, why), PREEMPTED_EXIT_CODE)

    def _wait_for_the_other_nodes(self) -> None:
        """Node 0 serves the store: until every other node has read how the run stopped, at most `linger_s`."""
        read = [f"{self.prefix}/{STOP_KEY}/read/{node}" for node in range(1, self.nodes)]
        deadline = time.monotonic() + self.linger_s
        while read and not self.store.check(read) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _began(self) -> bool:
        """Whether a worker of this node began a batch (the count its watchdog beats into the store: stall.py)."""
        first = self.node * self.per_node
        keys = [f"{self.prefix}/progress/{rank}" for rank in range(first, first + self.per_node)]
        try:
            return not answers(self.store) or any(
                (read_signed(self.store, key) or "0").split("|")[0] != "0" for key in keys
            )
        except Exception:  # the store is gone
            return True

    def _reported(self, wait_s: float = 0.0) -> WorkerFailed | None:
        if reported := failure(self.store, self.prefix):
            code, line, node = reported  # no line where this node's own process wrote it and said it (`wait_s`: it
            deadline = time.monotonic() + wait_s * (node == self.node)  # may be between its line and the mark)
            while not (mine := said(self.store, self.prefix)) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.reported_failure = WorkerFailed(None if node == self.node and mine else line, code, node)
        return self.reported_failure

    def _watch(self) -> None:
        polls = 0
        while not self.stopping.wait(0.2):
            pids = self._workers()
            for pid in pids:  # the agent is stopping the workers (after it has named the first failure)
                if process_state(pid) in STOPPED and _pending(pid, signal.SIGTERM):
                    _signal(pid, signal.SIGKILL)
            polls += 1
            if polls % 5 == 0 and self._reported():  # this node's workers may be unable to leave
                for pid in pids:
                    _signal(pid, signal.SIGKILL if process_state(pid) in STOPPED else signal.SIGTERM)

    def _workers(self) -> list[int]:
        """The pids this node's workers published in the store (their watchdogs' first beat), each read once: the
        store may be another node's, and a worker's pid does not change (the agent restarts none)."""
        first = self.node * self.per_node
        missing = [rank for rank in range(first, first + self.per_node) if rank not in self.pids]
        for rank in missing if missing and answers(self.store) else ():  # no call to a store that has gone
            try:
                if (pid := pid_here(self.store, rank, self.prefix)) is not None:
                    self.pids[rank] = pid
            except Exception:
                break  # the store is gone: the watchdogs say so
        return list(self.pids.values())

    def stop(self) -> None:
        """Also ends what the agent could not: a worker forked as it stopped (it knew none), a child of the fork server
        that forked every worker of the run."""
        self.stopping.set()
        self.thread.join()
        for worker in workers_forked_here():
            _signal(worker, signal.SIGKILL)


def workers_forked_here() -> list[int]:
    """The workers (named "rank N": worker.py) that a fork server of this process forked."""
    processes = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # gone meanwhile
        processes[int(stat.parent.name)] = (
            text[text.index("(") + 1 : text.rindex(")")],
            int(text.rsplit(")")[1].split()[1]),
        )
    servers = [pid for pid, (_, parent) in processes.items() if parent == os.getpid()]
    return [pid for pid, (name, parent) in processes.items() if parent in servers and name.startswith("rank ")]


def _pending(pid: int, signum: int) -> bool:
    """Whether `signum` sent to process `pid` waits for it to act on it (proc(5): ShdPnd, a mask of signals)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("ShdPnd:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # it has exited already
