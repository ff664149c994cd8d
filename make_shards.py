"""Write a data set's splits as shards: `python make_shards.py data=<name> out=<dir | s3://bucket/prefix>`
(conf/make_shards.yaml); train from them with `python train.py data=shards data.source=<the same>`."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from starter.config_choices import check_choices
from starter.errors import end_without_teardown
from starter.run_name import run_name


@hydra.main(version_base="1.3", config_path="conf", config_name="make_shards")
def main(cfg: DictConfig) -> None:
    from starter.make_shards import run

    run(cfg)


if __name__ == "__main__":
    check_choices(Path(__file__).parent / "conf", "make_shards", sys.argv[1:])
    OmegaConf.register_new_resolver("run_name", run_name, use_cache=True)
    end_without_teardown(main)
