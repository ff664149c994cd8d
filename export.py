"""Export a trained model to a file that runs without this starter: `python export.py ckpt_path=... format=onnx`
(conf/export.yaml)."""

if __name__ == "__main__":  # first: a stop signal while Hydra, torch and Lightning load ends with its line too
    from starter.errors import stop_while_starting

    stop_while_starting()

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from starter.config_choices import check_choices
from starter.errors import end_without_teardown
from starter.run_name import run_name


@hydra.main(version_base="1.3", config_path="conf", config_name="export")
def main(cfg: DictConfig) -> None:
    from starter.export import prepare
    from starter.main import main as run_job

    run_job(cfg, prepare, "starter.export:export")


if __name__ == "__main__":
    check_choices(Path(__file__).parent / "conf", "export", sys.argv[1:])
    OmegaConf.register_new_resolver("run_name", run_name, use_cache=True)
    end_without_teardown(main)
