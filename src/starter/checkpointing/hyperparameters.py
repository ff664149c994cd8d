"""Checkpoints stay weights-only loadable whatever a module or DataModule saves with `save_hyperparameters()`: a
hyperparameter that is code (a module, a partial, a class, a function) is written as the config that built it (the
model's or the data's config key of the same name), else left out, said once in the run's log file. The module's own
`hparams` are untouched (a template's `configure_optimizers` calls `self.hparams.optimizer`)."""

import logging
import numbers

import lightning as L
import torch
from omegaconf import Container, OmegaConf

log = logging.getLogger(__name__)
# Lightning's keys: the hyperparameters, and the type it records where they are an OmegaConf container
SAVED = {"hyper_parameters": "hparams_type", "datamodule_hyper_parameters": "datamodule_hparams_type"}


class PlainHyperparameters(L.Callback):
    def __init__(self, model: dict, data: dict, run_dir: str = "<run directory>"):
        """`model`, `data`: the resolved configs that built the module and the DataModule; `run_dir`: the run's."""
        self.configs = {"hyper_parameters": model, "datamodule_hyper_parameters": data}
        self.run_dir, self.reported = run_dir, set()  # the keys whose code was reported

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        for key, type_key in SAVED.items():
            checkpoint.pop(type_key, None)
            if key in checkpoint:
                checkpoint[key] = self.plain(dict(_container(checkpoint[key])), self.configs[key], key, trainer)

    def plain(self, hparams: dict, config: dict, key: str, trainer) -> dict:
        kept, as_config, left_out = {}, [], []
        for name, value in hparams.items():
            value = as_plain(_container(value))
            if value is not CODE:
                kept[name] = value
            elif name in config and as_plain(config[name]) is not CODE:
                kept[name] = config[name]
                as_config.append(name)
            else:
                left_out.append(name)
        if (as_config or left_out) and key not in self.reported:
            self.reported.add(key)
            code = ", ".join(as_config + left_out)
            saved = f"checkpoints hold the {key.replace('_', ' ')} {code} as the config that built them, or leave"
            log.info("%s them out (code does not load weights-only)", saved, extra={"file_only": True})
            if key == "hyper_parameters" and trainer.is_global_zero:  # said once, on the console
                module = type(trainer.lightning_module).__name__
                rebuilt = (
                    f"{module}.load_from_checkpoint cannot rebuild it; starter.load_module({str(self.run_dir)!r}) does"
                )
                log.info("%s's hyperparameters %s are code: %s", module, code, rebuilt)
        return kept


def as_plain(value):
    """`value` in types that `torch.load(weights_only=True)` reads back (primitives and tensors, in dicts, lists,
    tuples), exactly: a number or string of a type of its own (numpy's float64, an IntEnum, a str Enum, a namedtuple)
    as the primitive it is. CODE where it holds anything else."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        pairs = [(as_plain(k), as_plain(v)) for k, v in value.items()]
        return CODE if any(k is CODE or v is CODE for k, v in pairs) else dict(pairs)
    if isinstance(value, (list, tuple)):
        items = [as_plain(v) for v in value]
        return CODE if any(v is CODE for v in items) else items if isinstance(value, list) else tuple(items)
    for kind, exact in PRIMITIVES:
        if isinstance(value, kind):
            return exact(value)
    return CODE


CODE = object()  # what as_plain gives for a value that is not plain
# a primitive of a type of its own as the primitive (str.__str__: a str Enum's text, not its name)
PRIMITIVES = ((bool, bool), (numbers.Integral, int), (numbers.Real, float), (str, str.__str__), (bytes, bytes))


def _container(value):
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else value
