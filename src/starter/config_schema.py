"""What the keys in conf/ take, checked before anything starts: a mistyped value is one line naming the key and what
to give, not a traceback from the library that meets it mid-run. One table: a key the run's config does not hold
(another group's option, a DataModule of one's own without it) is not checked; anything else the libraries refuse
when the run builds its objects is caught there (run.build)."""

import operator
import re

from starter.errors import UserError

# key: kind (int, number, bool), bounds ("0..1": within, ">= 0", "> 0"), "or null" where null means
# something. `number` takes a float or an int.
SCHEMA = {
    "seed": "int 0..4294967295",  # numpy's seeds; Lightning raises outside, truncates 1.5
    "num_nodes": "int >= 1",
    "heartbeat_timeout_s": "number > 0",
    "stall_timeout_s": "number > 0",
    "stop_grace_s": "number > 0",
    "nodes_wait_s": "number > 0",
    "train": "bool",
    "test": "bool",
    "compile": "bool",
    "channels_last": "bool",
    "sync_batchnorm": "bool",
    "tf32": "bool",
    "verbose": "bool",
    "data.batch_size": "int >= 1",
    "data.num_workers": "int >= 0",
    "data.pin_memory": "bool",
    "data.persistent_workers": "bool",
    "data.skip_unreadable": "bool",
    "data.download": "bool",
    "data.random_erase": "number 0..1",
    "data.mixup_alpha": "number >= 0",
    "data.cutmix_alpha": "number >= 0",
    "data.ra_reps": "int >= 0",
    "data.val_size": "int >= 1",
    "model.label_smoothing": "number 0..1",
    "model.lr_warmup_epochs": "int >= 0",
    "model.optimizer.lr": "number > 0",
    "model.optimizer.weight_decay": "number >= 0",
    "model.optimizer.momentum": "number >= 0",
    "model.net.width": "int >= 1",
    "model.net.depth": "int >= 1",
    "model.net.dropout": "number 0..1",
    "trainer.max_epochs": "int >= -1",
    "trainer.min_epochs": "int >= 0 or null",
    "trainer.max_steps": "int >= -1",
    "trainer.limit_train_batches": "number >= 0 or null",
    "trainer.limit_val_batches": "number >= 0 or null",
    "trainer.limit_test_batches": "number >= 0 or null",
    "trainer.log_every_n_steps": "int >= 1",
    "trainer.accumulate_grad_batches": "int >= 1",
    "trainer.check_val_every_n_epoch": "int >= 1 or null",
    "trainer.num_sanity_val_steps": "int >= -1",
    "trainer.gradient_clip_val": "number >= 0 or null",
    "trainer.deterministic": "bool",
    "trainer.benchmark": "bool",
    "trainer.enable_progress_bar": "bool",
    "trainer.enable_model_summary": "bool",
    "strategy.tensor_parallel_size": "int >= 1 or null",
    "strategy.pipeline_parallel_size": "int >= 1 or null",
    "strategy.microbatches": "int >= 1",
    "callbacks.freeze_backbone.epochs": "int >= 0",
}
KINDS = {"int": "a whole number", "number": "a number", "bool": "true or false"}
RANGE = re.compile(r"(-?[\d.]+)\.\.(-?[\d.]+)")  # "low..high", both within
COMPARISONS = {">=": (operator.ge, "of {} or more"), ">": (operator.gt, "above {}")}


def check_schema(cfg) -> None:
    """Raise a UserError, naming the key and what to give, for the first value of `cfg` the table refuses."""
    from omegaconf import OmegaConf

    for key, rule in SCHEMA.items():
        node, _, name = key.rpartition(".")
        parent = OmegaConf.select(cfg, node) if node else cfg
        if parent is None or not OmegaConf.is_dict(parent) or name not in parent or OmegaConf.is_missing(parent, name):
            continue
        if (why := refused(parent[name], rule)) is not None:
            shown = "null" if parent[name] is None else parent[name]
            raise UserError(f"{key}={shown}: give {why}")


def refused(value, rule: str) -> str | None:
    """What to give instead of `value` under `rule` (SCHEMA's words), or None where it takes it."""
    kind, *bounds = rule.removesuffix(" or null").split(" ", 1)
    if value is None:
        return None if rule.endswith(" or null") else _wanted(kind, bounds)
    fits = {"int": isinstance(value, int), "number": isinstance(value, (int, float)), "bool": True}[kind]
    if isinstance(value, bool) != (kind == "bool") or not fits:
        return _wanted(kind, bounds)
    if bounds and not _within(value, bounds[0]):
        return _wanted(kind, bounds)
    return None


def _within(value, bound: str) -> bool:
    if match := RANGE.fullmatch(bound):
        return float(match[1]) <= value <= float(match[2])
    comparison, limit = bound.split()
    return COMPARISONS[comparison][0](value, float(limit))


def _wanted(kind: str, bounds: list[str]) -> str:
    if not bounds:
        return KINDS[kind]
    if match := RANGE.fullmatch(bounds[0]):
        return f"{KINDS[kind]} from {match[1]} to {match[2]}"
    comparison, limit = bounds[0].split()
    return f"{KINDS[kind]} {COMPARISONS[comparison][1].format(limit)}"
