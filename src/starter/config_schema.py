"""What the keys in conf/ take, checked before anything starts: a value the user must give (`???`), the keys the
launcher reads given once, and a mistyped value, each one line naming the key and what to give, not a traceback from
the library that meets it mid-run. One table: a key the run's config does not hold (another group's option, a
DataModule of one's own without it) is not checked; anything else the libraries refuse when the run builds its
objects is caught there (run.build)."""

import operator
import re
import signal

from starter.errors import UserError

PRECISIONS = ("32", "16-mixed", "bf16-mixed", "bf16-true")

# key: kind (int, number, bool), bounds ("0..1": within, ">= 0", "> 0"), "or null" where null means
# something. `number` takes a float or an int.
SCHEMA = {
    "seed": "int 0..4294967295",  # numpy's seeds; Lightning raises outside, truncates 1.5
    "num_nodes": "int >= 1",
    "heartbeat_timeout_s": "number > 0",
    "stall_timeout_s": "number > 0",
    "stop_grace_s": "number > 0",
    "checkpoint_every_n_steps": "int >= 1 or null",
    "nodes_wait_s": "number > 0",
    "train": "bool",
    "test": "bool",
    "compile": "bool",
    "channels_last": "bool",
    "sync_batchnorm": "bool",
    "tf32": "bool",
    "verbose": "bool",
    "batch_size": "int >= 1",  # predict.py's, global
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
    "strategy.async_save": "bool",
    "callbacks.freeze_backbone.epochs": "int >= 0",
    "fault_tolerance.replica_group": "int >= 0",
    "fault_tolerance.replica_groups": "int >= 1",
    "fault_tolerance.lighthouse_port": "int 0..65535",
    "fault_tolerance.min_replicas": "int >= 1",
    "fault_tolerance.heartbeat_timeout_s": "number > 0",
    "fault_tolerance.join_timeout_s": "number >= 0",
    "fault_tolerance.timeout_s": "number > 0",
    "fault_tolerance.quorum_timeout_s": "number > 0",
}
KINDS = {"int": "a whole number", "number": "a number", "bool": "true or false"}
RANGE = re.compile(r"(-?[\d.]+)\.\.(-?[\d.]+)")  # "low..high", both within
COMPARISONS = {">=": (operator.ge, "of {} or more"), ">": (operator.gt, "above {}")}


def check_schema(cfg) -> None:
    """Raise a UserError, naming the key and what to give, for the first value of `cfg` that is not given, given
    twice, or that the table refuses."""
    from omegaconf import OmegaConf

    check_given(cfg)
    _check_one_copy(cfg)
    if str(cfg.precision) not in PRECISIONS:
        raise UserError(f"precision={cfg.precision}: choose one of {', '.join(PRECISIONS)}")
    if unknown := [name for name in cfg.get("stop_signals") or [] if name not in signal.Signals.__members__]:
        raise UserError(
            f"stop_signals: {', '.join(map(str, unknown))} is no signal here; use names such as SIGTERM,"
            " SIGUSR1, SIGUSR2"
        )
    for key, rule in SCHEMA.items():
        node, _, name = key.rpartition(".")
        parent = OmegaConf.select(cfg, node) if node else cfg
        if parent is None or not OmegaConf.is_dict(parent) or name not in parent or OmegaConf.is_missing(parent, name):
            continue
        if (why := refused(parent[name], rule)) is not None:
            shown = "null" if parent[name] is None else parent[name]
            raise UserError(f"{key}={shown}: give {why}")


def check_given(cfg) -> None:
    """Every `???` of the composed config has a value (predict.py's `inputs`); OmegaConf would raise where one is first
    read, with a traceback."""
    if missing := unset(cfg):
        raise UserError(f"{', '.join(missing)}: no value given; set {missing[0]}=... on the command line")


def unset(node, prefix: str = "") -> list[str]:
    """The keys whose value is `???`, no interpolation resolved (one may name a key the run settles later)."""
    from omegaconf import OmegaConf

    found = []
    for key in node.keys() if OmegaConf.is_dict(node) else range(len(node)):
        if OmegaConf.is_missing(node, key):
            found.append(f"{prefix}{key}")
        elif not OmegaConf.is_interpolation(node, key) and OmegaConf.is_config(child := node[key]):
            found += unset(child, f"{prefix}{key}.")
    return found


def _check_one_copy(cfg) -> None:
    """`accelerator`, `devices`, `num_nodes`, `precision` and `strategy` are top-level keys, the ones the checks and the
    launcher read; `trainer.<key>` follows them (`${key}`) or is absent. One set there instead (`trainer.devices=2`,
    as Lightning + Hydra templates choose devices) would start Lightning's own launcher behind ours: refused."""
    from omegaconf import OmegaConf

    trainer = OmegaConf.to_container(cfg.trainer, resolve=False) if "trainer" in cfg else {}
    for key in ("accelerator", "devices", "num_nodes", "precision", "strategy"):
        if key in trainer and trainer[key] != f"${{{key}}}":
            value = trainer[key] if not isinstance(trainer[key], dict) else trainer[key].get("_target_", "...")
            instead = f"strategy={value} (a config group: conf/strategy/)" if key == "strategy" else f"{key}={value}"
            raise UserError(
                f"trainer.{key}={value}: set {instead} instead; the top-level key is the one this starter checks and"
                " launches by"
            )


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
