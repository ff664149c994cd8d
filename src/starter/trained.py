"""A trained LightningModule back in one call, whatever strategy trained it: `starter.load_module(run_dir_or_ckpt)`.
Lightning's `MyModule.load_from_checkpoint(path)` works where the module's hyperparameters are plain values; a module
holding code in them (a net, `_partial_` optimizers: the template pattern) is saved with the config that built it,
which this call builds again."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project: conf/ beside src/


def load_module(path, config_dirs=None):
    """The trained LightningModule (CPU, eval mode) of a run directory (its best.ckpt, else its model.pt), a .ckpt of
    any strategy (a sharded directory too) or a model.pt. It is rebuilt from the model config its checkpoint records,
    as far as the model configs of `config_dirs` declare it (this project's conf/ by default; add the folders you give
    hydra.searchpath): a checkpoint never calls what they do not name, nor fetches or reads anything (starter/
    untrusted.py). Weights load weights-only."""
    from starter.checkpointing.inference import load_trained
    from starter.checkpointing.resume import checkpoint_named

    folders = [Path(d) for d in config_dirs] if config_dirs is not None else [ROOT / "conf"]
    checkpoint = checkpoint_named(str(path), Path(path).parent)
    module, _ = load_trained(checkpoint, folders)
    return module
