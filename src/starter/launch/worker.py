"""A worker of torch's elastic agent: one rank, forked by the fork server (torch and Lightning imported already) or
spawned, that runs the job on the resolved config under our watchdog."""

import atexit
import importlib
import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path

from starter.errors import catch_ctrl_c
from starter.fork_server import SERVER_IGNORES


def work(config_path: str, job: str, env: dict, launcher_pid: int) -> None:
    """A worker: forked by the fork server (torch and Lightning imported already), or spawned. `env`: the job's
    environment (a fork server has the first job's), under the variables the agent set for this rank."""
    from omegaconf import OmegaConf

    from starter.launch.watchdog import Watchdog
    from starter.loggers.console import set_up_logging, show_project

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
    set_up_logging(Path(cfg.log_file) if rank == 0 else None, logging.INFO if rank == 0 else logging.WARNING,
                   bool(cfg.get("verbose")))  # fmt: skip
    show_project(cfg)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # read by OpenMP when torch loaded: maybe in the fork server
    module, name = job.split(":")
    run = getattr(importlib.import_module(module), name)  # torch and Lightning: imported already where forked
    per_node, world = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    stop_signal = signal.Signals[(list(cfg.stop_signals) or ["SIGTERM"])[0]]
    watchdog = Watchdog(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world, per_node,
                        cfg.heartbeat_timeout_s, cfg.stall_timeout_s, "node 0's train.py", launcher_pid=launcher_pid,
                        stop_signal=stop_signal, stop_grace_s=cfg.stop_grace_s)  # fmt: skip
    try:
        with watchdog.reporting():  # a failure: reported to every process, SystemExit with its code
            run(cfg)
    except SystemExit as stop:
        # After multiprocessing's own end of the process, no teardown: a forked worker ends so anyway, a spawned one
        # would free every module first (the exit hooks run last registered first).
        atexit.register(os._exit, stop.code)
        sys.exit(stop.code)


def name_process(name: str) -> None:
    """`ps -o comm`, top and htop show which rank a process is (Linux: 15 characters)."""
    try:
        Path("/proc/self/comm").write_text(name[:15])
    except OSError:
        pass
