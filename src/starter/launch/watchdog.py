"""Every process of a several-process run ends, within a bound, when one of them fails, dies or stops answering.

Each process runs a `Watchdog`, a client of the run's store. Its beat adds 1 to the rank's counter and reads `failed`,
which the first process that met an error writes (it prints the cause; the others leave with its code). Rank 0
watches every counter, the others rank 0's; one still for `timeout_s` is a lost rank. A timer thread ends the process
when the store has not answered for `timeout_s` (a stopped server never fails a request). The beat also carries how far
the main thread has got, so rank 0 ends a run whose main threads wait forever (stall.py). A stopped rank (SIGSTOP)
cannot act on SIGTERM: where no launcher of ours starts the ranks, the watchdog that names it SIGKILLs it on its host.
A worker whose launcher is gone (SIGKILL, the OOM killer) saves last.ckpt and stops as on a stop signal.
"""

import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from functools import partial

from starter.callbacks.stop_agreement import stop_requested
from starter.errors import INTERRUPTED_EXIT_CODE, LOST_EXIT_CODE, UserError, interrupted, one_line, to_stderr
from starter.job_token import read_signed, signed
from starter.launch.environment import cluster_environment
from starter.launch.lifeline import Lifeline, published_port
from starter.launch.stall import Stall, main_thread_at, read_progress
from starter.process_state import gone, process_state, runs
from starter.run_failure import failure, report
from starter.run_store import answers, client, listening, reach, serve_store
from starter.topology import key_prefix, torchrun_agents_share_their_store

STARTUP_S = 60.0  # the least time a rank that has not beaten yet is waited for
STOPS = "every process of the run stops"


def interval_s(timeout_s: float) -> float:
    return min(5.0, float(timeout_s) / 4)


def linger_s(timeout_s: float) -> float:
    """How long a process that serves the store stays after a failure, so every other one reads it from there."""
    return 2 * interval_s(timeout_s) + 1


def where(rank: int, ranks_per_node: int) -> str:
    return f"rank {rank} (node {rank // ranks_per_node})"


class Watchdog:
    def __init__(self, address: str, port: int, rank: int, world: int, ranks_per_node: int, timeout_s: float,
                 stall_timeout_s: float, store_holder: str, serves_store: bool = False,
                 launcher_pid: int | None = None, stop_signal: int = signal.SIGTERM, parent: str | None = "train.py",
                 stop_grace_s: float = 90.0):  # fmt: skip
        """`store_holder`: who serves the store (named when it stops answering). `launcher_pid`: the process that
        started this one (`parent`: train.py, whose agent did, or torchrun's agent), which it outlives only to save
        and stop (`stop_signal`, within `stop_grace_s`); where it is not train.py, the watchdog that names a stopped
        rank kills it. A stop signal wakes the beat (the main thread may wait in C, a rendezvous or a collective,
        where no Python handler runs): a run that has nothing to save yet ends then (callbacks/preemption.py)."""
        self.address, self.port, self.rank, self.world = address, port, rank, world
        self.ranks_per_node, self.timeout_s, self.serves_store = ranks_per_node, float(timeout_s), serves_store
        self.stall_timeout_s = float(stall_timeout_s)
        self.boundaries = -1  # the main thread's count at the last beat
        self.launcher_pid, self.stop_signal, self.launcher_left = launcher_pid, stop_signal, False
        self.saying = threading.Lock()  # the beat and the main thread's stop() may both find the launcher gone
        self.store_holder, self.parent, self.kills_stopped_peers = store_holder, parent, parent != "train.py"
        self.interval = interval_s(self.timeout_s)
        self.answered, self.ever_answered = time.monotonic(), False  # the store's last answer
        self.stopping, self.stop_grace_s = threading.Event(), float(stop_grace_s)
        self.lifeline: Lifeline | None = None  # held by the beat thread (launch/lifeline.py)
        self.signals, self.wakeup = socket.socketpair()  # a byte on it for each signal Python handles
        for end in (self.signals, self.wakeup):
            end.setblocking(False)
        signal.set_wakeup_fd(self.wakeup.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._beat, name="watchdog", daemon=True).start()
        threading.Thread(target=self._time_the_store, name="watchdog-timer", daemon=True).start()

    def report(self, code: int, line: str) -> None:
        """This process met an error: tell every other process (and print the line if the first)."""
        store, node = reach(self.address, self.port, self.timeout_s), self.rank // self.ranks_per_node
        report(store, code, f"{where(self.rank, self.ranks_per_node)}: {line}", node)
        self._linger()

    @contextmanager
    def reporting(self):
        """A failure in the block is reported to every process and becomes SystemExit: 2 for a user error, 1 for an
        exception (its traceback printed), the first reporter's code where another process failed first."""
        try:
            yield
        except UserError as err:
            self.report(2, one_line(err))
            raise SystemExit(2) from None
        except Exception as err:
            if interrupted():  # Ctrl-C broke it on its way out (errors.catch_ctrl_c); said by train.py
                raise SystemExit(INTERRUPTED_EXIT_CODE) from None
            # A broken collective is seldom the cause: a peer's failure is, reported by the peer or, for a peer a
            # signal ended, by its launcher, or by a watchdog whose lifeline to it closed (within a beat and a
            # second); a store gone with its holder (rank 0 killed) is said by the launcher.
            if found := self.failure(wait_s=self.interval + 3):
                raise SystemExit(found[0]) from None
            traceback.print_exc()
            self.report(1, f"{type(err).__name__}: {one_line(err)}")
            raise SystemExit(1) from None
        finally:
            self.stop()

    def failure(self, wait_s: float = 0) -> tuple[int, str, int] | None:
        """What another process reported, waiting up to `wait_s` (its launcher reports a peer a signal killed)."""
        deadline, reached = time.monotonic() + wait_s, False
        while True:
            try:
                found, reached = failure(client(self.address, self.port, timeout_s=2)), True
            except Exception:
                found = None
            if found:
                return found
            if time.monotonic() >= deadline:
                return None if reached or not wait_s else (1, "the run's store is gone", 0)
            time.sleep(0.2)

    def stop(self) -> None:
        self.stopping.set()
        if self.lifeline is not None:  # its peers read "bye": this process leaves on its own
            self.lifeline.close()
        self._launcher_is_gone()  # said here where another rank saw it first and the run stopped before this beat

    def _beat(self) -> None:
        try:
            self._beating()
        except Exception as err:  # a bug of ours: said, never a peer that "has not answered"
            traceback.print_exc()
            self.report(1, f"its watchdog failed ({type(err).__name__}: {one_line(err)})")
            self._leave(1)

    def _beating(self) -> None:
        prefix = key_prefix()
        watched = range(self.world) if self.rank == 0 else [0]
        seen = {rank: (-1, time.monotonic()) for rank in watched}  # rank: (counter, when it last moved)
        stall = Stall(self.stall_timeout_s, partial(where, ranks_per_node=self.ranks_per_node))  # judged by rank 0
        store, wait = None, 0.0  # the first beat at once: it says where this process runs (host, pid)
        relayed = False  # another rank's stop request, to this one (callbacks/stop_agreement.py)
        while not self.stopping.is_set():
            if self.lifeline is not None:  # it wakes the beat at once where a peer's closes; a stop signal does too
                self.lifeline.wait(wait)
            else:
                select.select([self.signals], [], [], wait)
            if self.stopping.is_set():
                break
            wait = self.interval if self.lifeline is not None else 0.5  # held from the first seconds of the run
            self._stop_if_asked()
            if self._launcher_is_gone():  # stop as a stop signal would: save last.ckpt at one step, exit 143
                os.kill(os.getpid(), self.stop_signal)
            lost = self.lifeline.gone() if self.lifeline is not None else []  # first: the one gone may hold the store
            if lost and not self.stopping.wait(1.0):  # a second for a launcher, or the process itself, to say why
                node = self.rank // self.ranks_per_node  # a peer of its node (not host) that ended: its launcher
                pid = pid_here(store, lost[0]) if lost[0] // self.ranks_per_node == node else None
                if self.parent == "train.py" and pid and gone(pid):
                    self._leave((failure(store) or (LOST_EXIT_CODE,))[0])  # names its signal once this one left
                line = f"{where(lost[0], self.ranks_per_node)} is gone: its connection closed"
                say = answers(store) or self.rank % self.ranks_per_node == 0  # store gone: one line a node
                report(store, LOST_EXIT_CODE, f"{line} (killed, or its node lost); {STOPS}", node, say=say)
                self._leave((failure(store) or (LOST_EXIT_CODE,))[0])
            try:
                if not answers(store):  # none yet, or its server gone: never called then (torch's C++ traces)
                    store = client(self.address, self.port, self.timeout_s)
                    key = f"{prefix}/process/{self.rank}"
                    store.set(key, signed(key, f"{socket.gethostname()} {os.getpid()}"))
                if not relayed and stop_requested(store, prefix):  # a stop signal that reached other ranks only
                    os.kill(os.getpid(), self.stop_signal)
                    relayed = True
                store.add(f"{prefix}/beat/{self.rank}", 1)
                store.set(key := f"{prefix}/progress/{self.rank}", signed(key, self._progress()))
                if found := failure(store):
                    self._leave(found[0])
                now = time.monotonic()
                if self.lifeline is None and (self.rank == 0 or published_port(store, prefix) is not None):
                    self.lifeline = Lifeline(store, prefix, self.address, self.rank, self.signals)
                if self.rank == 0 and (line := stall.check(read_progress(store, prefix, self.world), now)):
                    report(store, LOST_EXIT_CODE, line)
                    self._leave(failure(store)[0])
                for rank in watched:
                    counter = store.add(f"{prefix}/beat/{rank}", 0)
                    # a rank not yet started (imports, a slow node) gets STARTUP_S at least
                    allowed = self.timeout_s if counter else max(self.timeout_s, STARTUP_S)
                    if counter != seen[rank][0]:
                        seen[rank] = (counter, now)
                    elif now - seen[rank][1] > allowed and not self.stopping.is_set() and not runs_here(store, rank):
                        silent = now - seen[rank][1]  # measured: past the bound by up to a beat
                        line = f"{where(rank, self.ranks_per_node)} has not answered for {silent:.0f} s (killed,"
                        report(
                            store, LOST_EXIT_CODE, f"{line} stopped, or its node lost); every process of the run stops"
                        )
                        if self.kills_stopped_peers:
                            kill_if_stopped_here(store, rank)
                        self._leave(failure(store)[0])
                self.answered, self.ever_answered = time.monotonic(), True
            except (OSError, RuntimeError):  # the store unreachable (torch's store errors): retried; the timer ends
                store = None  # this process if it stays so

    def _stop_if_asked(self) -> None:
        """The stop signals that came since the last beat, told the run's stop handling (SaveOnSigterm.unheeded)."""
        try:
            signals = self.signals.recv(64)
        except BlockingIOError:
            signals = b""
        from starter.callbacks.preemption import SaveOnSigterm  # imported by the run already

        if SaveOnSigterm.listening is not None and not self.stopping.is_set():
            SaveOnSigterm.listening.unheeded(signals)

    def _progress(self) -> str:
        """'boundaries|loops|where the main thread is' (where: when the count has not moved since the last beat)."""
        from starter.callbacks.batch_ticks import BatchTicks  # imported by the run already: Lightning is loaded

        boundaries, loops = BatchTicks.boundaries, BatchTicks.loops
        at = main_thread_at() if boundaries == self.boundaries else ""
        self.boundaries = boundaries
        return f"{boundaries}|{loops}|{at}"

    def _launcher_is_gone(self) -> bool:
        """True once, to the first caller (the beat or stop()) that finds its train.py gone; local rank 0 says it."""
        with self.saying:
            pid = self.launcher_pid
            if not pid or not gone(pid):
                return False
            self.launcher_pid, self.launcher_left = None, True
        if self.rank % self.ranks_per_node == 0:
            node = self.rank // self.ranks_per_node
            to_stderr(
                f"error: node {node}'s launcher ({self.parent}, pid {pid}) is gone; its workers save"
                " checkpoints/last.ckpt and stop"
            )
        return True

    def _time_the_store(self) -> None:
        """Ends this process when the store has not answered for the heartbeat timeout; not where its holder is this
        host's train.py, alive and not stopped (slow: a loaded machine), nor for a time this process did not run
        itself (stopped, then continued: said so, where the store went meanwhile). One line a node."""
        ticked = time.monotonic()
        while not self.stopping.wait(1.0):
            now, allowed = time.monotonic(), self.timeout_s if self.ever_answered else max(self.timeout_s, STARTUP_S)
            if now - ticked > max(5.0, 2 * self.interval):  # this process did not run meanwhile
                self.answered = max(self.answered, now - (now - ticked) / 2)  # a beat's chance before judging
                if not listening(self.address, self.port):
                    self._end(
                        f"{where(self.rank, self.ranks_per_node)} did not run for {now - ticked:.0f} s (stopped, or"
                        " starved); the run's store is gone meanwhile: the others ended the run"
                    )
            ticked = now
            if self.launcher_left:  # its store went with it: stop_grace_s to save
                allowed = max(allowed, self.stop_grace_s)
            here = self.parent == "train.py" and self.rank < self.ranks_per_node and runs(self.launcher_pid or 0)
            if now - self.answered > allowed + self.interval and not here:
                holder = f"{self.store_holder}, which serves the run's store at {self.address}:{self.port}, has"
                self._end(f"{holder} not answered for {now - self.answered:.0f} s (killed, stopped, or its node lost)")

    def _end(self, line: str) -> None:
        """This process ended with `line`, said by its node's first rank (each process of a node finds the same)."""
        if self.rank % self.ranks_per_node == 0:
            to_stderr(f"error: {line}; {STOPS}")
        os._exit(LOST_EXIT_CODE)

    def _leave(self, code: int) -> None:
        if self.stopping.is_set():
            return  # this process is ending on its own
        self._linger()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _linger(self) -> None:
        if self.serves_store:
            time.sleep(linger_s(self.timeout_s))


def pid_here(store, rank: int, prefix: str | None = None) -> int | None:
    """The pid of the process of `rank` (its first beat publishes "host pid", proven: a stranger's record could name
    any process of this host to be signalled), where it runs on this host."""
    key = f"{prefix or key_prefix()}/process/{rank}"
    try:
        record = read_signed(store, key) if answers(store) else None
    except (OSError, RuntimeError):
        return None
    host, _, pid = (record or "").partition(" ")
    return int(pid) if host == socket.gethostname() and pid.isdigit() else None


def runs_here(store, rank: int) -> bool:
    """Whether the process of `rank` runs on this host, alive and not stopped: a loaded machine's, slow, not lost."""
    return (pid := pid_here(store, rank)) is not None and runs(pid)


def kill_if_stopped_here(store, rank: int) -> None:
    """SIGKILL the process of `rank` if it runs on this host and is stopped ("T"; not "t": a debugger holds it)."""
    if (pid := pid_here(store, rank)) and process_state(pid) == "T":
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass  # gone meanwhile, or not ours to kill


def watch_external_ranks(launcher: str, ranks_per_node: int, timeout_s: float, stall_timeout_s: float) -> Watchdog:
    """The watchdog of a rank torchrun or srun started. Rank 0 serves the run's store and every rank is its client
    in init_process_group too (torch's agent-store contract), so a rank that fails before the group exists is seen."""
    store = _torchrun_store if launcher == "torchrun" else partial(_scheduler_store, launcher)
    rank, world, address, port, served = store(max(timeout_s, STARTUP_S))  # rank 0 may start slower
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    torchrun = launcher == "torchrun"  # its node's agent is the launcher: the rank stops if that is gone
    watchdog = Watchdog(address, port, rank, world, ranks_per_node, timeout_s, stall_timeout_s, "rank 0 (node 0)",
                        serves_store=served is not None, launcher_pid=os.getppid() if torchrun else None,
                        parent="torchrun's agent" if torchrun else None)  # fmt: skip
    watchdog.served = served  # held for as long as this process runs
    return watchdog


def _torchrun_store(timeout_s: float):
    """A fresh store per attempt (a restarted gloo group would read the old one's addresses in the agent's): where the
    agents share one, on a port the OS picks, told there; else (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) at MASTER_PORT."""
    if not torchrun_agents_share_their_store():
        return _scheduler_store("torchrun", timeout_s)
    rank, world, address = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"]
    agent = client(address, int(os.environ["MASTER_PORT"]), timeout_s)
    key = f"{key_prefix()}/store_port"
    served = serve_store(address) if rank == 0 else None
    if served is not None:
        agent.set(key, str(served.port))
    port = int(agent.get(key).decode())  # waits for rank 0
    return rank, world, address, port, served


def _scheduler_store(launcher: str, timeout_s: float):
    """Where Lightning's environment of the scheduler meets (SLURM: MASTER_ADDR/PORT, else the first node and a port
    from the job id; Kubeflow: MASTER_ADDR/PORT; LSF: the first host of the rank file and MASTER_PORT or the job id)."""
    scheduler = cluster_environment(launcher)
    rank, world = scheduler.global_rank(), scheduler.world_size()
    address, port = scheduler.main_address, scheduler.main_port
    if rank != 0:
        return rank, world, address, port, None
    try:
        served = serve_store(address, port)
    except Exception as err:
        raise UserError(
            f"rank 0 cannot serve the run's store at {address}:{port} ({one_line(err)}); set MASTER_PORT"
            " to a free port for every task"
        ) from None
    return rank, world, address, port, served
