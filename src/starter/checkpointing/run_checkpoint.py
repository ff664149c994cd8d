"""checkpoints/last.ckpt and best.ckpt: Lightning's ModelCheckpoint, kept inside its run. Its state names its files
relative to its folder, so a run directory moved or copied continues in place (it saves last.ckpt and best.ckpt
again, never a -v1 beside stale ones); a restored state is someone else's file: a path it names is used only inside
this folder (untrusted.inside), so a later save deletes only what this run wrote there."""

import os
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from starter.callbacks.restored import Restored
from starter.untrusted import inside

PATHS = ("best_model_path", "kth_best_model_path", "last_model_path")


class RunCheckpoint(Restored, ModelCheckpoint):
    uploads = None  # checkpointing/store.Uploads where a checkpoint_store is given (rank 0): each save, uploaded

    def __init__(self, **kwargs):
        keeps_one = kwargs.get("save_top_k", 1) == 1  # more than one of a name: Lightning's -v1, -v2 tell them apart
        super().__init__(**{"enable_version_counter": not keeps_one, **kwargs})

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        if self.uploads is not None and trainer.is_global_zero:
            self.uploads.put(Path(filepath), trainer.global_step)
            self.uploads.put_record(Path(self.dirpath).parent)

    def state_dict(self) -> dict:
        state = super().state_dict()
        relative = {key: os.path.relpath(state[key], self.dirpath) if state[key] else "" for key in PATHS}
        best = {os.path.relpath(path, self.dirpath): score for path, score in state["best_k_models"].items()}
        return state | relative | {"best_k_models": best, "dirpath": "."}

    def load_state_dict(self, state_dict: dict) -> None:
        """Paths relative to the saving run's folder (`dirpath`: "." here, absolute in a checkpoint of Lightning's own)
        taken relative to this one; those outside it dropped, each said."""
        name = type(self).__name__
        saved_in = state_dict.get("dirpath") or "."

        def own(path, key: str) -> str:
            relative = os.path.relpath(path, saved_in) if path and os.path.isabs(path) and saved_in != "." else path
            kept = inside(relative, self.dirpath, f"{self.restored_from}: its {name} state's {key}")
            return kept if os.path.exists(kept) else ""  # a new run's folder (ckpt_path=last) holds none of them

        with self.reading():
            paths = {key: own(state_dict.get(key), key) for key in PATHS}
            best = {
                own(path, "best_k_models"): score for path, score in (state_dict.get("best_k_models") or {}).items()
            }
        super().load_state_dict(state_dict | paths | {"best_k_models": best, "dirpath": self.dirpath})
        self.best_k_models.pop("", None)
        if self.best_k_models and self.kth_best_model_path not in self.best_k_models:  # dropped: the kept decide
            worst, best = (max, min) if self.mode == "min" else (min, max)
            self.kth_best_model_path = worst(self.best_k_models, key=self.best_k_models.get)
            self.kth_value = self.best_k_models[self.kth_best_model_path]
            self.best_model_path = best(self.best_k_models, key=self.best_k_models.get)
            self.best_model_score = self.best_k_models[self.best_model_path]
