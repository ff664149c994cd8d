"""What `train.py` runs for each Hydra job: check the config, then train here or in one worker per device."""

import json
import logging
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from starter.errors import UserError, one_line
from starter.launch.environment import external_launcher
from starter.launch.launcher import WorkerFailed, launch_workers, needs_launch
from starter.launch.run_name import shared_store
from starter.launch.watchdog import linger_s, report, watch_external_ranks
from starter.preflight import prepare
from starter.worker import PRELOAD, forked

log = logging.getLogger(__name__)


def main(cfg: DictConfig) -> float | None:
    """Returns `cfg.optimized_metric` for Hydra sweepers. User errors exit with code 2 and one line."""
    try:
        layout = prepare(cfg)
        run_dir = Path(cfg.paths.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = save_resolved(cfg, run_dir / "config.yaml")
        if needs_launch(cfg, layout):
            launch_workers(forked, PRELOAD, config_path, layout, stop_signals=list(cfg.stop_signals),
                           linger_s=linger_s(cfg.heartbeat_timeout_s))  # fmt: skip
            # rank 0 writes the run's outputs; the jobs of other nodes have nothing to report
            metrics = json.loads((run_dir / "metrics.json").read_text()) if _node_rank() == 0 else {}
        elif launcher := external_launcher(layout.world):  # torchrun's workers, srun's tasks: each a rank
            from starter.run import run

            watchdog = watch_external_ranks(launcher, layout.processes_per_node, cfg.heartbeat_timeout_s,
                                            cfg.stall_timeout_s)  # fmt: skip
            with watchdog.reporting():
                metrics = run(OmegaConf.load(config_path))
        else:
            from starter.run import run

            metrics = run(OmegaConf.load(config_path))
    except UserError as err:
        where = f"node {_node_rank()}: " if int(cfg.num_nodes) > 1 else ""
        report(shared_store(), 2, f"{where}{one_line(err)}")  # several nodes: the other nodes stop too
        raise SystemExit(2) from None
    except WorkerFailed as err:
        if err.message:  # else the failing process has said why
            print(f"error: {err.message}", file=sys.stderr)
        raise SystemExit(err.exit_code) from None
    return metrics.get(cfg.optimized_metric)


def save_resolved(cfg: DictConfig, path: Path) -> Path:
    """Plain values, no resolvers, for the workers and for readers. Written to a temporary file and renamed:
    on a shared file system every node's job writes the same file while other nodes' workers may read it."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    OmegaConf.save(cfg, temporary, resolve=True)
    os.replace(temporary, path)
    return path


def _node_rank() -> int:
    return int(os.environ.get("NODE_RANK", 0))
