"""One process of a multi-process run: `forked(env, RUN_DIR/config.yaml)`, started by launch/launcher.py from its
fork server, or `python -m starter.worker RUN_DIR/config.yaml` with the torch.distributed environment set.

Reads the resolved config (no Hydra here), so every worker trains exactly the job its parent was given.
"""

import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path

from omegaconf import OmegaConf

from starter.fork_server import SERVER_IGNORES
from starter.launch.launcher import join_rendezvous, name_process
from starter.launch.quick_exit import quick_exit
from starter.launch.watchdog import Watchdog

# What the launcher's fork server imports once, before it forks any worker: torch and Lightning; none of it asks
# CUDA anything (a CUDA driver initialised before a fork fails in the forked workers).
PRELOAD = ("starter.worker", "starter.run")


def forked(env: dict, config_path: str, port_to=None) -> None:
    """A worker forked by the launcher's fork server, which has imported torch and Lightning already."""
    for signum in SERVER_IGNORES:  # the server ignores the scheduler's signals; a worker acts on them
        signal.signal(signum, signal.SIG_DFL)
    multiprocessing.set_start_method(None, force=True)  # what else it starts: the platform's way, not the server's
    os.environ.clear()
    os.environ.update(env)
    sys.exit(main(config_path, port_to))


def main(config_path: str, port_to=None) -> int:
    rank = int(os.environ.get("RANK", 0))
    name_process(f"rank {rank}")
    cfg = OmegaConf.load(config_path)
    handlers = [logging.StreamHandler()]
    if rank == 0:  # rank 0 continues the run's log file; other ranks only warn, so no console line is repeated
        handlers.append(logging.FileHandler(Path(cfg.paths.output_dir) / "train.log"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s",
        handlers=handlers,
    )
    import torch

    from starter.run import run  # torch and Lightning: imported already where the fork server forked this

    if threads := os.environ.get("OMP_NUM_THREADS"):  # read by OpenMP when torch loaded: maybe in the fork server
        torch.set_num_threads(int(threads))
    store = join_rendezvous(port_to)  # rank 0 serves the store for as long as it runs (one node)
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    holder = "rank 0 (node 0)" if int(cfg.num_nodes) == 1 else "node 0's train.py"
    address, port, world = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"])
    watchdog = Watchdog(address, port, rank, world, per_node, cfg.heartbeat_timeout_s, cfg.stall_timeout_s,
                        store_holder=holder, serves_store=store is not None, launcher_pid=_launcher_pid(),
                        stop_signal=signal.Signals[(list(cfg.stop_signals) or ["SIGTERM"])[0]])  # fmt: skip
    with watchdog.reporting():  # a failure: reported to every process, SystemExit with its code
        run(cfg)
    return 0


def _launcher_pid() -> int | None:
    """Our launcher's pid (launcher.py sets it), which a worker watches; None under `python -m starter.worker`."""
    pid = os.environ.get("STARTER_LAUNCHER_PID")
    return int(pid) if pid else None


if __name__ == "__main__":
    with quick_exit():
        sys.exit(main(sys.argv[1]))
