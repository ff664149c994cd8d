"""The `run_name` config resolver: the name of this run's directory, the same in every process of the run.

A time stamp, except where several processes each compose the config and must agree on one directory:
- torchrun: rank 0's stamp, shared through torchrun's own key-value store; its restarts keep the first one;
- our launcher on several nodes (NODE_RANK, MASTER_ADDR, MASTER_PORT set, num_nodes > 1): node 0's job serves a
  store at MASTER_PORT for the whole run and shares its stamp; every node's workers then use that store for
  their rendezvous (torch's agent-store contract, as under torchrun; launch/launcher.py);
- SLURM tasks started by `srun` (one per rank): `slurm-<job id>.<step id>`, which every task knows; a
  requeued job keeps its job id, so `ckpt_path=auto` finds its own directory again.
"""

import os
from datetime import datetime, timedelta
from functools import cache

from starter.launch.environment import slurm_tasks

KEY = "starter/run_name"
_shared_store = None  # the store of a several-node launch, held (node 0: served) for as long as this job runs


def shared_store():
    """The store this job shares with the other nodes' jobs, or None."""
    return _shared_store


@cache  # one name per process, however often Hydra resolves the run directory
def run_name(num_nodes: int = 1) -> str:
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")  # microseconds: concurrent runs never collide
    if "TORCHELASTIC_RUN_ID" in os.environ:
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return stamp
        # One name per torchrun job: its restarts (--max-restarts) continue the same directory (ckpt_path=auto).
        first = int(os.environ["RANK"]) == 0
        return _share(stamp, f"{KEY}/{os.environ['TORCHELASTIC_RUN_ID']}", serve=False, first=first)
    if slurm_tasks() > 1 and "SLURM_JOB_ID" in os.environ:
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', 0)}"
    if int(num_nodes) > 1 and all(os.environ.get(v) for v in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")):
        node_zero = int(os.environ["NODE_RANK"]) == 0
        return _share(stamp, KEY, serve=node_zero, first=node_zero)
    return stamp  # anything missing for several nodes is reported in one line by preflight.prepare


def _share(stamp: str, key: str, serve: bool, first: bool) -> str:
    """`first` writes its stamp into the store at MASTER_ADDR:MASTER_PORT (served here if `serve`); all read it."""
    global _shared_store
    from torch.distributed import TCPStore  # only when several processes must agree

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=serve,
                     wait_for_workers=False, timeout=timedelta(seconds=300))  # fmt: skip
    if first:
        store.compare_set(key, "", stamp)  # a torchrun restart keeps the name of the job's first attempt
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        _shared_store = store  # served by node 0; the other nodes' jobs (and all workers) are its clients
    return store.get(key).decode()  # waits for the first
