"""The `run_name` resolver: this run's directory name, the same in every process. A time stamp, shared where several
processes compose the config: torchrun's rank 0's through torchrun's store (restarts keep it); node 0's through the
nodes' store (nodes.join_nodes); under `srun`, `slurm-<job id>.<step id>` (a requeued job keeps it, so
`ckpt_path=auto` finds its directory); under jsrun `lsf-<job id>`, in a Kubeflow PyTorchJob `kubeflow-<its master>`."""

import os
import re
import time
from datetime import datetime
from functools import cache

from starter.errors import LOST_EXIT_CODE, WorkerFailed, to_stderr
from starter.job_token import opened, read_signed, signed
from starter.launch.environment import slurm_tasks
from starter.run_failure import failure
from starter.topology import key_prefix, node_rank, nodes_given, torchrun_agents_share_their_store, torchrun_id

KEY = "starter/run_name"
NAME = re.compile(r"[\w.+-]{1,200}")  # a directory's name: a stamp, torchrun-<id>, slurm-<job>.<step>, ...
SAME_TOKEN = "is rank 0 alive, and has every process the same STARTER_JOB_TOKEN (or none)?"
NO_ID = (
    "torchrun --rdzv-id is none (its default), and with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 a job's run directory"
    " is named after it (torchrun-<rdzv id>, shared by its restarts): give each job its own --rdzv-id"
)


@cache  # one name per process, however often Hydra resolves the run directory
def run_name(num_nodes: int = 1, nodes_wait_s: float = 300.0) -> str:
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")  # microseconds: concurrent runs never collide
    if (run_id := torchrun_id()) is not None:
        # One name per torchrun job, kept by its restarts, at any size (--nnodes=1:2), for ckpt_path=auto to resume
        if not torchrun_agents_share_their_store():  # no store outlives a restart to keep a stamp: the job's id
            if run_id == "none":  # torchrun's default: unrelated jobs would continue one another's directory
                if os.environ.get("RANK", "0") == "0":
                    to_stderr(f"error: {NO_ID}")
                raise SystemExit(2)
            return "torchrun-" + "".join(c if c.isalnum() or c in "._-" else "_" for c in run_id)
        from starter.run_store import client  # torch: only when several processes must agree

        address = os.environ["MASTER_ADDR"]
        try:
            store = client(address, int(os.environ["MASTER_PORT"]), timeout_s=300)  # torchrun's agent's
        except ConnectionError as err:  # its rank 0's host's name, which may resolve to loopback on every host
            to_stderr(
                f"error: rank {os.environ.get('RANK')}: {err} (torchrun's MASTER_ADDR); on several hosts give"
                " torchrun --local-addr=<this host's address> on every node"
            )
            raise SystemExit(2) from None
        return _share(store, f"{KEY}/{run_id}", stamp, first=int(os.environ["RANK"]) == 0)
    if slurm_tasks() > 1 and "SLURM_JOB_ID" in os.environ:
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', 0)}"
    if "JSM_NAMESPACE_RANK" in os.environ and "LSB_JOBID" in os.environ:  # jsrun's tasks of an LSF job
        return f"lsf-{os.environ['LSB_JOBID']}"
    if "KUBERNETES_PORT" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ:  # a PyTorchJob's pods
        return f"kubeflow-{os.environ['MASTER_ADDR']}"  # its master pod's service: the job's name
    if nodes_given(num_nodes) > 1 and all(os.environ.get(v) for v in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK")):
        from starter.launch.nodes import join_nodes

        node_zero = node_rank() == 0
        try:
            store = join_nodes(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), node_zero, float(nodes_wait_s)
            )
        except WorkerFailed as err:  # node 0 never served the store: said here, not as a resolver's traceback
            to_stderr(f"error: {err.message}")
            raise SystemExit(err.exit_code) from None
        return _share(
            store, KEY, stamp, first=node_zero, failed=key_prefix(f"{os.environ.get('SLURM_JOB_ID', 'nodes')}-0")
        )
    return stamp  # anything missing for several nodes is reported in one line by preflight.prepare


def _share(store, key: str, stamp: str, first: bool, failed: str | None = None) -> str:
    """`first` writes its stamp (a torchrun restart keeps its first attempt's); every process reads it, believed only
    with the job token's proof and as a name (a stranger's would name the run's directory: `../..`). `failed`: the
    key prefix where node 0, failing before it named the run (a config error), says why: said here too, and exit."""
    if first and not is_name(opened(key, store.compare_set(key, "", signed(key, stamp)))):  # none, or a stranger's
        store.set(key, signed(key, stamp))
    deadline = time.monotonic() + store.timeout.total_seconds()
    while not is_name(name := read_signed(store, key)):
        if failed and (found := failure(store, failed)):
            store.set(f"{failed}/failed/read/{node_rank()}", "")  # node 0 stays until each node has read it
            to_stderr(f"error: {found[1]}")
            raise SystemExit(found[0])
        if time.monotonic() > deadline:
            to_stderr(f"error: rank 0 named no run in {store.timeout.total_seconds():.0f} s; {SAME_TOKEN}")
            raise SystemExit(LOST_EXIT_CODE)
        time.sleep(0.2)
    return name


def is_name(value: str | None) -> bool:
    """Whether a proven record's value names a directory, not a path."""
    return value is not None and NAME.fullmatch(value) is not None and value not in (".", "..")
