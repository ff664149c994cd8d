"""Starts one worker process per device for strategies that re-run the program per rank (ddp, fsdp).

Lightning's own launcher re-runs `sys.argv` in every child. Under Hydra that re-composes the config, makes a
second run directory, and inside a multirun re-launches the whole sweep. Here the parent Hydra job only
launches: each worker runs `python -m starter.worker <run_dir>/config.yaml` with the torch.distributed
environment set (the torchrun contract), so all ranks train the same resolved job into the same directory.
If one worker fails, the others are stopped and the job fails with its exit code.

On one machine (no MASTER_PORT given) the rendezvous store lives in this process, as under torchrun: bound to a
port the OS picks and held for the whole run, so two runs started at once cannot race for a port (a port
merely found free and bound seconds later by rank 0 could be taken in between). The workers learn it on
stdin, after they have started importing torch.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from starter.config import device_count, world_size
from starter.errors import PREEMPTED_EXIT_CODE


PORT_ON_STDIN = "STARTER_MASTER_PORT_ON_STDIN"


class WorkerFailed(Exception):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def processes_exist() -> bool:
    """torchrun (LOCAL_RANK) or SLURM with one task per device (SLURM_NTASKS > 1) started every rank already."""
    return "LOCAL_RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def needs_launch(cfg: DictConfig) -> bool:
    return cfg.strategy.get("launcher") == "subprocess" and world_size(cfg) > 1 and not processes_exist()


def launch_workers(config_path: Path, cfg: DictConfig, grace_s: float = 10.0) -> None:
    devices = device_count(cfg.devices)
    node_rank = int(os.environ.get("NODE_RANK", 0))
    host_store = not os.environ.get("MASTER_PORT")
    env = dict(
        os.environ,
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        NODE_RANK=str(node_rank),
        WORLD_SIZE=str(world_size(cfg)),
    )
    if host_store:  # every rank is a client of the store this process serves (torch's agent-store contract)
        env |= {PORT_ON_STDIN: "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    command = [sys.executable, "-m", "starter.worker", str(config_path)]
    procs = [
        subprocess.Popen(
            command,
            env=dict(env, LOCAL_RANK=str(i), RANK=str(node_rank * devices + i)),
            stdin=subprocess.PIPE if host_store else None,
            text=True,
        )
        for i in range(devices)
    ]
    # A scheduler's SIGTERM (preemption) goes to every worker, which saves and exits; we then wait for them.
    previous = signal.signal(signal.SIGTERM, lambda *_: [p.send_signal(signal.SIGTERM) for p in procs])
    try:
        store = _serve_rendezvous(env["MASTER_ADDR"], procs) if host_store else None  # noqa: F841 (held open)
        _wait(procs)
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(procs, grace_s)


def _serve_rendezvous(address: str, procs: list[subprocess.Popen]):
    from torch.distributed import TCPStore

    store = TCPStore(address, 0, is_master=True, wait_for_workers=False)  # port 0: the OS picks a free one
    for p in procs:
        try:
            p.stdin.write(f"{store.port}\n")
            p.stdin.close()
        except BrokenPipeError:
            pass  # that worker has already exited; _wait reports it
    return store


def _wait(procs: list[subprocess.Popen]) -> None:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            message = f"worker of local rank {rank} exited with code {code}; the other workers were stopped"
            if code == PREEMPTED_EXIT_CODE:
                message = "stopped by SIGTERM after saving checkpoints/last.ckpt; resume with ckpt_path=last"
            raise WorkerFailed(message, exit_code=code if code > 0 else 1)
        if all(code == 0 for code in codes):
            return
        time.sleep(0.2)


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
