"""What `train.py` (and `predict.py`, `export.py`) runs for each Hydra job: check the config, then run the job here or
in one worker per device. The machinery of several processes is imported only where several processes start."""

import importlib
import json
import logging
import multiprocessing
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from starter.atomic_write import replacing
from starter.errors import (
    INTERRUPTED_EXIT_CODE,
    USER_ERROR_EXIT_CODE,
    UserError,
    WorkerFailed,
    first_line,
    interrupted,
    one_line,
    to_stderr,
)
from starter.launch.environment import started_externally
from starter.loggers.report import shown
from starter.preflight import prepare as prepare_training
from starter.topology import Layout, Plan, device_type, node_rank, nodes_given, process_rank

log = logging.getLogger(__name__)

TRAIN = "starter.run:run"  # the job each process runs: "module:function", called with the resolved config


def main(cfg: DictConfig, prepare: Callable[[DictConfig], Plan] = prepare_training, job: str = TRAIN) -> float | None:
    """Returns `cfg.optimized_metric` for Hydra sweepers. User errors exit with code 2 and one line."""
    logging.captureWarnings(True)  # Python's warnings to the log file (loggers/console.py); the console's are ours
    if multiprocessing.get_start_method(allow_none=True) not in (None, *multiprocessing.get_all_start_methods()):
        # a job in a launcher's worker that set a start method of its own (Hydra's joblib launcher: loky's), which
        # the processes this job starts (workers, fork servers) could not set: they start the platform's way
        multiprocessing.set_start_method(None, force=True)
    if started_externally() and process_rank() > 0:
        _quiet()  # ranks torchrun or srun started say their lines once, from rank 0, from the first line on
    plan = None
    try:
        plan = prepare(cfg)
        run_dir = Path(cfg.paths.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open_dict(cfg):  # the log file this job's Hydra writes, which rank 0's worker continues
            cfg.log_file = str(run_dir / f"{HydraConfig.get().job.name if HydraConfig.initialized() else 'train'}.log")
        config_path = save_resolved(cfg, run_dir / "config.yaml")
        console(cfg)
        log.info("%s: %s", cfg.task_name, what_runs(cfg, plan.layout))
        guard_the_job(cfg, plan)
        gloo_reaches_the_nodes()
        if job == TRAIN:
            serve_lighthouse(cfg)
        if plan.started_by == "ours":
            metrics = launch(cfg, config_path, plan, job)
        elif plan.started_by is not None:  # torchrun's workers, srun's tasks: each a rank
            from starter.launch.watchdog import watch_external_ranks

            watchdog = watch_external_ranks(
                plan.started_by, plan.layout.processes_per_node, cfg.heartbeat_timeout_s, cfg.stall_timeout_s
            )
            with watchdog.reporting():
                metrics = job_function(job)(OmegaConf.load(config_path))
        else:
            metrics = job_function(job)(OmegaConf.load(config_path))
    except (KeyboardInterrupt, Exception) as err:
        if not isinstance(err, (KeyboardInterrupt, UserError)) and not interrupted():
            raise  # a bug: its traceback
        # A user error (one line, exit 2) or Ctrl-C in this node's terminal, or what Ctrl-C broke on its way out
        # (errors.catch_ctrl_c; KeyboardInterrupt, which errors.end_without_teardown says). On several nodes the
        # other nodes are told first: they stop too, and say it.
        user_error = isinstance(err, UserError)
        if nodes_given(cfg.num_nodes) > 1:
            from starter.launch.nodes import tell_the_other_nodes
            from starter.launch.watchdog import linger_s

            code, line = _ending(err)
            linger = linger_s(cfg.heartbeat_timeout_s)
            nodes, wait_s = nodes_given(cfg.num_nodes), float(cfg.nodes_wait_s)
            tell_the_other_nodes(nodes_run_id(), code, line, wait_s, linger, say=user_error, nodes=nodes)
        elif user_error:
            to_stderr(f"error: {one_line(err)}")
            if plan is None and process_rank() == 0:
                _remove_unstarted_run_dir()
        if user_error:
            raise SystemExit(USER_ERROR_EXIT_CODE) from None
        raise KeyboardInterrupt from None
    return metrics.get(cfg.get("optimized_metric"))


def guard_the_job(cfg: DictConfig, plan: Plan) -> None:
    """The job token (job_token.py): made here for a job whose processes this train.py alone starts on this host; where
    other nodes or replica groups take part and none is given, one line says what a stranger can then do."""
    from starter import job_token

    ft = cfg.get("fault_tolerance")
    others = plan.layout.nodes > 1 or (ft and ft.replica_groups > 1)
    if job_token.given():
        return
    if others and process_rank() == 0:
        log.warning(job_token.UNGUARDED)
    elif not others and plan.started_by in ("ours", None):
        job_token.make_for_this_host()


def tell_the_nodes_an_option_refused(line: str, argv: list[str]) -> None:
    """A config option that does not exist (config_choices, before Hydra composes), on a node of several (`num_nodes=N`
    on its command line): told to the others as any config error is; they say it and exit 2."""
    from starter.launch.nodes import tell_the_other_nodes
    from starter.launch.watchdog import linger_s

    given = dict(arg.split("=", 1) for arg in argv if "=" in arg and arg[:1].isalpha())
    nodes, wait = given.get("num_nodes", "1"), given.get("nodes_wait_s", "300")
    if nodes.isdigit() and int(nodes) > 1:
        wait_s = float(wait) if wait.replace(".", "", 1).isdigit() else 300.0
        run_id = f"{os.environ.get('SLURM_JOB_ID', 'nodes')}-0"  # nodes_run_id's, out of a sweep
        said = f"node {node_rank()}: {line}"
        tell_the_other_nodes(run_id, USER_ERROR_EXIT_CODE, said, wait_s, linger_s(120.0), nodes=int(nodes))


def gloo_reaches_the_nodes() -> None:
    """Nodes on other hosts (MASTER_ADDR not loopback): gloo bound where they reach this one, not to the loopback
    address this host's name may resolve to (host_address.choose_gloo_device)."""
    from starter.host_address import choose_gloo_device, is_loopback, route_to

    given = os.environ.get("MASTER_ADDR")
    if given and not is_loopback(given) and (address := route_to(given)):
        choose_gloo_device(address)


def serve_lighthouse(cfg: DictConfig) -> None:
    """fault_tolerance=torchft: the address this group is reached at, then replica group 0's train.py starts the
    lighthouse unless one is named."""
    if cfg.get("fault_tolerance"):
        from starter.strategies.torchft_setup import publish_where_reached, start_lighthouse

        publish_where_reached(cfg.fault_tolerance)
        start_lighthouse(cfg.fault_tolerance)


def _ending(err: BaseException) -> tuple[int, str]:
    """The exit code of a job that ends on `err` (a user error or Ctrl-C), and the line the other nodes say."""
    if isinstance(err, UserError):
        return USER_ERROR_EXIT_CODE, f"node {node_rank()}: {one_line(err)}"
    return INTERRUPTED_EXIT_CODE, f"node {node_rank()} was interrupted (Ctrl-C)"


def _remove_unstarted_run_dir() -> None:
    """A run refused before anything started leaves no run directory: Hydra made it, with its own records only."""
    run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None
    if (
        run_dir is not None
        and run_dir.is_dir()
        and all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir())
    ):
        shutil.rmtree(run_dir, ignore_errors=True)


def usage(conf: Path) -> str:
    """`train.py --help`: examples, every config group's options (read off conf/), where the whole config is."""
    help_cfg = OmegaConf.load(conf / "hydra" / "default.yaml").help
    groups = sorted(d for d in conf.iterdir() if d.is_dir() and d.name != "hydra")
    options = [f"{d.name}: {', '.join(sorted(p.stem for p in d.glob('*.yaml')))}" for d in groups]
    config = "the whole config, resolved: python train.py --cfg job --resolve (Hydra's flags: --hydra-help)"
    return "\n".join([help_cfg.header, "== Config groups (group=option) ==", *options, "", config, help_cfg.footer])


def console(cfg: DictConfig) -> None:
    """verbose=true: every logger's lines on the console; the project's always (console.show_project)."""
    from starter.loggers.console import show_project

    show_project(cfg)
    for handler in logging.getLogger().handlers:
        if cfg.get("verbose") and isinstance(handler, logging.StreamHandler):
            handler.filters.clear()


def _quiet() -> None:
    """This process's lines at WARNING and above only, on the console and in the log file its rank 0 also writes."""
    for handler in logging.getLogger().handlers:
        handler.setLevel(max(handler.level, logging.WARNING))


def what_runs(cfg: DictConfig, layout: Layout) -> str:
    """`data=digits model=mlp strategy=auto precision=32, 1 process on cpu -> logs/train/runs/...`"""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    picked = [f"{group}={choices[group]}" for group in ("data", "model", "strategy") if choices.get(group)]
    processes = f"{layout.world} process{'es' if layout.world > 1 else ''} on {device_type(cfg)}"
    if ft := cfg.get("fault_tolerance"):
        processes += f", replica group {ft.replica_group} of {ft.replica_groups} (torchft)"
    return f"{' '.join([*picked, f'precision={cfg.precision}'])}, {processes} -> {shown(cfg.paths.output_dir)}"


def worker_preload(job: str) -> tuple[str, ...]:
    """What the workers' fork server imports once: the worker and its job's module (torch and Lightning), none of it
    asking CUDA anything (a CUDA driver initialised before a fork fails in the forked workers)."""
    return "starter.launch.worker", job.split(":")[0]


def job_function(job: str) -> Callable[[DictConfig], dict]:
    module, name = job.split(":")
    return getattr(importlib.import_module(module), name)


def launch(cfg: DictConfig, config_path: Path, plan: Plan, job: str) -> dict:
    """One worker per device of this node, started by torch's elastic agent; rank 0 writes the run's outputs."""
    from starter.launch.agent import start_workers
    from starter.launch.watchdog import linger_s

    # the agent's run id: on one node, its run directory's name
    run = nodes_run_id() if plan.layout.nodes > 1 else Path(cfg.paths.output_dir).name
    try:
        start_workers(
            job,
            worker_preload(job),
            config_path,
            plan.layout,
            run,
            plan.traits.launcher,
            stop_signals=list(cfg.stop_signals),
            grace_s=float(cfg.stop_grace_s),
            linger_s=linger_s(cfg.heartbeat_timeout_s),
            wait_s=float(cfg.nodes_wait_s),
            composed=cfg,
        )
    except WorkerFailed as err:
        if err.message:  # else the failing process has said why
            to_stderr(f"error: {err.message}")
        raise SystemExit(err.exit_code) from None
    metrics = Path(cfg.paths.output_dir) / "metrics.json"  # where the job reports figures (training does)
    return json.loads(metrics.read_text()) if node_rank() == 0 and metrics.is_file() else {}


def nodes_run_id() -> str:
    """The agent's run id on several nodes, the same in every node's job: what each node is given alike (the
    scheduler's job id, the job's number in a sweep), never a name a node makes (its run directory may be its own,
    `hydra.run.dir=`). The store at MASTER_ADDR:MASTER_PORT is the run's own, so nothing else need tell it apart."""
    job = OmegaConf.select(HydraConfig.get(), "job.num", default=0) if HydraConfig.initialized() else 0
    return f"{os.environ.get('SLURM_JOB_ID', 'nodes')}-{job}"


def save_resolved(cfg: DictConfig, path: Path) -> Path:
    """Plain values for the workers and readers, renamed into place (every node's job writes it, others read it). A
    value that names a key the config lacks (a model config reading `${data.image_shape}` with data=none) is one
    line."""
    from omegaconf.errors import InterpolationResolutionError

    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as err:
        raise UserError(f"{err.full_key}: {' '.join(first_line(err, named=False).split())}") from None
    with replacing(path) as file:  # a value that reads `${...}` (a searched string) stays that text when read back
        OmegaConf.save(OmegaConf.create(escaped(resolved)), file)
    return path


def escaped(node):
    if isinstance(node, dict):
        return {key: escaped(value) for key, value in node.items()}
    if isinstance(node, list):
        return [escaped(value) for value in node]
    return node.replace("${", "\\${") if isinstance(node, str) else node
