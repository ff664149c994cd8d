"""`python predict.py ckpt_path=... inputs=...`: a trained model's answers for image files, in predictions.csv. The
weights carry what inference needs (no training data or config): a checkpoint of any strategy, a model.pt, a run
directory or `last`. One process, or one per device with `strategy=ddp`: each file once, rows in the inputs' order.
"""

import csv
import glob
import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, open_dict

from starter.atomic_write import replacing
from starter.checkpointing.resume import checkpoint_named
from starter.config_schema import check_schema
from starter.errors import UserError
from starter.launch.environment import launch_plan
from starter.loggers.report import shown
from starter.topology import Layout, Plan, lay_out
from starter.untrusted import formula_safe, model_config_dirs

log = logging.getLogger(__name__)
SHOWN = 5  # rows printed, and the top classes each row lists


def prepare(cfg: DictConfig) -> Plan:
    check_schema(cfg)
    plan = launch_plan(lay_out(cfg, cfg.batch_size))  # a global batch, shared equally
    if not plan.traits.whole_weights:
        raise UserError(
            f"strategy={cfg.strategy.name}: predict runs one process, or one per device with strategy=ddp;"
            " a checkpoint of any strategy loads into either"
        )
    settle_weights(cfg)
    run_dir = Path(cfg.paths.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with replacing(run_dir / "inputs.txt") as file:
        file.write("".join(f"{path}\n" for path in input_files(str(cfg.inputs))))
    return plan


def settle_weights(cfg: DictConfig) -> None:
    """`ckpt_path` as the checkpoint it names (checkpoint_named), said in one line with the run that trained it (`last`
    may be any run's), and `model_config_dirs`, whose model configs say what may rebuild its model, for the workers
    (which have no Hydra run to read them from)."""
    spec = str(cfg.ckpt_path)
    path = checkpoint_named(spec, Path(cfg.paths.log_dir))
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
    trained = f", trained in {shown(run_dir)}" if run_dir is not None and (run_dir / "config.yaml").is_file() else ""
    log.info("ckpt_path=%s: %s%s", spec, shown(path), trained)
    cfg.ckpt_path = str(path)
    with open_dict(cfg):
        cfg.model_config_dirs = model_config_dirs()


def input_files(spec: str) -> list[str]:
    """The files `inputs` names: one file, every file under a folder, or a glob's matches, sorted."""
    path = Path(spec)
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    elif path.is_file():
        files = [path]
    else:
        files = [Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file()]
    if not files:
        if path.is_dir():
            what = "the folder holds no file"
        elif glob.has_magic(spec):
            what = "the glob matches no file"
        else:
            what = "no such file or folder"
        raise UserError(f"inputs={spec}: {what}; give an image, a folder of images or a glob such as 'dir/*.jpg'")
    return sorted(str(p) for p in files)


def predict(cfg: DictConfig) -> dict:
    import torch
    from lightning.pytorch.callbacks import Callback

    from starter.checkpointing.inference import load_for_inference
    from starter.data.base import ImagesToPredict
    from starter.run import build_trainer, end_process_group, start_process

    class Collect(Callback):  # each batch's top classes and the files' places, on the host
        def __init__(self):
            self.rows = []

        def on_predict_batch_end(self, trainer, module, probabilities, batch, batch_idx, dataloader_idx=0):
            top = probabilities.topk(min(SHOWN, probabilities.shape[-1]), dim=-1)
            self.rows += zip(batch[1].tolist(), top.indices.tolist(), top.values.tolist())

    start_process(cfg)
    model, record = load_for_inference(Path(cfg.ckpt_path), list(cfg.model_config_dirs))
    run_dir = Path(cfg.paths.output_dir)
    paths = (run_dir / "inputs.txt").read_text().splitlines()
    images = ImagesToPredict(paths, record, int(cfg.batch_size), int(cfg.num_workers), bool(cfg.skip_unreadable))
    collect = Collect()
    trainer = build_trainer(cfg, Layout.of(cfg), [collect], loggers=[], shards_itself=True)
    trainer.predict(model, datamodule=images, return_predictions=False)
    rows = collect.rows
    if torch.distributed.is_initialized():
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, rows)
        rows = [row for part in everyone for row in part]
    if trainer.is_global_zero:
        write_predictions(run_dir / "predictions.csv", sorted(rows), paths, record["classes"])
    end_process_group()
    return {}


def write_predictions(path: Path, rows: list, paths: list[str], classes: list[str]) -> None:
    top_k = len(classes) > SHOWN
    with replacing(path, newline="") as f:
        out = csv.writer(f)
        out.writerow(["path", "class", "probability"] + (["top5"] if top_k else []))
        for index, top, chances in rows:  # a class name is a record's: shown as text, never run as a formula
            line = [paths[index], classes[top[0]], f"{chances[0]:.4f}"]
            line += [" ".join(f"{classes[c]}:{p:.4f}" for c, p in zip(top, chances))] if top_k else []
            out.writerow(map(formula_safe, line))
    if skipped := len(paths) - len(rows):
        log.warning(
            "%d of %d inputs unreadable and skipped (skip_unreadable=true): the warnings above name them",
            skipped,
            len(paths),
        )
    first = path.read_text().splitlines()[: SHOWN + 1]
    print(f"{len(rows)} predictions in {shown(path)}:", *first, sep="\n", file=sys.stdout, flush=True)
