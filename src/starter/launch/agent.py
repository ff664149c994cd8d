"""Starts one worker per device of this node with torch's elastic agent, the engine inside torchrun
(`torch.distributed.launcher.api.elastic_launch`), for strategies whose traits name a start method (ddp, ddp_spawn,
fsdp, tp, pp).

Lightning's own launcher re-runs `sys.argv` in every child, which under Hydra re-composes the config, makes a second
run directory and re-launches a sweep: here the Hydra job only launches, and every worker runs its resolved config.
The agent's rendezvous is torchrun's static one (this node's rank: NODE_RANK, as `torchrun --node-rank`) at a store
that node 0's job serves: on one node on a free port (one another process takes first: the next); on several at
MASTER_PORT, the store that named the run (run_name.py). Workers fork from a fork server that imported torch and
Lightning once (ddp_spawn's are spawned). Inside each, our watchdog (watchdog.py) ends the run when a rank
fails, stops answering or stalls; here, a worker a signal killed is named, another node's failure ends this node's
workers, and a stopped worker is killed rather than waited for. Details: docs/modes.md, "How ddp is launched".
"""

import atexit
import hashlib
import importlib
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from starter.callbacks.stop_agreement import saved_step
from starter.config_choices import leaves
from starter.errors import LOST_EXIT_CODE, PREEMPTED_EXIT_CODE, USER_ERROR_EXIT_CODE, catch_ctrl_c
from starter.launch.fork_server import SERVER_IGNORES, fork_server
from starter.launch.watchdog import failure, process_state, report, where
from starter.topology import Layout, key_prefix

STOPPED = ("T", "t")  # process states of a process that cannot act on a signal: stopped, or held by a debugger
_node_store = None  # the store this job serves (node 0) or shares, held for as long as it runs


class WorkerFailed(Exception):
    """The job's exit code; `message` is None where the failing process has said why; `node`: the node whose process
    reported it in the run's store."""

    def __init__(self, message: str | None, exit_code: int, node: int | None = None):
        super().__init__(message)
        self.message, self.exit_code, self.node = message, exit_code, node


def join_nodes(address: str, port: int, serve: bool, timeout_s: float = 300.0):
    """The store at address:port (0: a free port) that the agent's rendezvous, the workers and the nodes' jobs share;
    node 0's job serves it. `multi_tenant`: the agent's rendezvous in this process serves through it, found by its
    port in torch's cache of servers. Never port 0: that cache keeps the entry of an ended store (an earlier job of a
    sweep) on a port the OS hands out again, and the rendezvous would then bind the port a second time (EADDRINUSE;
    after 63 stores in one process here)."""
    global _node_store
    from torch.distributed import DistNetworkError, TCPStore

    options = {
        "is_master": serve,
        "wait_for_workers": False,
        "multi_tenant": True,
        "timeout": timedelta(seconds=timeout_s),
    }
    for attempt in range(5):
        try:
            _node_store = TCPStore(address, port or free_port(address), **options)
            return _node_store
        except DistNetworkError:
            if port or attempt == 4:
                raise  # else another process took the free port first: another


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def node_store():
    """The store this job serves or shares with the other nodes' jobs; None before either."""
    return _node_store


def start_workers(
    job: str,
    preload: tuple[str, ...],
    config_path: Path,
    layout: Layout,
    run_id: str,
    start_method: str = "forkserver",
    stop_signals=("SIGTERM",),
    grace_s: float = 10.0,
    linger_s: float = 0.0,
    wait_s: float = 300.0,
    meeting: str = "",
) -> None:
    """Runs `job` ("module:function") with the config at `config_path` in one worker per device of this node.
    `meeting`: what this node's config must agree on with node 0's (meeting_config)."""
    devices, node = layout.processes_per_node, int(os.environ.get("NODE_RANK", 0))
    # OMP_NUM_THREADS as torchrun's: the cores shared out, not every worker running a thread per core of the machine
    threads = int(os.environ.get("OMP_NUM_THREADS", max(1, len(os.sched_getaffinity(0)) // devices)))
    if start_method == "forkserver":
        fork_server(preload)  # first: its imports and this process's (the agent's torch) overlap
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    elastic = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    for name in [*elastic, *logging.Logger.manager.loggerDict]:  # our lines say what failed; each of torch's elastic
        if name.startswith(elastic):  # modules sets a level of its own ("Received 15 death signal...": a warning)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT") or 0)
    store = (layout.nodes > 1 and node_store()) or join_nodes(address, port, serve=node == 0)
    prefix = key_prefix(run_id)
    _all_nodes_here(store, prefix, layout.nodes, node, wait_s, meeting)
    config = LaunchConfig(
        min_nodes=layout.nodes,
        max_nodes=layout.nodes,
        nproc_per_node=devices,
        run_id=run_id,
        rdzv_backend="static",
        rdzv_endpoint=f"{address}:{store.port}",
        rdzv_configs={"rank": node},
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull),
        signals_to_handle=",".join(stop_signals or ["SIGTERM"]),
        shutdown_timeout=int(grace_s),
    )
    oversight = Oversight(store, prefix, node, devices)
    try:
        elastic_launch(config, work)(str(config_path), job, dict(os.environ, OMP_NUM_THREADS=str(threads)), os.getpid())
    except SignalException as stop:  # the agent forwarded it to the workers and gave them `grace_s` to end
        raise WorkerFailed(
            stopped_line(signal.Signals(stop.sigval).name, store, prefix, grace_s), PREEMPTED_EXIT_CODE
        ) from None
    except ChildFailedError as err:
        failed = oversight.failed(err.get_first_failure())
        # this job serves the store: the other nodes read the failure from it first, but for the one that wrote it
        if node == 0 and layout.nodes > 1 and not (layout.nodes == 2 and failed.node == 1):
            time.sleep(linger_s)
        raise failed from None
    finally:
        oversight.stop()


def stopped_line(name: str, store, prefix: str, grace_s: float) -> str:
    """What a stop signal to the launcher ended with: "after saving" only where rank 0 said last.ckpt is in place."""
    if (step := saved_step(store, prefix)) is not None:
        return f"stopped by {name} at step {step} after saving checkpoints/last.ckpt; resume with ckpt_path=last"
    return (
        f"stopped by {name}; checkpoints/last.ckpt was not saved: the workers did not reach the end of a step and save"
        f" within stop_grace_s={grace_s:g} (raise it above a step and a save); ckpt_path=last resumes from the newest"
        " checkpoint kept, if any"
    )


def _all_nodes_here(store, prefix: str, nodes: int, node: int, wait_s: float, config: str) -> None:
    """Until every node's job is ready to launch with the config node 0's has (`config`: meeting_config); raises
    where another node failed before (it said why: said here too), has not come within `wait_s` (the agent's
    rendezvous would wait for it far longer, in a call nothing ends), or runs another config (every node says which)."""
    store.set(f"{prefix}/config/{node}", config)
    store.set(f"{prefix}/ready/{node}", hashlib.sha256(config.encode()).hexdigest())
    deadline = time.monotonic() + wait_s
    while True:
        if found := failure(store, prefix):
            raise WorkerFailed(found[1], found[0], node=found[2])
        missing = [n for n in range(nodes) if not store.check([f"{prefix}/ready/{n}"])]
        if not missing:
            break
        if time.monotonic() > deadline:
            who = f"nodes {', '.join(map(str, missing))} have" if len(missing) > 1 else f"node {missing[0]} has"
            line = f"{who} not started within {wait_s:.0f} s; start train.py on every node with the same MASTER_ADDR"
            raise WorkerFailed(f"{line} and MASTER_PORT", LOST_EXIT_CODE)
        time.sleep(0.2)
    fingerprints = [store.get(f"{prefix}/ready/{n}") for n in range(nodes)]
    other = next((n for n in range(1, nodes) if fingerprints[n] != fingerprints[0]), None)
    if other is None:
        return
    line = disagreement(other, *(json.loads(store.get(f"{prefix}/config/{n}")) for n in (other, 0)))
    store.set(f"{prefix}/told/{node}", "")
    while node == 0 and time.monotonic() < deadline and not store.check([f"{prefix}/told/{n}" for n in range(nodes)]):
        time.sleep(0.2)  # this job serves the store: until every node has read what it says
    raise WorkerFailed(line, USER_ERROR_EXIT_CODE, node=other)


NODE_OWN = ("paths", "log_file", "ckpt_path")  # keys a node may set for itself: its directories, its run's resume


def meeting_config(cfg) -> str:
    """What every node's job must agree on: its config as composed, not resolved (a value may name the node's own
    directory), but the keys each node may set for itself."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(cfg, resolve=False)
    return json.dumps({key: value for key, value in config.items() if key not in NODE_OWN}, sort_keys=True)


def disagreement(node: int, theirs: dict, ours: dict) -> str:
    """One line: how node `node`'s config differs from node 0's (a few keys)."""
    mine, first = leaves(theirs), leaves(ours)
    differing = sorted(key for key in mine.keys() | first.keys() if mine.get(key, "-") != first.get(key, "-"))
    shown = ", ".join(f"{key}={mine.get(key, '(none)')} (node 0: {first.get(key, '(none)')})" for key in differing[:3])
    more = f" and {len(differing) - 3} more" if len(differing) > 3 else ""
    return (
        f"node {node} runs another config than node 0: {shown}{more}; start every node with the same command and"
        " overrides (NODE_RANK apart), or give another run its own MASTER_PORT"
    )


class Oversight:
    """What the agent does not do: ends this node's workers when another node's process has reported a failure, and
    kills a stopped worker as soon as the agent is stopping it (it cannot act on the agent's SIGTERM, after which the
    agent waits 30 s before a SIGKILL). Not before: the agent names the first worker that ended, not one killed here."""

    def __init__(self, store, prefix: str, node: int, per_node: int):
        self.store, self.prefix, self.node, self.per_node = store, prefix, node, per_node
        self.found: WorkerFailed | None = None
        self.pids: dict[int, int] = {}  # rank: pid, of this node's workers
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="oversight", daemon=True)
        self.thread.start()

    def failed(self, first) -> WorkerFailed:
        """WorkerFailed for the agent's first failure: `(global rank, ProcessFailure)`."""
        rank, process = first
        if found := self._reported():
            return found
        if process.exitcode < 0:  # a signal ended it: it could not say so; said here and told to the other nodes
            line = f"{where(rank, self.per_node)} was killed by {process.signal_name()}; every process of the run stops"
            report(self.store, 128 - process.exitcode, line, self.node, self.prefix)
            return WorkerFailed(None, 128 - process.exitcode)
        if process.exitcode == PREEMPTED_EXIT_CODE:
            return WorkerFailed(
                "stopped by a stop signal after saving checkpoints/last.ckpt; resume with ckpt_path=last",
                PREEMPTED_EXIT_CODE,
            )
        return WorkerFailed(None, process.exitcode)  # it said why

    def _reported(self) -> WorkerFailed | None:
        if found := failure(self.store, self.prefix):
            self.found = WorkerFailed(found[1] if found[2] != self.node else None, found[0], found[2])
        return self.found

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
        for rank in range(first, first + self.per_node):
            key = f"{self.prefix}/process/{rank}"
            try:
                if rank not in self.pids and self.store.check([key]):
                    self.pids[rank] = int(self.store.get(key).decode().split()[1])
            except Exception:
                break  # the store is gone: the watchdogs say so
        return list(self.pids.values())

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def work(config_path: str, job: str, env: dict, launcher_pid: int) -> None:
    """A worker: forked by the fork server (torch and Lightning imported already), or spawned. `env`: the job's
    environment (a fork server has the first job's), under the variables the agent set for this rank."""
    from omegaconf import OmegaConf

    from starter.launch.watchdog import Watchdog
    from starter.loggers.console import set_up_logging

    for signum in SERVER_IGNORES:  # the server ignores the scheduler's signals; a worker acts on them
        signal.signal(signum, signal.SIG_DFL)
    catch_ctrl_c()
    multiprocessing.set_start_method(None, force=True)  # what else it starts: the platform's way, not the server's
    agents = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_"))
        or k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    }
    os.environ.clear()
    os.environ.update(env, **agents)
    rank = int(os.environ["RANK"])
    name_process(f"rank {rank}")
    cfg = OmegaConf.load(config_path)
    # rank 0 continues the run's log file and console; other ranks only warn, so no console line is repeated
    set_up_logging(
        Path(cfg.log_file) if rank == 0 else None,
        logging.INFO if rank == 0 else logging.WARNING,
        bool(cfg.get("verbose")),
    )
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # read by OpenMP when torch loaded: maybe in the fork server
    module, name = job.split(":")
    run = getattr(importlib.import_module(module), name)  # torch and Lightning: imported already where forked
    per_node, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    watchdog = Watchdog(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        rank,
        world,
        per_node,
        cfg.heartbeat_timeout_s,
        cfg.stall_timeout_s,
        store_holder="node 0's train.py",
        launcher_pid=launcher_pid,
        stop_signal=signal.Signals[(list(cfg.stop_signals) or ["SIGTERM"])[0]],
    )
    try:
        with watchdog.reporting():  # a failure: reported to every process, SystemExit with its code
            run(cfg)
    except SystemExit as stop:
        # After multiprocessing's own end of the process, no teardown: a forked worker ends so anyway, a spawned one
        # would free every module first (the exit hooks run last registered first).
        atexit.register(os._exit, stop.code)
        sys.exit(stop.code)


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


def name_process(name: str) -> None:
    """`ps -o comm`, top and htop show which rank a process is (Linux: 15 characters)."""
    try:
        Path("/proc/self/comm").write_text(name[:15])
    except OSError:
        pass
