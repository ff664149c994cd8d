"""What inference needs, saved with the weights: the resolved model config, normalisation, class names, input shape,
evaluation resize and crop. Every checkpoint holds it as `inference` (a sharded one in meta.pt); model.pt is
{"state_dict": the whole model's weights, "inference": ...}. `load_for_inference` reads either back."""

from pathlib import Path

import lightning as L
import torch

from starter.atomic_write import replacing
from starter.checkpointing.resume import refusing_pickled_code, weights_mismatch
from starter.checkpointing.sharded_read import read_sharded
from starter.errors import UserError
from starter.untrusted import declared_models, model_config

# what ShardedDataModule.inference() records, which predicting from image files needs
IMAGE_RECORD = ("image_shape", "value_range", "mean", "std", "classes", "resize", "crop")


class SaveInference(L.Callback):
    def __init__(self, model: dict):
        """`model`: the model's resolved config, which rebuilds it."""
        self.record = {"model": model}

    def setup(self, trainer, pl_module, stage: str) -> None:  # after the DataModule's setup: its classes are known
        if callable(getattr(trainer.datamodule, "inference", None)):
            self.record |= trainer.datamodule.inference()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint["inference"] = self.record


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
    says how images were prepared."""
    saved = _saved(path)
    if missing := [key for key in IMAGE_RECORD if key not in saved["inference"]]:
        raise UserError(
            f"ckpt_path={path}: its run's DataModule recorded no {', '.join(missing)} (an image classifier's inference"
            " record, which a ShardedDataModule writes); predict.py and export.py need one"
        )
    return load_trained(path, config_dirs, saved)


def load_trained(path: Path, config_dirs: list, saved: dict | None = None) -> tuple[L.LightningModule, dict]:
    """The trained LightningModule (CPU, eval mode) and its inference record, from any checkpoint of this starter
    (any strategy's, a sharded directory too) or model.pt, rebuilt from the model config the record holds as the
    model configs of `config_dirs` allow; its weights loaded weights-only. `saved`: the checkpoint's contents, where
    read already."""
    from hydra.utils import instantiate

    saved = saved or _saved(path)
    record = saved["inference"]
    model = instantiate(model_config(record, declared_models(config_dirs), f"ckpt_path={path}"))
    if path.is_dir():  # torch.distributed.checkpoint reshards whatever the strategy's layout into whole tensors
        weights = {"state_dict": model.state_dict()}
        read_sharded(weights, path)
        saved = weights
    if mismatch := weights_mismatch(model.state_dict(), saved["state_dict"]):
        raise UserError(f"ckpt_path={path}: its weights do not fit the model it names ({mismatch})")
    model.load_state_dict(saved["state_dict"])
    return model.eval(), record


def _saved(path: Path) -> dict:
    """A checkpoint's contents (a sharded one's meta.pt), weights-only, with the inference record training wrote."""
    with refusing_pickled_code(path):
        saved = torch.load(path / "meta.pt" if path.is_dir() else path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or "model" not in saved.get("inference", {}):
        raise UserError(
            f"ckpt_path={path} holds no inference record (the model's config, normalisation, classes):"
            " use a checkpoint or model.pt that this starter's training wrote"
        )
    return saved
