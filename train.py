"""Train and test a classifier from config: `python train.py [group=option ...] [key=value ...]`.

Only Hydra is imported here, so `--help` and config errors stay fast; torch and Lightning load once a run starts.
"""

if __name__ == "__main__":  # first: a stop signal while Hydra, torch and Lightning load ends with its line too
    from starter.errors import stop_while_starting

    stop_while_starting()

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from starter.config_choices import NoSuchOption, check_choices
from starter.errors import end_without_teardown
from starter.run_name import run_name


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from starter.main import main as run_job

    return run_job(cfg)


if __name__ == "__main__":
    if {"--help", "-h"} & set(sys.argv[1:]):  # Hydra's own help composes every group's options: 1 s more
        from starter.main import usage

        raise SystemExit(print(usage(Path(__file__).parent / "conf")))
    try:
        check_choices(Path(__file__).parent / "conf", "train", sys.argv[1:])
    except NoSuchOption as refused:  # said here; on several nodes, told to the others too
        from starter.main import tell_the_nodes_an_option_refused

        tell_the_nodes_an_option_refused(refused.line, sys.argv[1:])
        raise
    OmegaConf.register_new_resolver("run_name", run_name, use_cache=True)
    end_without_teardown(main, interrupted_hint="; to continue from the newest checkpoint saved: ckpt_path=last")
