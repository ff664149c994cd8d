"""Starts one worker process per device for strategies whose traits name a launcher (ddp, ddp_spawn, fsdp, tp, pp).

Lightning's own launcher re-runs `sys.argv` in every child, which under Hydra re-composes the config, makes a second
run directory and re-launches a sweep: here the Hydra job only launches, and every worker runs its resolved config.
Workers fork from one fork server that imported torch and Lightning once (ddp_spawn's are spawned). On one machine
rank 0 serves the rendezvous store on a port the OS picks and holds it, so runs started at once cannot race for a port;
on several nodes node 0's job serves it at MASTER_PORT (`join_nodes`). Details: docs/modes.md, "How ddp is launched".
"""

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path

from starter.errors import PREEMPTED_EXIT_CODE
from starter.launch.fork_server import fork_server
from starter.launch.watchdog import client, failure, process_state, report, serve_store, where
from starter.topology import Layout

# torch's agent-store contract (torchrun's): every rank, rank 0 included, is a client of a store served apart.
AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
STOPPED = ("T", "t")  # process states of a process that cannot act on a signal: stopped, or held by a debugger
_node_store = None  # the store the jobs of several nodes share, held (node 0: served) for as long as this job runs


class WorkerFailed(Exception):
    """The job's exit code; `message` is None where the failing process has said why (or another node's did);
    `reported`: read from the run's store, where another node's process wrote it."""

    def __init__(self, message: str | None, exit_code: int, reported: bool = False, node: int | None = None):
        super().__init__(message)
        self.message, self.exit_code, self.reported, self.node = message, exit_code, reported, node


def join_nodes(serve: bool):
    """The store at MASTER_ADDR:MASTER_PORT that the nodes' jobs share (node 0's serves it) for the whole run."""
    global _node_store
    from torch.distributed import TCPStore

    _node_store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=serve,
                           wait_for_workers=False, timeout=timedelta(seconds=300))  # fmt: skip
    return _node_store


def node_store():
    """The store this job shares with the other nodes' jobs, or None (one node)."""
    return _node_store


def launch_workers(entry: Callable, job: str, preload: tuple[str, ...], config_path: Path, layout: Layout,
                   start_method: str = "forkserver", stop_signals=("SIGTERM",), grace_s: float = 10.0,
                   linger_s: float = 0.0) -> None:  # fmt: skip
    """Runs `entry(env, config_path, port_to, job)` in one process per device of this node."""
    devices = layout.processes_per_node
    node_rank = int(os.environ.get("NODE_RANK", 0))
    # STARTER_LAUNCHER_PID: each worker watches this process (launch/watchdog.py). OMP_NUM_THREADS as torchrun's:
    # the cores shared out, not every worker running a thread per core of the machine.
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // devices)))
    env = dict(os.environ, MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), NODE_RANK=str(node_rank),
               WORLD_SIZE=str(layout.world), LOCAL_WORLD_SIZE=str(devices), STARTER_LAUNCHER_PID=str(os.getpid()),
               OMP_NUM_THREADS=threads)  # fmt: skip
    ranks = [dict(env, LOCAL_RANK=str(i), RANK=str(node_rank * devices + i)) for i in range(devices)]
    # The store, served apart from init_process_group: on one node by rank 0 on a port the OS picks; on several
    # by node 0's job at MASTER_PORT (join_nodes). A port the user chose on one node: rank 0 serves it there.
    if not os.environ.get("MASTER_PORT") or node_store() is not None:
        ranks = [dict(r, **AGENT_STORE) for r in ranks]
    if found := failure(node_store()):  # another node failed before this one launched: said here too
        raise WorkerFailed(found[1], found[0], reported=True, node=found[2])
    procs: list[BaseProcess] = []
    received = []  # a stop signal (a scheduler's preemption or time-out) goes to every worker, which saves and exits
    server = fork_server(preload) if start_method == "forkserver" else multiprocessing.get_context(start_method)

    def start(env: dict, port_to=None) -> None:
        process = server.Process(target=entry, args=(env, str(config_path), port_to, job), name=f"rank {env['RANK']}")
        process.start()
        procs.append(process)
        if received:  # a stop signal came while the workers started: this one has not had it
            _signal(process, signal.Signals[received[0]])

    def forward(signum, frame) -> None:
        received.append(signal.Signals(signum).name)
        for p in procs:
            _signal(p, signum)

    previous = {signum: signal.signal(signum, forward) for signum in map(signal.Signals.__getitem__, stop_signals)}
    port = os.environ.get("MASTER_PORT")
    try:
        if port is None:
            port = _start_with_held_port(start, ranks)
        else:
            for rank_env in ranks:
                start(rank_env)
        _wait(procs, received, node_rank * devices, devices)
    except WorkerFailed as failed:
        if failed.message and not failed.reported and failed.exit_code != PREEMPTED_EXIT_CODE:
            # A worker a signal ended cannot say it: said here, once, and written in the run's store, where the
            # other processes read it (their broken collectives are not the cause) and leave with its code.
            holder = procs[0] if node_rank == 0 else None  # one node: rank 0 serves the store
            store = node_store() or _run_store(env["MASTER_ADDR"], port, holder)
            report(store, failed.exit_code, failed.message)
            failed.message = None
        # this job serves the store: the other nodes read the failure from it first, but for the one that wrote it
        if node_rank == 0 and node_store() is not None and not (layout.nodes == 2 and failed.node == 1):
            time.sleep(linger_s)
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop(procs, grace_s)


def _start_with_held_port(start: Callable, ranks: list[dict]) -> str | None:
    """Rank 0 serves the store on a port the OS picks and sends it through a pipe; the other ranks start with it.
    Returns the port, or None where rank 0 ended before it said (then _wait reports rank 0)."""
    receive, send = multiprocessing.Pipe(duplex=False)
    start(ranks[0], port_to=send)
    send.close()  # rank 0 holds the only sending end: reading ends when it sends or ends
    try:
        port = str(receive.recv())
    except EOFError:
        return None
    finally:
        receive.close()
    for rank_env in ranks[1:]:
        start(dict(rank_env, MASTER_PORT=port))
    return port


def _signal(process: BaseProcess, signum: int) -> None:
    try:
        os.kill(process.pid, signum)
    except ProcessLookupError:
        pass  # it has exited already


def _run_store(address: str, port: str | None, holder: BaseProcess | None):
    """A client of the store rank 0 serves on this node; None where rank 0 is gone or stopped (it would not answer)."""
    if holder is None or port is None or process_state(holder.pid) in STOPPED:
        return None
    try:
        return client(address, int(port), timeout_s=5)
    except Exception:
        return None


def join_rendezvous(port_to=None):
    """The worker's side of _start_with_held_port: rank 0 serves the store, sends its port and returns it."""
    if port_to is None:
        return None
    store = serve_store(os.environ["MASTER_ADDR"])
    os.environ["MASTER_PORT"] = str(store.port)
    with port_to:
        port_to.send(store.port)
    return store


def _wait(procs: list[BaseProcess], received: list[str], first_rank: int, per_node: int) -> None:
    """Until every worker exits 0; else raises for the first that failed. One a signal ended cannot say why: said here,
    with 128 + the signal's number (137 for SIGKILL, as shells and schedulers report it). Several nodes: also ends when
    another node's process has reported a failure in the store (this node's workers may be unable to leave)."""
    store, polls, node = node_store(), 0, first_rank // per_node

    def reported_elsewhere() -> WorkerFailed | None:  # another node's failure is said here too
        if found := failure(store):
            return WorkerFailed(found[1] if found[2] != node else None, found[0], reported=True, node=found[2])
        return None

    while True:
        codes = [p.exitcode for p in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if killed := [(rank, code) for rank, code in failed if code < 0]:
            lost, name = where(first_rank + killed[0][0], per_node), signal.Signals(-killed[0][1]).name
            raise WorkerFailed(f"{lost} was killed by {name}; every process of the run stops", 128 - killed[0][1])
        if failed:
            code = failed[0][1]
            if code == PREEMPTED_EXIT_CODE:
                name = received[0] if received else "a stop signal"
                raise WorkerFailed(f"stopped by {name} after saving checkpoints/last.ckpt; resume with ckpt_path=last",
                                   code)  # fmt: skip
            raise reported_elsewhere() or WorkerFailed(None, code)
        if all(code == 0 for code in codes):
            return
        polls += 1
        if polls % 5 == 0 and (failed := reported_elsewhere()):  # this node's workers may be unable to leave
            raise failed
        time.sleep(0.2)


def name_process(name: str) -> None:
    """`ps -o comm`, top and htop show which rank a process is (Linux: 15 characters)."""
    try:
        Path("/proc/self/comm").write_text(name[:15])
    except OSError:
        pass


def _stop(procs: list[BaseProcess], grace_s: float) -> None:
    """SIGTERM, and `grace_s` to leave; a stopped worker (SIGSTOP, a hung node's) cannot act on it: killed at once."""
    for p in procs:
        if p.exitcode is None:
            _signal(p, signal.SIGKILL if process_state(p.pid) in STOPPED else signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
