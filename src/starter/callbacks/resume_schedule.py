"""What the learning-rate schedule does when a run resumes with a schedule planned differently (`ckpt_path=last
trainer.max_epochs=40` after 20 epochs of cosine decay). `replan` (default): the configured schedule takes over at the
resumed step, as if planned so from the start. `saved`: the checkpoint's goes on. One line says which, and how to get
the other; a resume with the same plan changes nothing."""

import logging
import warnings

import lightning as L
import torch

log = logging.getLogger(__name__)
PROGRESS_KEYS = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial"}


class ResumeSchedule(L.Callback):
    def __init__(self, mode: str = "replan"):
        if mode not in ("replan", "saved"):
            raise ValueError(f"resume_lr_schedule={mode}: choose replan or saved")
        self.mode = mode

    def on_train_start(self, trainer, pl_module) -> None:  # after Lightning restored the checkpoint
        if trainer.ckpt_path is None:
            return
        for config, (planned, planned_optimizer) in zip(trainer.lr_scheduler_configs, planned_schedules(pl_module)):
            if planned is None:
                continue
            restored = config.scheduler.state_dict()
            changed = {
                k: (restored.get(k), v)
                for k, v in planned.state_dict().items()
                if k not in PROGRESS_KEYS and restored.get(k) != v
            }
            if not changed:
                continue
            what = ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in changed.items())
            say = log.warning if trainer.is_global_zero else log.debug
            if self.mode == "saved":
                say(
                    "resumed lr schedule continues as saved (the config now says %s);"
                    " resume_lr_schedule=replan follows the config from here",
                    what,
                )
                continue
            with warnings.catch_warnings():  # torch warns that this optimizer never stepped: it never will
                warnings.simplefilter("ignore")
                for _ in range(restored["last_epoch"]):
                    planned.step()
            config.scheduler.load_state_dict(planned.state_dict())
            for live, fresh in zip(config.scheduler.optimizer.param_groups, planned_optimizer.param_groups):
                live["lr"] = fresh["lr"]
            say(
                "resumed lr schedule re-planned from the config (%s), lr now %s;"
                " resume_lr_schedule=saved keeps the checkpoint's",
                what,
                ", ".join(f"{g['lr']:.3g}" for g in planned_optimizer.param_groups),
            )


def planned_schedules(pl_module) -> list:
    """(scheduler, its optimizer) pairs as the module's configure_optimizers plans them now, untouched; in Lightning's
    order of `trainer.lr_scheduler_configs`. A scheduler that follows a metric (ReduceLROnPlateau) has no plan to
    replan: it is (None, None), kept as restored."""
    configured = pl_module.configure_optimizers()
    if isinstance(configured, dict):
        configured = [configured]
    elif isinstance(configured, (list, tuple)) and len(configured) == 2 and isinstance(configured[1], (list, tuple)):
        configured = [{"lr_scheduler": item} for item in configured[1]]  # ([optimizers], [schedulers])
    pairs = []
    for item in configured if isinstance(configured, (list, tuple)) else []:
        scheduler = item.get("lr_scheduler") if isinstance(item, dict) else None
        scheduler = scheduler.get("scheduler") if isinstance(scheduler, dict) else scheduler
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            pairs.append((None, None))
        elif scheduler is not None:
            pairs.append((scheduler, scheduler.optimizer))
    return pairs
