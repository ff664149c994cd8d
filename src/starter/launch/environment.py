"""What the environment says before anything starts: the GPUs this machine has, whether torchrun or SLURM started the
ranks, the rendezvous variables several nodes need."""

import logging
import os
from dataclasses import replace
from pathlib import Path

from omegaconf import DictConfig, ListConfig

from starter.errors import UserError
from starter.topology import Plan, device_count, device_type

log = logging.getLogger(__name__)

ACCELERATORS = ("auto", "cpu", "gpu", "cuda")


def cuda_device_count() -> int:
    """GPUs that torch sees; 0 without importing torch (about 2 s) on a machine with no GPU driver at all."""
    if not any(Path(device).exists() for device in ("/dev/nvidiactl", "/dev/kfd")):  # NVIDIA, AMD (ROCm)
        return 0
    import torch

    return torch.cuda.device_count()


def torchrun_id() -> str | None:
    """The run id torchrun gives the processes it started; None where torchrun did not start this one."""
    return os.environ.get("TORCHELASTIC_RUN_ID")


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
    where train.py's agent started them, or for one process."""
    from lightning.fabric.plugins import environments

    return getattr(environments, ENVIRONMENTS.get(launcher, "LightningEnvironment"))()


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


def settle_devices(cfg: DictConfig) -> None:
    """Settle `accelerator` (cpu or gpu; auto: gpu where there is one), `devices=auto|-1|[i, ...]` and `num_nodes`
    once (under torchrun, its sizes), so workers get plain values and a device that does not exist is one line here."""
    if cfg.accelerator not in ACCELERATORS:
        raise UserError(f"accelerator={cfg.accelerator}: choose one of {', '.join(ACCELERATORS)}")
    adopt_torchrun_sizes(cfg)
    gpus = cuda_device_count() if cfg.accelerator != "cpu" else 0
    if cfg.accelerator != "auto" and cfg.accelerator != "cpu" and gpus == 0:
        raise UserError(f"accelerator={cfg.accelerator}: this machine has no CUDA GPU; use accelerator=cpu")
    cfg.accelerator = "gpu" if gpus else "cpu"
    on_gpu, devices = device_type(cfg) == "cuda", cfg.devices
    if devices in ("auto", -1, "-1"):
        cfg.devices = gpus if on_gpu else 1
        log.info("devices=%s: %d (%s)", devices, cfg.devices, "every visible GPU" if on_gpu else "one CPU process")
    elif isinstance(devices, (list, tuple, ListConfig)):
        if not on_gpu:
            raise UserError(
                f"devices={list(devices)} picks GPUs by index; on CPU give a count, e.g. devices={len(devices)}"
            )
        if len(set(devices)) != len(devices) or not all(isinstance(i, int) and 0 <= i < gpus for i in devices):
            raise UserError(f"devices={list(devices)}: this machine has GPUs 0 to {gpus - 1}; name each at most once")
    elif on_gpu and device_count(devices) > gpus:
        raise UserError(
            f"devices={devices}: this machine has {gpus} CUDA GPU(s); use devices={gpus}"
            f" (or accelerator=cpu for {devices} CPU processes)"
        )
    if device_count(cfg.devices) < 1 or int(cfg.num_nodes) < 1:
        raise UserError(f"devices={cfg.devices}, num_nodes={cfg.num_nodes}: both must be at least 1")


def adopt_torchrun_sizes(cfg: DictConfig) -> None:
    """Under torchrun the process counts are torchrun's: take them when the config left the defaults (1 x 1)."""
    if torchrun_id() is None:
        return
    local, total = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["WORLD_SIZE"])
    nodes = total // local
    if (device_count(cfg.devices), int(cfg.num_nodes)) == (local, nodes):
        return
    if (device_count(cfg.devices), int(cfg.num_nodes)) != (1, 1):
        raise UserError(
            f"devices={cfg.devices} num_nodes={cfg.num_nodes}, but torchrun started {local}"
            f" process(es) per node on {nodes} node(s); use devices={local} num_nodes={nodes}, or"
            " leave both out"
        )
    log.info("torchrun: devices=%d num_nodes=%d (from LOCAL_WORLD_SIZE and WORLD_SIZE)", local, nodes)
    cfg.devices, cfg.num_nodes = local, nodes


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
