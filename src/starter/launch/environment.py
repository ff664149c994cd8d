"""What the environment says before anything starts: whether torchrun or a scheduler (SLURM, Kubeflow, LSF) started
the ranks, and the rendezvous variables several nodes need."""

import os
from dataclasses import replace

from starter.errors import UserError
from starter.topology import Plan, torchrun_id


def launched_by(world: int, multi_process: bool) -> str | None:
    """Who starts the ranks: "torchrun" or "slurm" (each rank runs train.py already), "ours" (launch/agent.py), or
    None (this process is the whole run, or another launcher started it: LOCAL_RANK set)."""
    if external := external_launcher(world):
        return external
    return "ours" if multi_process and world > 1 and "LOCAL_RANK" not in os.environ else None


# Schedulers that start every rank themselves, found by the variables Lightning's environments detect them by
# (KubeflowEnvironment: a PyTorchJob's pods, one process each; LSFEnvironment: jsrun's tasks), and the one that says
# how many processes they started.
SCHEDULERS = {
    "kubeflow": (("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"), "WORLD_SIZE"),
    "lsf": (("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK"),
            "JSM_NAMESPACE_SIZE"),
}  # fmt: skip
# Lightning's environment of each launcher that started the ranks: given to the Trainer (Lightning detects SLURM's and
# torchrun's by itself, not Kubeflow's: its detect() refuses), and read for where rank 0 serves the run's store
ENVIRONMENTS = {
    "torchrun": "TorchElasticEnvironment",
    "slurm": "SLURMEnvironment",
    "kubeflow": "KubeflowEnvironment",
    "lsf": "LSFEnvironment",
}


def cluster_environment(launcher: str | None):
    """Lightning's environment for the ranks `launcher` (external_launcher) started; Lightning's plain environment
    where train.py's agent started them, or for one process. SLURM's without Lightning's own requeue: every stop
    signal, SIGUSR1 included, is this starter's at every phase (callbacks/preemption.py)."""
    from lightning.fabric.plugins import environments

    name = ENVIRONMENTS.get(launcher, "LightningEnvironment")
    return getattr(environments, name)(**({"auto_requeue": False} if launcher == "slurm" else {}))


def external_launcher(world: int) -> str | None:
    """Who started every rank already: "torchrun", "kubeflow", "lsf", "slurm" (one task per rank), or None."""
    if torchrun_id() is not None:
        return "torchrun"
    for name, (variables, size) in SCHEDULERS.items():
        if all(variable in os.environ for variable in variables):
            if int(os.environ[size]) != world:
                started = f"{name} started {os.environ[size]} processes ({size})"
                raise UserError(f"{started} but devices x num_nodes = {world}; give the sizes it started")
            return name
    tasks = slurm_tasks()
    if tasks <= 1:
        return None
    if tasks != world:
        raise UserError(
            f"SLURM started {tasks} tasks but devices x num_nodes = {world}; ask SLURM for one task"
            " per device (--ntasks-per-node=<devices>), or for one task (--ntasks=1) and let"
            " train.py start the workers"
        )
    return "slurm"


def started_externally() -> bool:
    """Whether torchrun or a scheduler started this process as one of the run's ranks (before the sizes are known)."""
    schedulers = any(all(v in os.environ for v in variables) for variables, _ in SCHEDULERS.values())
    return torchrun_id() is not None or schedulers or slurm_tasks() > 1


def slurm_tasks() -> int:
    """SLURM_NTASKS of an `srun` step; 0 outside SLURM and in an interactive shell (Lightning's own rule)."""
    return 0 if os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive") else int(os.environ.get("SLURM_NTASKS", 0))


def launch_plan(plan: Plan) -> Plan:
    """`plan` with who starts its processes (launched_by); where train.py's agent does, the rendezvous variables it
    needs on every node, checked before anything waits on them."""
    plan = replace(plan, started_by=launched_by(plan.layout.world, plan.traits.multi_process))
    if plan.started_by == "ours":
        check_rendezvous(plan.layout.nodes)
    return plan


def check_rendezvous(nodes: int) -> None:
    """The rendezvous variables train.py's agent needs on every node."""
    if os.environ.get("MASTER_PORT") and not os.environ.get("MASTER_ADDR"):
        raise UserError("MASTER_PORT is set but MASTER_ADDR is not; set MASTER_ADDR to the host of node 0")
    if nodes == 1:
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if not os.environ.get(name)]
    if missing:
        raise UserError(
            f"num_nodes={nodes}: set {', '.join(missing)} on every node (MASTER_ADDR and MASTER_PORT the"
            f" same everywhere, NODE_RANK 0 to {nodes - 1})"
        )
    if not 0 <= int(os.environ["NODE_RANK"]) < nodes:
        raise UserError(f"NODE_RANK={os.environ['NODE_RANK']}: with num_nodes={nodes} it must be 0 to {nodes - 1}")
