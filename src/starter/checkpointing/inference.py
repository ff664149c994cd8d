"""What inference needs, saved with the weights: the resolved model config, normalisation, class names, input shape,
evaluation resize and crop. Every checkpoint holds it as `inference` (a sharded one in meta.pt); model.pt is
{"state_dict": the whole model's weights, "inference": ...}. `load_for_inference` reads either back."""

from pathlib import Path

import lightning as L
import torch

from starter.atomic_write import replacing
from starter.checkpointing import data_split
from starter.checkpointing.resume import weights_mismatch
from starter.checkpointing.sharded_read import read_metadata, read_sharded
from starter.errors import UserError, first_line
from starter.untrusted import check_image_record, declared_models, model_config, reading

# what ShardedDataModule.inference() records, which predicting from image files needs
IMAGE_RECORD = ("image_shape", "value_range", "mean", "std", "classes", "resize", "crop")


class SaveInference(L.Callback):
    def __init__(self, model: dict):
        """`model`: the model's resolved config, which rebuilds it."""
        self.record = {"model": model}

    def setup(self, trainer, pl_module, stage: str) -> None:  # after the DataModule's setup: its classes are known
        if callable(getattr(trainer.datamodule, "inference", None)):
            self.record |= trainer.datamodule.inference()
        self.split = data_split.record(trainer.datamodule) if trainer.datamodule is not None else {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint["inference"] = self.record
        if self.split:  # the split it is trained on (checkpointing/data_split.py)
            checkpoint[data_split.KEY] = self.split


def save_full_weights(trainer, path: Path, inference: dict) -> None:
    """A collective where the strategy holds shards or stages (it gathers them on rank 0); state_dict() otherwise."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    gather = getattr(trainer.strategy, "full_state_dict", None)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = gather() if gather else get_model_state_dict(trainer.lightning_module, options=options)
    if trainer.is_global_zero:
        with replacing(path, "wb") as file:
            torch.save({"state_dict": state, "inference": inference}, file)


def load_for_inference(path: Path, config_dirs: list) -> tuple[L.LightningModule, dict]:
    """The trained model (CPU, eval mode) and its inference record, from any checkpoint of this starter or model.pt;
    rebuilt as the model configs of `config_dirs` allow (starter/untrusted.py). An image classifier's: its record
    says how images were prepared, checked for what it means (its logits one per class name)."""
    saved = _saved(path)
    if missing := [key for key in IMAGE_RECORD if key not in saved["inference"]]:
        raise UserError(
            f"ckpt_path={path}: its run's DataModule recorded no {', '.join(missing)} (an image classifier's inference"
            " record, which a ShardedDataModule writes); predict.py and export.py need one"
        )
    return load_trained(path, config_dirs, saved, images=True)


def load_trained(path: Path, config_dirs: list, saved: dict | None = None, images=False) -> tuple:
    """The trained LightningModule (CPU, eval mode) and its inference record, from any checkpoint of this starter
    (any strategy's, a sharded directory too) or model.pt, rebuilt from the model config the record holds as the
    model configs of `config_dirs` allow; its weights loaded weights-only. `saved`: the checkpoint's contents, where
    read already. The record's sizes are checked against the saved weights on the meta device first (nothing
    allocated), and, with `images`, its image record against the net's logits."""
    from hydra.utils import instantiate

    saved, named = saved or _saved(path), f"ckpt_path={path}"
    record = saved["inference"]
    config = model_config(record, declared_models(config_dirs), named)
    if images:
        check_image_record(record, named)
    mismatch = logits = None
    try:
        with torch.device("meta"):  # nothing allocated: a record's sizes are checked against its weights first
            shaped = instantiate(config)
            mismatch = weights_mismatch(*saved_shapes(path, saved, shaped.state_dict()))
            logits = shaped.eval()(torch.empty(1, *record["image_shape"])) if images and not mismatch else None
    except UserError:
        raise
    except Exception as err:  # what the builder or the net refuses: a class count below 0, an input of another size
        if "meta" not in str(err):  # else a net whose forward reads values (it runs on real tensors only)
            why = first_line(err.__cause__ or err)
            raise UserError(f"{named}: its inference record's model does not take its images ({why})") from None
    if mismatch:
        raise UserError(f"{named}: its weights do not fit the model it names ({mismatch})")
    if logits is not None and logits.shape != (1, len(record["classes"])):
        classes = f"{len(record['classes'])} classes, its net gives {logits.shape[-1]} logits"
        raise UserError(f"{named}: its inference record names {classes}; use one this starter wrote")
    model = instantiate(config)
    if path.is_dir():  # torch.distributed.checkpoint reshards whatever the strategy's layout into whole tensors
        saved = {"state_dict": model.state_dict()}
        with reading(path):
            read_sharded(saved, path)
    model.load_state_dict(saved["state_dict"])
    return model.eval(), record


def saved_shapes(path: Path, saved: dict, expected: dict) -> tuple[dict, dict]:
    """The weights a model built as `expected` holds, and those saved, to compare: a sharded checkpoint's are its
    metadata's tensors, compared where both name them (the load reads, and refuses, what else it holds)."""
    if not path.is_dir():
        return expected, saved["state_dict"]
    entries = read_metadata(path).state_dict_metadata.items()
    sizes = {
        name[11:]: entry.size for name, entry in entries if name.startswith("state_dict.") and hasattr(entry, "size")
    }
    return {k: v for k, v in expected.items() if k in sizes}, {k: torch.empty(sizes[k]) for k in sizes if k in expected}


def _saved(path: Path) -> dict:
    """A checkpoint's contents (a sharded one's meta.pt), weights-only, with the inference record training wrote."""
    with reading(path):
        saved = torch.load(path / "meta.pt" if path.is_dir() else path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or "model" not in saved.get("inference", {}):
        raise UserError(
            f"ckpt_path={path} holds no inference record (the model's config, normalisation, classes):"
            " use a checkpoint or model.pt that this starter's training wrote"
        )
    return saved
