"""Starts one worker process per device for strategies whose traits name this launcher (ddp, fsdp, tp, pp).

Lightning's own launcher re-runs `sys.argv` in every child. Under Hydra that re-composes the config, makes a
second run directory, and inside a multirun re-launches the whole sweep. Here the parent Hydra job only
launches: each worker runs `python -m starter.worker <run_dir>/config.yaml` with the torch.distributed
environment set (the torchrun contract), so all ranks train the same resolved job into the same directory.
If one worker fails, the others are stopped and the job fails with its exit code; every process also runs a
watchdog (launch/watchdog.py) that ends the processes of every node when one fails, dies or stops answering.

On one machine (no MASTER_PORT given) rank 0 serves the rendezvous store on a port the OS picks (port 0) and
holds for the whole run, so two runs started at once cannot race for a port (a port merely found free here
and bound by rank 0 seconds later, after its torch import, could be taken in between). Rank 0 tells this
process the port through a pipe; it passes it on to the other ranks' stdin. This process never imports torch.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from starter.errors import PREEMPTED_EXIT_CODE
from starter.launch.environment import external_launcher
from starter.launch.run_name import shared_store
from starter.launch.watchdog import failure, report, where
from starter.topology import Layout
from starter.traits import Traits

PORT_PIPE = "STARTER_MASTER_PORT_PIPE"  # rank 0: write the port of the store it serves to this fd
PORT_ON_STDIN = "STARTER_MASTER_PORT_ON_STDIN"  # other ranks: read that port on stdin
# torch's agent-store contract (torchrun's): every rank, rank 0 included, is a client of a store served apart.
AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


def serve_store(address: str):
    """A rendezvous store on a port the OS picks (port 0), held for as long as the returned object lives."""
    from torch.distributed import TCPStore

    return TCPStore(address, 0, is_master=True, wait_for_workers=False)


class WorkerFailed(Exception):
    """The job's exit code; `message` is None where the failing process has said why (or another node's did)."""

    def __init__(self, message: str | None, exit_code: int):
        super().__init__(message)
        self.message, self.exit_code = message, exit_code


def needs_launch(cfg: DictConfig, layout: Layout) -> bool:
    """Whether this job starts the workers: a strategy this launcher starts, of several processes, that torchrun
    or SLURM did not start (LOCAL_RANK set by any other launcher also means the ranks exist)."""
    if Traits.of(cfg.strategy).launcher != "subprocess" or layout.world == 1 or "LOCAL_RANK" in os.environ:
        return False
    return external_launcher(layout.world) is None


def launch_workers(
    config_path: Path, layout: Layout, stop_signals=("SIGTERM",), grace_s: float = 10.0, linger_s: float = 0.0
) -> None:
    devices = layout.processes_per_node
    node_rank = int(os.environ.get("NODE_RANK", 0))
    env = dict(
        os.environ,
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        NODE_RANK=str(node_rank),
        WORLD_SIZE=str(layout.world),
        LOCAL_WORLD_SIZE=str(devices),
        # as torchrun: the cores shared out, not every worker running a thread per core of the machine
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // devices))),
    )
    command = [sys.executable, "-m", "starter.worker", str(config_path)]
    ranks = [dict(env, LOCAL_RANK=str(i), RANK=str(node_rank * devices + i)) for i in range(devices)]
    port_pipe = None
    if shared_store() is not None:  # several nodes: node 0's job serves the store at MASTER_PORT (run_name.py)
        procs = [subprocess.Popen(command, env=dict(rank_env, **AGENT_STORE)) for rank_env in ranks]
    elif os.environ.get("MASTER_PORT"):  # chosen by the user: rank 0 serves the store there
        procs = [subprocess.Popen(command, env=rank_env) for rank_env in ranks]
    else:
        procs, port_pipe = _start_with_held_port(command, ranks)
    # A stop signal (a scheduler's preemption or time-out) goes to every worker, which saves and exits; we wait.
    received = []

    def forward(signum, frame) -> None:
        received.append(signal.Signals(signum).name)
        for p in procs:
            p.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in map(signal.Signals.__getitem__, stop_signals)}
    port = os.environ.get("MASTER_PORT")
    try:
        if port_pipe is not None:
            port = _relay_port(port_pipe, procs[1:])
        _wait(procs, received, node_rank * devices)
    except WorkerFailed as failed:
        if failed.message and failed.exit_code != PREEMPTED_EXIT_CODE:
            # A worker a signal ended cannot say it: said here, once, and written in the run's store, where the
            # other processes read it (their broken collectives are not the cause) and leave with its code.
            holder = procs[0] if node_rank == 0 else None  # one node: rank 0 serves the store
            store = shared_store() or _run_store(env["MASTER_ADDR"], port, holder)
            report(store, failed.exit_code, failed.message)
            failed.message = None
        if node_rank == 0 and shared_store() is not None:
            time.sleep(linger_s)  # this job serves the store: the other nodes read the failure from it first
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop(procs, grace_s)


def _start_with_held_port(command: list[str], ranks: list[dict]):
    """Rank 0 serves the store on port 0 (the OS picks, rank 0 holds) and writes the port to a pipe; the
    other ranks read it on stdin. All ranks are clients of that store (torch's agent-store contract)."""
    read_end, write_end = os.pipe()
    rank0 = dict(ranks[0], **AGENT_STORE, **{PORT_PIPE: str(write_end)})
    procs = [subprocess.Popen(command, env=rank0, pass_fds=(write_end,))]
    os.close(write_end)
    procs += [subprocess.Popen(command, env=dict(r, **AGENT_STORE, **{PORT_ON_STDIN: "1"}), stdin=subprocess.PIPE,
                               text=True) for r in ranks[1:]]  # fmt: skip
    return procs, os.fdopen(read_end)


def _relay_port(port_pipe, others: list[subprocess.Popen]) -> str:
    with port_pipe:
        port = port_pipe.readline()  # "" if rank 0 ended first: _wait reports it
    for p in others:
        try:
            p.stdin.write(port)
            p.stdin.close()
        except BrokenPipeError:
            pass  # that worker has already exited; _wait reports it
    return port.strip()


def _run_store(address: str, port: str | None, holder: subprocess.Popen | None):
    """A client of the store rank 0 serves on this node (torch imported only now, on this failure path), or None:
    gone with rank 0, or rank 0 stopped (SIGSTOP), which never answers, and a client would wait on it for good."""
    if holder is None or port is None or _stopped(holder.pid):
        return None
    try:
        from starter.launch.watchdog import client

        return client(address, int(port), timeout_s=5)
    except Exception:
        return None


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def join_rendezvous():
    """The worker's side of _start_with_held_port (sets MASTER_PORT); rank 0 returns the store it serves."""
    if pipe := os.environ.get(PORT_PIPE):
        store = serve_store(os.environ["MASTER_ADDR"])
        os.environ["MASTER_PORT"] = str(store.port)
        with os.fdopen(int(pipe), "w") as f:
            f.write(f"{store.port}\n")
        return store
    if os.environ.get(PORT_ON_STDIN):
        port = sys.stdin.readline().strip()
        if not port:
            raise SystemExit(1)  # rank 0 ended before it could say; the launcher reports rank 0
        os.environ["MASTER_PORT"] = port
    return None


def _wait(procs: list[subprocess.Popen], received: list[str], first_rank: int) -> None:
    """Until every worker exits 0; else raises for the first that failed, with its code (128 + the signal's number
    for a worker a signal ended: 137 for SIGKILL, as a shell and schedulers report it). A worker that exits with a
    code has said why (watchdog.report); one a signal ended cannot, so this says it. Several nodes: also ends when
    a process of another node has reported a failure in the store (this node's workers may be unable to leave)."""
    store, polls = shared_store(), 0
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if killed := [(rank, code) for rank, code in failed if code < 0]:
            rank, code = killed[0]
            name = signal.Signals(-code).name
            lost = where(first_rank + rank, ranks_per_node=len(procs))
            raise WorkerFailed(f"{lost} was killed by {name}; every process of the run stops", 128 - code)
        if failed:
            code = failed[0][1]
            if code == PREEMPTED_EXIT_CODE:
                name = received[0] if received else "a stop signal"
                raise WorkerFailed(f"stopped by {name} after saving checkpoints/last.ckpt; resume with ckpt_path=last",
                                   code)  # fmt: skip
            raise WorkerFailed(None, code)
        if all(code == 0 for code in codes):
            return
        polls += 1
        if store is not None and polls % 5 == 0 and (found := _reported(store)):
            raise WorkerFailed(None, found[0])
        time.sleep(0.2)


def _reported(store):
    try:
        return failure(store)
    except Exception:  # node 0's job, which serves the store, has ended: this node's watchdogs tell why
        return None


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
