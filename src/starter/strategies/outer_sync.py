"""fault_tolerance.sync_every=H: replica groups that meet every H steps instead of every step (DiLoCo, through
torchft's `DiLoCo`). Each group takes H steps of its own optimizer (the inner one, the model's); then the groups
average their pseudo-gradients (the weights of the last sync minus their own now), and the outer optimizer
(`fault_tolerance.outer_optimizer`) steps the last synced weights by that average: every group then holds the same
weights again. A group sends its weights once every H steps instead of its gradients every step. A sync the quorum
does not commit leaves every group at the last synced weights: the H steps since are dropped."""

from collections.abc import Callable

import lightning as L
from torch import nn


class OuterSync:
    def __init__(self, manager, module: nn.Module, optimizer, ft):
        from hydra.utils import instantiate
        from torchft.local_sgd import DiLoCo

        outer = instantiate(ft.outer_optimizer)(module.parameters())
        diloco = DiLoCo(manager, [module], optimizer, outer, sync_every=ft.sync_every, pin_memory=False)
        # one fragment, the whole module; DiLoCo's optimizer hooks are not entered: fault_tolerant.py runs each sync
        # where it waits on torchft (a stop signal acted on meanwhile), and checks the groups' configs before it sends
        self.fragment, self.manager, self.every = diloco._fragments[0], manager, ft.sync_every

    def due(self, step: int, last: float) -> bool:
        """Whether the groups meet after global step `step`: every sync_every steps of the run (a resumed or joining
        group where the uninterrupted run would), and at the training's `last` step."""
        return step % self.every == 0 or step >= last

    def sync(self, agreed: Callable[[], bool]) -> bool | None:
        """A quorum (a group behind heals in it: weights, both optimizers, the last synced weights), the
        pseudo-gradients averaged and the outer step where it commits; whether it did. None, with nothing sent, where
        `agreed()` says this group's config is not the others'."""
        self.manager.start_quorum()  # synchronous under DiLoCo: healed when it returns
        if not agreed():
            return None
        self.fragment.prepare_sync()
        return self.fragment.perform_sync()


class SyncAfterStep(L.Callback):
    """The first callback at each batch's end: the groups' sync where it is due (FaultTolerant.sync_if_due)."""

    def __init__(self, strategy):
        self.strategy = strategy

    def on_train_batch_end(self, *args) -> None:
        self.strategy.sync_if_due()
