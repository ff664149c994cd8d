"""One process of a multi-process run: `python -m starter.worker RUN_DIR/config.yaml`, started by launch/launcher.py.

Reads the resolved config (no Hydra here), so every worker trains exactly the job its parent was given.
"""

import logging
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from starter.launch.launcher import join_rendezvous
from starter.launch.watchdog import Watchdog


def main(config_path: str) -> int:
    rank = int(os.environ.get("RANK", 0))
    cfg = OmegaConf.load(config_path)
    handlers = [logging.StreamHandler()]
    if rank == 0:  # rank 0 continues the run's log file; other ranks only warn, so no console line is repeated
        handlers.append(logging.FileHandler(Path(cfg.paths.output_dir) / "train.log"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s",
        handlers=handlers,
    )
    from starter.run import run  # torch and lightning: imported by all ranks at once, before they wait

    store = join_rendezvous()  # rank 0 serves the store for as long as it runs (one node)
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    holder = "rank 0 (node 0)" if int(cfg.num_nodes) == 1 else "node 0's train.py"
    address, port, world = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"])
    watchdog = Watchdog(address, port, rank, world, per_node, cfg.heartbeat_timeout_s, store_holder=holder,
                        serves_store=store is not None)  # fmt: skip
    with watchdog.reporting():  # a failure: reported to every process, SystemExit with its code
        run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
