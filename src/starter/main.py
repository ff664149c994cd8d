"""What `train.py` runs for each Hydra job: check the config, then train here or in one worker per device."""

import json
import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from starter.config import prepare
from starter.errors import UserError, one_line
from starter.strategies.launch import WorkerFailed, launch_workers, needs_launch

log = logging.getLogger(__name__)


def main(cfg: DictConfig) -> float | None:
    """Returns `cfg.optimized_metric` for Hydra sweepers. User errors exit with code 2 and one line."""
    try:
        prepare(cfg)
        run_dir = Path(cfg.paths.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = run_dir / "config.yaml"
        OmegaConf.save(cfg, config_path, resolve=True)  # workers and readers get plain values, no resolvers
        if needs_launch(cfg):
            launch_workers(config_path, cfg)
            metrics = json.loads((run_dir / "metrics.json").read_text())
        else:
            from starter.run import run

            metrics = run(OmegaConf.load(config_path))
    except UserError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        raise SystemExit(2) from None
    except WorkerFailed as err:
        if err.exit_code != 2:  # 2: a worker's user error, already reported in one line
            print(f"error: {err}", file=sys.stderr)
        raise SystemExit(err.exit_code) from None
    return metrics.get(cfg.optimized_metric)
