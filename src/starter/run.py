"""One process's part of a run: build data, model and trainer from the resolved config, fit, test, report."""

import logging
import signal
import time
from pathlib import Path

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from omegaconf import DictConfig, OmegaConf

from starter.callbacks.mid_epoch_resume import MidEpochResume
from starter.callbacks.preemption import SaveOnSigterm
from starter.callbacks.random_state import RandomState
from starter.callbacks.stop_agreement import StopAgreement, stop_line
from starter.checkpointing.hyperparameters import PlainHyperparameters
from starter.checkpointing.inference import SaveInference, save_full_weights
from starter.checkpointing.init_from import load_initial_weights
from starter.checkpointing.resume import check_checkpoint_fits
from starter.errors import PREEMPTED_EXIT_CODE, STOP_SIGNALS, UserError, first_line, one_line, to_stderr
from starter.launch.environment import cluster_environment, external_launcher
from starter.loggers.lifecycle import end_logger_runs, log_config
from starter.loggers.report import log_model_summary, shown, write_run_outputs
from starter.strategies.build import build_strategy
from starter.strategies.precision import precision_plugin
from starter.strategies.replica_agreement import agreed_config
from starter.topology import Layout, Traits, device_type, process_rank

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> dict[str, float]:
    """Returns the final metrics: what the model and the callbacks logged last (`test/*`: the tested checkpoint's)."""
    try:
        return train_and_test(cfg)
    except MisconfigurationException as err:  # Lightning refusing a setting (max_epochs=-5): the user's to fix
        log.info("Lightning refused the run:", exc_info=True, extra={"file_only": True})  # its traceback: train.log
        raise UserError(f"Lightning: {' '.join(one_line(err).split())}") from None


def train_and_test(cfg: DictConfig) -> dict[str, float]:
    start_process(cfg)
    layout, traits = Layout.of(cfg), Traits.of(cfg.strategy)
    # a callback may build to None (off); some loggers build on rank 0 only
    callbacks = [c for name, node in cfg.callbacks.items() if (c := build(node, f"callbacks.{name}")) is not None]
    stops = next((c for c in callbacks if isinstance(c, SaveOnSigterm)), None)
    if stops is not None:  # a stop signal from here on stops the run where it can (callbacks/preemption.py)
        stops.listen()
    else:  # no stop handling asked for: a stop signal ends the process as by default, not "while starting"
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
    datamodule = build(cfg.data, "data") if "_target_" in cfg.data else None  # data=none: the module's loaders
    model = build(cfg.model, "model")
    try_factories(cfg.model, "model")
    if cfg.get("init_from") and not cfg.ckpt_path:  # training from them, or testing them (train=false)
        load_initial_weights(model, Path(cfg.init_from), list(cfg.model_config_dirs), training=cfg.train)
    if cfg.trainer.get("enable_model_summary") and process_rank() == 0 and "image_shape" in cfg.data:
        log_model_summary(model, cfg.data.image_shape)
    if cfg.get("channels_last"):
        use_channels_last(model, weights=traits.channels_last_weights)
    if cfg.get("compile"):  # in place: parameter names and checkpoints stay the plain module's
        model.compile(**cfg.get("compile_options") or {})
    inference = SaveInference(OmegaConf.to_container(cfg.model, resolve=True))
    configs = (OmegaConf.to_container(c, resolve=True) for c in (cfg.model, cfg.data))
    hyperparameters = PlainHyperparameters(*configs, shown(cfg.paths.output_dir))
    loggers = [lg for name, node in cfg.logger.items() if (lg := build(node, f"logger.{name}")) is not None]
    # what every run keeps, whatever the callbacks config says
    own = [inference, hyperparameters, MidEpochResume(), RandomState(cfg.seed)]
    trainer = build_trainer(cfg, layout, [*callbacks, *own], loggers, getattr(datamodule, "shards_itself", False))
    log_config(trainer, cfg)
    uploads = upload_checkpoints(cfg, callbacks, trainer.strategy, layout.world)
    try:
        try:
            metrics = fit_and_test(cfg, trainer, model, datamodule, inference.record, stops, uploads)
        except SIGTERMException:  # Lightning's, or ours (callbacks/preemption.py): at any phase
            stopped(cfg, trainer, stops, uploads)
    except BaseException as err:  # a logger's run is marked with how the job ends
        end_logger_runs(trainer, err.code if isinstance(err, SystemExit) and isinstance(err.code, int) else 1)
        raise
    end_logger_runs(trainer)
    end_process_group()
    return metrics


def upload_checkpoints(cfg: DictConfig, callbacks: list, strategy, world: int):
    """This process's uploads to the checkpoint store (checkpointing/store.py) where `checkpoint_store` is given, else
    None: rank 0's of each checkpoint saved and the record; every rank's of its files of a sharded checkpoint."""
    sharded = getattr(strategy, "sharded_checkpoints", False)  # strategies/model_parallel.py's
    if not cfg.get("checkpoint_store") or (process_rank() != 0 and not sharded):
        return None
    from starter.checkpointing.run_checkpoint import RunCheckpoint
    from starter.checkpointing.store import CheckpointStore, Uploads

    uploads = Uploads(CheckpointStore(str(cfg.checkpoint_store)), process_rank(), world)
    if sharded:
        strategy.written.append(uploads.put_shards)
    for callback in callbacks:
        if isinstance(callback, RunCheckpoint):
            callback.uploads = uploads
    return uploads


def fit_and_test(cfg: DictConfig, trainer: L.Trainer, model, datamodule, inference: dict, stops, uploads=None):
    """`stops`: the run's SaveOnSigterm (None where the callbacks config has none); `uploads`: rank 0's to the
    checkpoint store (None: none)."""
    if cfg.ckpt_path:
        check_checkpoint_fits(model, Path(cfg.ckpt_path), cfg.model)
    metrics: dict[str, float] = {}
    if cfg.train:  # a checkpoint's load refuses pickled code in one line: checkpointing/atomic_io.py, the strategies
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
        metrics |= _floats(trainer.callback_metrics)
        if stops is not None:
            stops.enter("the final save")
        save_full_weights(trainer, Path(cfg.paths.output_dir) / "checkpoints" / "model.pt", inference)
        if uploads is not None:
            uploads.put(Path(cfg.paths.output_dir) / "checkpoints" / "model.pt", trainer.global_step)
        if stops is not None:
            stops.stop_here()
    ckpt_path = cfg.ckpt_path
    if cfg.test:
        if cfg.train:
            best = [c for c in trainer.checkpoint_callbacks if c.monitor and c.best_model_path]
            ckpt_path = best[0].best_model_path if best else None  # none (callbacks=none, fast_dev_run): final weights
            if best and trainer.is_global_zero:  # a score is unknown where a resume elsewhere saved no better one
                score = best[0].best_model_score
                figure = f", {best[0].monitor} {float(score):.4g}" if score is not None else ""
                log.info(
                    "testing %s (epoch %d%s)",
                    shown(ckpt_path, cfg.paths.output_dir),
                    saved_epoch(Path(ckpt_path)),
                    figure,
                )
        trainer.test(model, datamodule=datamodule, ckpt_path=ckpt_path, verbose=False, weights_only=True)
        metrics |= _floats(trainer.callback_metrics)
    if trainer.is_global_zero:
        weights = f"init_from={cfg.init_from}" if cfg.get("init_from") and not cfg.train else "the final weights"
        tested = shown(ckpt_path, cfg.paths.output_dir) if ckpt_path else weights
        write_run_outputs(Path(cfg.paths.output_dir), metrics, cfg.monitor, tested if cfg.test else None)
    if uploads is not None:
        uploads.put_record(Path(cfg.paths.output_dir))
        started = time.monotonic()
        uploads.flush()
        log.info("checkpoint_store: every upload done (the last waited for %.1f s)", time.monotonic() - started)
    return metrics


def stopped(cfg: DictConfig, trainer: L.Trainer, stops, uploads=None) -> None:
    """Exit 143 with the run's one stop line (stop_agreement.stop_line), said by rank 0; under several processes it
    tells the launcher so through the run's store, and the launcher says none of its own. The last.ckpt the stop
    saved is uploaded first where a checkpoint store is given, within half the stop's grace."""
    if uploads is not None and stops is not None and stops.saved_step is not None:
        uploads.put(Path(stops.path), stops.saved_step)
        uploads.put_record(Path(cfg.paths.output_dir))
        if not uploads.flush(timeout=float(cfg.get("stop_grace_s", 90)) / 2):
            log.warning("checkpoint_store: the stop's last.ckpt is not uploaded yet; the store keeps the one before")
    if trainer.is_global_zero:
        cause = (stops and stops.received) or "a stop signal"
        phase, step = (stops.received_in, stops.saved_step) if stops is not None else (None, None)
        if trainer.num_nodes > 1 and stops is not None and (origin := stops.origin()):
            cause, phase = f"{origin[0]} (sent to node {origin[1]})", origin[2]
        to_stderr(f"error: {stop_line(cause, cfg.paths.output_dir, phase, step)}")
        if trainer.world_size > 1:
            StopAgreement(trainer.world_size).say_told()
    raise SystemExit(PREEMPTED_EXIT_CODE) from None


def start_process(cfg: DictConfig) -> None:
    _log_through_root()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if device_type(cfg) == "cuda":  # TF32 matmuls and convolutions; on CPU "high" could let oneDNN use bf16 arithmetic
        torch.set_float32_matmul_precision("high" if cfg.get("tf32", True) else "highest")
        torch.backends.cudnn.allow_tf32 = bool(cfg.get("tf32", True))


def build_trainer(cfg: DictConfig, layout: Layout, callbacks: list, loggers: list, shards_itself: bool) -> L.Trainer:
    """The trainer of `cfg.trainer`, with the strategy and precision of the run, its ranks read by Lightning's
    environment of whoever started every rank (torchrun, SLURM, Kubeflow, LSF), else ours (also inside a SLURM job of
    fewer tasks, whose SLURM_PROCID would make every worker rank 0). No model summary: the run logs its own
    (loggers/report.py). Lightning's DistributedSampler goes into the DataLoaders of a DataModule that does not shard
    itself, unless `trainer.use_distributed_sampler` says otherwise."""
    plugins = [build(p, f"trainer.plugins.{i}") for i, p in enumerate(cfg.trainer.get("plugins") or [])]
    plugins.append(precision_plugin(str(cfg.precision), device_type(cfg), Traits.of(cfg.strategy).whole_weights))
    plugins.append(cluster_environment(external_launcher(layout.world)))
    sampler = cfg.trainer.get("use_distributed_sampler")
    return build(
        cfg.trainer,
        "trainer",
        enable_model_summary=False,
        strategy=build_strategy(cfg.strategy, layout, cfg.get("fault_tolerance"), agreed_config(cfg, layout.world)),
        callbacks=callbacks,
        logger=loggers or False,
        plugins=plugins,
        use_distributed_sampler=not shards_itself if sampler is None else sampler,
    )


def end_process_group() -> None:
    """Leaving a gloo process group to interpreter shutdown can abort a rank on exit ("terminate called without
    an active exception", exit -6) after a successful run: closed while every rank is here."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _log_through_root() -> None:
    """Lightning's loggers bring console handlers of their own: where the root has handlers (Hydra's, the worker's),
    only the root's print, so each line is printed once and also logged to file."""
    if logging.getLogger().hasHandlers():
        for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True


# what a constructor raises for a value it refuses (TypeError: for an argument it does not take): the config's to fix
REFUSALS = (ValueError, TypeError, AssertionError)


def build(node, key: str, **kwargs):
    """hydra.utils.instantiate of the config at `key`, letting a UserError or Lightning's refusal raised by a
    constructor through as itself; a `_target_` that does not import, or a value the constructor refuses
    (REFUSALS), is a user error naming the key (Hydra's: a traceback in every process; the refusal's traceback is
    kept in the run's log). Any other exception is a bug, raised as it is."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, (UserError, MisconfigurationException)):
            raise cause from None
        if isinstance(cause, ImportError) and str(err).startswith("Error locating target"):
            raise UserError(_unimportable(err, key)) from None
        if isinstance(cause, REFUSALS):
            _, found, full_key = str(err).rpartition("\nfull_key: ")  # from the config's root, where Hydra says it
            raise refused(full_key if found and full_key else key, cause) from None
        raise


def refused(key: str, err: BaseException) -> UserError:
    """A value the library refused, as one line naming the key; its traceback in the run's log only."""
    log.info("%s was refused:", key, exc_info=err, extra={"file_only": True})
    return UserError(f"{key}: {' '.join(first_line(err).split())}")


def try_factories(node, key: str) -> None:
    """The module's `_partial_` optimizer and scheduler factories (the template's pattern) built once on a stand-in
    parameter: a value torch refuses (`lr=-1`) is one line now, not a traceback from inside fit."""
    from hydra.utils import get_object

    stand_in = [torch.nn.Parameter(torch.zeros(1))]
    for name, child in node.items():
        if not (OmegaConf.is_dict(child) and child.get("_partial_") and isinstance(child.get("_target_"), str)):
            continue
        try:
            target = get_object(child._target_)
        except Exception:
            continue  # building the module has said why
        if isinstance(target, type) and issubclass(target, torch.optim.Optimizer):
            given = stand_in
        elif isinstance(target, type) and issubclass(target, torch.optim.lr_scheduler.LRScheduler):
            given = torch.optim.SGD(stand_in, lr=1.0)
        else:
            continue
        factory = build(child, f"{key}.{name}")
        try:
            factory(given)
        except REFUSALS as err:
            raise refused(f"{key}.{name}", err) from None


def _unimportable(err: InstantiationException, key: str) -> str:
    """One line of Hydra's words: "Error loading '<target>':\n<why>\n<hint>" (the cause), "...\nfull_key: <key>"."""
    loading, *why = str(err.__cause__).splitlines()
    target = loading.removeprefix("Error loading '").removesuffix("':")
    _, found, full_key = str(err).rpartition("\nfull_key: ")  # from the config's root, where Hydra says it
    return f"{full_key if found and full_key else key}._target_={target}: cannot import it: {' '.join(why)}"


def use_channels_last(model: torch.nn.Module, weights: bool) -> None:
    """NHWC: every conv layer's input, and its weights where the strategy allows (FSDP2 shards contiguous ones)."""
    if weights:
        model.to(memory_format=torch.channels_last)
    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d):
            module.register_forward_pre_hook(_channels_last_input)


def _channels_last_input(conv, args):
    return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])


def saved_epoch(checkpoint: Path) -> int:
    """The epoch a checkpoint was saved in (a sharded one says it in its meta.pt); 1-based, as the epoch lines."""
    saved = torch.load(checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint, mmap=True, weights_only=True)
    return int(saved["epoch"]) + 1


def _floats(metrics) -> dict[str, float]:
    return {name: float(value) for name, value in metrics.items()}
