"""One process of a several-process run, started by launch/launcher.py with the torch.distributed environment set. It
reads the resolved config (no Hydra here) and runs `job` ("module:function", given by main.py)."""

import atexit
import importlib
import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path

from omegaconf import OmegaConf

from starter.launch.fork_server import SERVER_IGNORES
from starter.launch.launcher import join_rendezvous, name_process
from starter.launch.watchdog import Watchdog
from starter.loggers.console import set_up_logging


def forked(env: dict, config_path: str, port_to, job: str) -> None:
    """A worker started by the launcher: forked by its fork server (Lightning imported already), or spawned."""
    for signum in SERVER_IGNORES:  # the server ignores the scheduler's signals; a worker acts on them
        signal.signal(signum, signal.SIG_DFL)
    multiprocessing.set_start_method(None, force=True)  # what else it starts: the platform's way, not the server's
    os.environ.clear()
    os.environ.update(env)
    try:
        code = main(config_path, port_to, job)
    except SystemExit as stop:
        code = stop.code
    # After multiprocessing's own end of the process, no teardown: a forked worker ends so anyway, a spawned one
    # would free every module first (the exit hooks run last registered first).
    atexit.register(os._exit, code)
    sys.exit(code)


def main(config_path: str, port_to, job: str) -> int:
    rank = int(os.environ.get("RANK", 0))
    name_process(f"rank {rank}")
    cfg = OmegaConf.load(config_path)
    # rank 0 continues the run's log file and console; other ranks only warn, so no console line is repeated
    log_file = Path(cfg.log_file) if rank == 0 else None
    set_up_logging(log_file, logging.INFO if rank == 0 else logging.WARNING, bool(cfg.get("verbose")))
    import torch

    module, name = job.split(":")
    run = getattr(importlib.import_module(module), name)  # torch and Lightning: imported already where forked

    if threads := os.environ.get("OMP_NUM_THREADS"):  # read by OpenMP when torch loaded: maybe in the fork server
        torch.set_num_threads(int(threads))
    store = join_rendezvous(port_to)  # rank 0 serves the store for as long as it runs (one node)
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    holder = "rank 0 (node 0)" if int(cfg.num_nodes) == 1 else "node 0's train.py"
    address, port, world = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"])
    watchdog = Watchdog(address, port, rank, world, per_node, cfg.heartbeat_timeout_s, cfg.stall_timeout_s,
                        store_holder=holder, serves_store=store is not None,
                        launcher_pid=int(os.environ["STARTER_LAUNCHER_PID"]),  # set by our launcher, which it watches
                        stop_signal=signal.Signals[(list(cfg.stop_signals) or ["SIGTERM"])[0]])  # fmt: skip
    with watchdog.reporting():  # a failure: reported to every process, SystemExit with its code
        run(cfg)
    return 0
