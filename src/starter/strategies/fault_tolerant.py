"""fault_tolerance=torchft: a lost replica group costs a step, not a restart (torchft, `pip install -e '.[ft]'`).

Each replica group is a run of its own (its own train.py, ranks, run directory, checkpoints), ddp or fsdp inside it
(fsdp: HSDP, each group's shards averaged with the same shard of every other group, groups of one size). Every
step, torchft's Manager asks the lighthouse for a quorum of the live groups, averages the gradients over them through a
process group that shrinks when a group is lost and grows when one comes back, and the optimizer steps only where the
quorum commits; a step it does not commit is redone on the same batch. A group that starts late, or comes back, joins
before its first batch: it heals from a live group (weights, optimizer, schedulers, callbacks' states such as a weight
average, step and the data position, sent with the job token's proof, read weights-only), applies the step it joined
in, and trains on. The data is split across groups and ranks as one ddp run of every group's processes would split it,
so with every group live the run is that ddp run. Only the job's groups take part (replica_agreement.py).
"""

import concurrent.futures
import logging
import os
import secrets
import sys
import threading
import time
from datetime import timedelta

import torch
from torch.distributed.tensor import DTensor

from starter.callbacks.preemption import SaveOnSigterm
from starter.callbacks.stop_agreement import StopAgreement, stop_line
from starter.errors import PREEMPTED_EXIT_CODE, UserError, to_stderr
from starter.strategies.torchft_setup import (
    proven_transport,
    reached_at,
    saying_quorums,
    store_reached_at,
    torchft,
)

log = logging.getLogger(__name__)

FAILURES = (TimeoutError, RuntimeError, OSError)  # torchft's, when no quorum can be had
REDOS = 10  # a step the quorum refuses this often in a row ends the run: the groups cannot agree


def fault_tolerant(strategy_class: type) -> type:
    """`strategy_class` (ddp's, fsdp's: a strategy whose traits declare `fault_tolerant`) with torchft's replica
    groups over it."""
    return type(f"FaultTolerant{strategy_class.__name__}", (FaultTolerant, strategy_class), {})


class FaultTolerant:
    """Mixed into a data-parallel strategy (fault_tolerant above): torchft's manager across the replica groups."""

    def __init__(self, *, fault_tolerance, agreed: str = "{}", **kwargs):
        super().__init__(**kwargs)
        self.ft, self.agreed, self.disagreement = fault_tolerance, agreed, None
        self.nonce = secrets.token_hex(8)  # this process among the quorum's members (replica_agreement.py)
        self.refusing, self.refusing_since = None, 0.0  # the line of a quorum refused, while it lasts
        self.joining = False
        self.manager, self.outer = None, None  # outer: fault_tolerance.sync_every (DiLoCo, outer_sync.py)
        self.groups: list[int] = []  # the replica groups of the last quorum

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """Training: this process's place among every group's processes; evaluation: within its own group (each
        group evaluates the whole split)."""
        kwargs = super().distributed_sampler_kwargs
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or not trainer.training:
            return kwargs
        world = kwargs["num_replicas"]
        return dict(
            kwargs, num_replicas=world * self.ft.replica_groups, rank=self.ft.replica_group * world + kwargs["rank"]
        )

    def setup_environment(self) -> None:
        super().setup_environment()  # the group's own processes: its process group (and fsdp's mesh)
        if self.manager is not None or not self.lightning_module.trainer.training:  # evaluation: within the group
            return
        ft = torchft()
        timeout = timedelta(seconds=self.ft.timeout_s)
        groups = ft.ProcessGroupNCCL if self.root_device.type == "cuda" else ft.ProcessGroupGloo
        try:
            self.manager = self._manager(ft, groups, timeout)
        except FAILURES as err:  # the lighthouse unreachable
            raise self._failed(err) from None

    def _manager(self, ft, groups, timeout: timedelta):
        return ft.Manager(
            pg=saying_quorums(groups, self, timeout=timeout),
            load_state_dict=self._heal,
            state_dict=self._state,
            min_replica_size=self.ft.min_replicas,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=self.ft.quorum_timeout_s),
            connect_timeout=timeout,
            rank=self.global_rank,
            world_size=self.world_size,
            store_addr=store_reached_at(),  # where the other groups reach it (publish_where_reached)
            store_port=int(os.environ["MASTER_PORT"]),
            hostname=reached_at(),  # the manager's, for the lighthouse to hand out (torchft's: the host's name)
            replica_id=f"replica_group_{self.ft.replica_group}",
            checkpoint_transport=proven_transport(timeout=timeout, num_chunks=0),
            use_async_quorum=not self.ft.get("sync_every"),  # DiLoCo's sync heals before it sends
        )

    def on_train_start(self) -> None:
        """Join the live groups before the first batch: heal where they are ahead (weights, optimizer, step, data
        position) and take part in the step they are in, so the first batch is trained with them."""
        super().on_train_start()
        trainer = self.lightning_module.trainer
        if not self.lightning_module.automatic_optimization or len(self.optimizers) != 1:
            raise UserError("fault_tolerance=torchft trains a module with one optimizer and automatic optimization")
        self.parameters_by_name = dict(self.lightning_module.named_parameters())  # fsdp's shards, outside forward
        # the manager's step, one meaning in every group: the steps committed, or under DiLoCo the syncs (a group
        # that comes back from its checkpoint is behind the live ones, never ahead: it heals from them)
        every = self.ft.get("sync_every") or 1
        self.manager.load_state_dict({"step": trainer.global_step // every, "batches_committed": 0})
        self.healed, self.behind, self.joining = None, 0, True
        optimizer, since, self.refused = self.optimizers[0], time.monotonic(), 0
        if self.ft.get("sync_every"):
            from starter.strategies.outer_sync import OuterSync, SyncAfterStep

            self.outer = OuterSync(self.manager, self.lightning_module, optimizer, self.ft)
            self.last_step = trainer.estimated_stepping_batches  # the training's last step: a sync there too
            if not any(isinstance(c, SyncAfterStep) for c in trainer.callbacks):  # first: before an average's update
                trainer.callbacks.insert(0, SyncAfterStep(self))
            if trainer.ckpt_path:
                log.warning("resumed under DiLoCo: the outer optimizer starts again from this checkpoint's weights")
        while True:  # until every group is in, join_timeout_s passed, or the live groups' step was taken
            self._stop_if_told()  # each quorum returns within the wait's poll: a stop is heard between them
            committed, stepped = self._join_step(optimizer)
            if not committed:
                continue
            if (
                stepped
                or len(self.groups) == self.ft.replica_groups
                or time.monotonic() - since > self.ft.join_timeout_s
            ):
                break
            time.sleep(0.2)
        if len(self.groups) < self.ft.replica_groups and self.global_rank == 0:
            log.warning(
                "replica group(s) %s not here after %g s: training with %d of %d (one that comes joins then)",
                ", ".join(str(g) for g in range(self.ft.replica_groups) if g not in self.groups),
                self.ft.join_timeout_s,
                len(self.groups),
                self.ft.replica_groups,
            )
        self.joining = False
        if stepped and self.outer is None:  # the live groups' step, with their gradients, here too: weights equal
            clip = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
            self.precision_plugin._clip_gradients(self.lightning_module, optimizer, *clip)  # as theirs are
            optimizer.step()
        optimizer.zero_grad()
        if self.healed is not None:
            if stepped and self.outer is None:  # DiLoCo's live groups sync after their schedulers stepped
                self._schedule_after(trainer, *self.healed)
            self._go_to(trainer, *self.healed, stepped)
            self.healed = None

    def _join_step(self, optimizer) -> tuple[bool, bool]:
        """One quorum of the join, as the live groups' own (a step's, or a DiLoCo sync): whether it committed, and
        whether it took the live groups' step (this group contributing none)."""
        if self.outer is not None:
            committed = self._sync()
            return committed, committed and self.live_step
        self.manager.start_quorum()
        self._agree()
        for p in _parameters(optimizer):
            p.grad = None
        stepped = self._average(optimizer, contributes=False)
        return self._committed(), stepped

    def _schedule_after(self, trainer, epoch: int, done: int, step: int) -> None:
        """The lr schedulers' calls the live groups' loop makes after the step this group joined in (Lightning's
        rule: a step's, and an epoch's if the step ends it; a plateau's needs their metric and is left)."""
        ends_epoch = done + 1 >= trainer.num_training_batches
        for config in trainer.lr_scheduler_configs:
            index = done + 1 if config.interval == "step" else epoch + 1
            if not config.reduce_on_plateau and index % config.frequency == 0:
                if config.interval == "step" or ends_epoch:
                    self.lightning_module.lr_scheduler_step(config.scheduler, None)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        trainer = self.lightning_module.trainer
        if self.outer is not None:  # DiLoCo: the step as Lightning makes it (the groups sync after it: sync_if_due)
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.behind:  # healed mid-run: the live groups trained this many more batches; these are not applied
            self.behind -= 1
            return closure()
        self.refused = 0
        while True:
            self.manager.start_quorum()
            result = closure()  # forward, backward (ddp averages within the group)
            self._average(optimizer, contributes=True)
            if self._committed():
                break
            log.warning(
                "replica group %d: the quorum did not commit step %d; training it again on the same batch",
                self.ft.replica_group,
                trainer.global_step + 1,
            )
        if self.healed is None:
            return super().optimizer_step(optimizer, lambda: result, model, **kwargs)
        # the others committed a step this group did not: healed from them, it skips the batches they trained since
        self.behind, self.healed = self.healed[2] - trainer.global_step, None
        output = super().optimizer_step(optimizer, lambda: result, model, **kwargs)
        for group, own in zip(optimizer.param_groups, self.own_groups):
            group.update(own)
        return output

    def sync_if_due(self) -> None:
        """DiLoCo, once Lightning has counted a step (its schedulers stepped, its batch not yet done): the groups' sync
        where the global step is a multiple of sync_every, or the training's last (every group's model.pt is the
        synced weights). A stop during it saves that step once: a resume trains on from the next batch. A group healed
        in one (its last sync refused where the others' committed) trained as many steps as they did: only its lr
        stays its own."""
        trainer = self.lightning_module.trainer
        if not self.outer.due(trainer.global_step, self.last_step):
            return
        if not self._sync():
            log.warning(
                "replica group %d: the quorum did not commit the sync at step %d; every group back at the last"
                " synced weights, training on",
                self.ft.replica_group,
                trainer.global_step,
            )
        elif self.healed is not None:
            self.healed = None
            for group, own in zip(self.optimizers[0].param_groups, self.own_groups):
                group.update(own)

    def _sync(self) -> bool:
        """A DiLoCo sync (outer_sync.py), waited on as torchft's other waits are; whether the quorum committed it. A
        joining group whose config is not the others' is refused before it sends anything."""
        self.live_step = False
        try:
            committed = self._waited(lambda: self.outer.sync(agreed=lambda: not self._leaves()))
        except FAILURES as err:
            raise self._failed(err) from None
        if committed is None:
            raise UserError(self.disagreement[1])
        if committed:
            self.refused = 0
        return committed or self._refused()

    def _agree(self) -> None:
        """The quorum formed (its groups' configs compared as it was configured): a group joining with a config the
        others do not train with is refused in one line, before its first collective."""
        try:
            self._waited(self.manager.wait_quorum)
        except FAILURES as err:
            raise self._failed(err) from None
        if self._leaves():
            raise UserError(self.disagreement[1])

    def _leaves(self) -> bool:
        """Whether this group, joining, was refused by the quorum (its config, its number): it ends in one line."""
        return bool(self.disagreement and self.disagreement[0])

    def refuse(self, line: str) -> None:
        """A quorum with a member refused (replica_agreement.py; torchft_setup.saying_quorums): no step of it is
        committed, until a quorum without that member forms or quorum_timeout_s passes."""
        if self.refusing is None:
            self.refusing_since = time.monotonic()
            if self.global_rank == 0:
                log.warning(line)
        self.refusing = line

    def _committed(self) -> bool:
        """torchft's commit decision; its failures (no lighthouse, a quorum timed out) as one line."""
        try:
            if self._waited(self.manager.should_commit):
                return True
        except FAILURES as err:
            raise self._failed(err) from None
        return self._refused()

    def _refused(self) -> bool:
        """False; the run ended in one line where the quorum refused REDOS times in a row, or a quorum with a member
        refused lasted quorum_timeout_s (its steps tried again each half second meanwhile)."""
        if self.refusing is not None:
            if time.monotonic() - self.refusing_since > self.ft.quorum_timeout_s:
                raise self._ended(f"{self.refusing.removesuffix(', training on')} for {self.ft.quorum_timeout_s:g} s")
            time.sleep(0.5)
            return False
        self.refused += 1
        if self.refused == REDOS:
            raise self._ended(f"{REDOS} quorums in a row did not commit a step")
        return False

    def _ended(self, what: str) -> UserError:
        """The run's end in one line, this group's state saved first."""
        saved = self._save_last() if not self.joining else ""
        return UserError(f"replica group {self.ft.replica_group}: {what}{saved}")

    def _waited(self, call):
        """A torchft call that waits (for a quorum, a heal, a commit), run on a thread of its own: a stop signal that
        comes meanwhile is acted on within half a second, last.ckpt saved as the weights stand (a step is applied
        only once committed: a resume trains it again), the run then stopped as at any step (exit 143)."""
        waiting = concurrent.futures.Future()

        def wait() -> None:  # a daemon thread: one still waiting never holds the process's exit
            try:
                waiting.set_result(call())
            except BaseException as err:
                waiting.set_exception(err)

        threading.Thread(target=wait, name="torchft-wait", daemon=True).start()
        # not result(timeout=): its "not yet" is the builtin TimeoutError, which torchft's own timeouts raise too
        while not concurrent.futures.wait([waiting], timeout=0.5).done:
            self._stop_if_told()
        return waiting.result()

    def _stop_if_told(self) -> None:
        if (stops := SaveOnSigterm.listening) is not None and stops.received:
            self._stop_now(stops)

    def _stop_now(self, stops: SaveOnSigterm) -> None:
        """A stop signal during a torchft wait: last.ckpt saved (joining: nothing new to save), the run's line said by
        rank 0 (as run.py says it), the loggers' rows written, and the process ended here: torchft's own quorum
        thread may wait quorum_timeout_s more, and the interpreter's exit would wait for it."""
        trainer = self.lightning_module.trainer
        if not self.joining:
            self._save_last()
        for logger in trainer.loggers:
            logger.save()
        if trainer.is_global_zero:
            line = stop_line(stops.received, stops.path.parent.parent, stops.received_in, stops.saved_step)
            to_stderr(f"error: {line}")
            if trainer.world_size > 1:
                StopAgreement(trainer.world_size).say_told()
        sys.stdout.flush()
        os._exit(PREEMPTED_EXIT_CODE)

    def _save_last(self) -> str:
        """checkpoints/last.ckpt, as the weights stand; what a line then says of it."""
        stops, trainer = SaveOnSigterm.listening, self.lightning_module.trainer
        if stops is None or trainer.global_step == 0:
            return ""
        trainer.save_checkpoint(stops.path)
        stops.saved_step = trainer.global_step
        return f"; checkpoints/last.ckpt saved at step {trainer.global_step}, resume with ckpt_path=auto"

    def _failed(self, err: BaseException) -> UserError:
        """torchft's failure (no quorum, no lighthouse) as one line naming what is missing, this group's state saved
        first."""
        from starter.strategies.lighthouse import status

        saved = self._save_last() if self.manager is not None and not self.joining else ""
        address, said = os.environ.get("TORCHFT_LIGHTHOUSE"), " ".join(str(err).split())[:200]
        if status(address) is None:
            what = f"the lighthouse at {address} does not answer (its process or its host gone)"
        else:
            what = f"no quorum of {self.ft.min_replicas} group(s) at the lighthouse at {address}"
        return UserError(
            f"replica group {self.ft.replica_group}: {what}; torchft said: {said}"
            f" (quorum_timeout_s={self.ft.quorum_timeout_s:g}){saved}"
        )

    def _average(self, optimizer, contributes: bool) -> bool:
        """Every gradient averaged over the quorum's groups in one all-reduce (none: zeros); returns whether any group
        contributed one (a group joining contributes none). Under fsdp, this process's shards: torchft's process group
        pairs each rank with the same rank of every group, which holds the same shards."""
        params = _parameters(optimizer)
        device = self.root_device  # fsdp's cpu_offload keeps shards and their gradients in CPU memory
        grads = [_local(p.grad if p.grad is not None else torch.zeros_like(p)) for p in params]
        flag = torch.full((1,), float(contributes), device=device)
        flat = torch.cat([g.reshape(-1).to(device, torch.float32) for g in grads] + [flag])
        try:
            self._waited(self.manager.wait_quorum)
            if self.refusing is not None:  # a member refused: nothing sent to it (the step is not committed)
                self.manager.report_error(RuntimeError(self.refusing))
            self._waited(lambda: self.manager.allreduce(flat).wait())
        except FAILURES as err:  # the quorum itself failed (a failed all-reduce is the commit's: refused)
            raise self._failed(err) from None
        offset = 0
        for p in params:
            shard = _local(p)
            chunk = flat[offset : offset + shard.numel()].view_as(shard).to(shard.device, p.dtype)
            offset += shard.numel()
            if p.grad is None:
                p.grad = _placed_as(p, chunk.clone())
            else:
                _local(p.grad).copy_(chunk)
        return not contributes and bool(flat[-1] > 0)  # read only when joining: the training step stays async

    def _state(self) -> dict:
        """What a joining group heals from (called in the quorum's thread, before this step's optimizer step); the
        batches done in this epoch: all of them (a run resumed at an epoch's end) are none of the next."""
        trainer = self.lightning_module.trainer
        done = trainer.fit_loop.epoch_loop.batch_progress.current.completed % max(trainer.num_training_batches, 1)
        step = trainer.global_step - (self.outer is not None and not self.joining)  # DiLoCo's: after Lightning counted
        return {
            "model": _local(self._weights()),  # fsdp: this rank's shards, the healing rank's too
            "optimizer": _local(self.optimizers[0].state_dict()),
            "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "callbacks": self._callback_states(),
            # where it is; 1 where it is in a step of its training (not joining): a group healing then takes it too
            "position": torch.tensor([trainer.current_epoch, done, step, int(not self.joining)]),
        }

    def _weights(self) -> dict:
        """The module's parameters by name, as the optimizer holds them (fsdp's shards: the gathered ones it swaps in
        for forward and backward, which run meanwhile, are not read, nor its state-dict hooks called), and its
        buffers; read and written in torchft's quorum thread."""
        return self.parameters_by_name | dict(self.lightning_module.named_buffers())

    def _heal(self, state: dict) -> None:
        """Joining: the live group's state as it is. Mid-run (a step only this group's quorum refused), its weights and
        optimizer, but this group's lr schedule: its loop, catching up, makes the calls theirs made (none twice)."""
        trainer, optimizer = self.lightning_module.trainer, self.optimizers[0]
        with torch.no_grad():  # in place: fsdp's shards stay where they are
            for name, tensor in self._weights().items():
                _local(tensor).copy_(state["model"][name])
        own = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        params, saved = _parameters(optimizer), state["optimizer"]
        saved["state"] = {
            i: {k: _placed_as(params[i], v) if isinstance(v, torch.Tensor) and v.dim() else v for k, v in s.items()}
            for i, s in saved["state"].items()
        }
        optimizer.load_state_dict(saved)  # its lr applies the step this group heals in
        self._load_callback_states(state["callbacks"])
        if self.joining:
            for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"]):
                config.scheduler.load_state_dict(saved)
        else:
            self.own_groups = own
        *self.healed, self.live_step = [int(v) for v in state["position"]]
        log.info("replica group %d healed from a live group at step %d", self.ft.replica_group, self.healed[2])

    def _carried(self) -> list:
        """The callbacks whose state a healed group takes from the live one: every one's, but a checkpoint's (files of
        its group's own) and a state of its process's own (`per_process_state`: random generators, the world)."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks = self.lightning_module.trainer.callbacks
        return [c for c in callbacks if not isinstance(c, ModelCheckpoint) and not getattr(c, "per_process_state", 0)]

    def _callback_states(self) -> dict:
        """Each carried callback's state_dict by its state key; a weight average's (Lightning's WeightAveraging)
        averaged weights with it, which its checkpoint hooks keep outside its state_dict."""
        from lightning.pytorch.callbacks import WeightAveraging

        states = {}
        for callback in self._carried():
            state = dict(callback.state_dict())
            if isinstance(callback, WeightAveraging) and callback._average_model is not None:
                state["average"] = _local(callback._average_model.state_dict())
            states[callback.state_key] = state
        return states

    def _load_callback_states(self, states: dict) -> None:
        for callback in self._carried():
            if (state := states.get(callback.state_key)) is None:
                continue
            if (average := state.pop("average", None)) is not None:
                with torch.no_grad():  # in place: the average's tensors are held by its update
                    for name, tensor in callback._average_model.state_dict().items():
                        _local(tensor).copy_(average[name])
                if hasattr(callback, "updates"):  # ours (callbacks/weight_averaging.py): its count read again
                    callback.updates = None
            callback.load_state_dict(state)

    def _go_to(self, trainer, epoch: int, done: int, step: int, stepped: bool) -> None:
        """The healed group's loops and training data where the live groups' are after the step it joined in."""
        if stepped:
            done, step = done + 1, step + 1
        if done >= trainer.num_training_batches:
            epoch, done = epoch + 1, 0
        loops = trainer.fit_loop.state_dict()
        batches = loops["epoch_loop.batch_progress"]
        batches["total"] = dict.fromkeys(batches["total"], step)
        batches["current"] = dict.fromkeys(batches["current"], done)
        batches["is_last_batch"] = False
        steps = loops["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
        for progress in steps.values():
            progress["total"] = dict.fromkeys(progress["total"], step)
            progress["current"] = dict.fromkeys(progress["current"], done)
        # as a checkpoint has it: Lightning adds the batch it was saved at when it restarts mid-epoch
        loops["epoch_loop.state_dict"]["_batches_that_stepped"] = step - (done > 0)
        started = epoch + (done > 0)
        for counts in loops["epoch_progress"].values():
            counts.update(ready=started, started=started, processed=epoch, completed=epoch)
        loops["state_dict"] = {}
        trainer.fit_loop.load_state_dict(loops)
        for loop in (trainer.fit_loop, trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_loop.val_loop):
            loop.reset_restart_stage()  # as a fresh start has them: a checkpoint resumed mid-epoch set its own
        for loader in trainer.fit_loop._combined_loader.flattened:  # a loader that resumes mid-epoch skips ahead
            if hasattr(loader, "load_state_dict"):
                loader.load_state_dict({"epoch": epoch, "batches": done})

    def teardown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        super().teardown()


def _parameters(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _local(state):
    """`state` (a tensor, or dicts and lists of them) with fsdp's sharded tensors (DTensors) as this process's shard."""
    if isinstance(state, dict):
        return {k: _local(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_local(v) for v in state)
    return state.to_local() if isinstance(state, DTensor) else state


def _placed_as(parameter, shard: torch.Tensor) -> torch.Tensor:
    """`shard` (this process's) as `parameter` is held: a DTensor over the same mesh where fsdp shards it."""
    if not isinstance(parameter, DTensor):
        return shard
    mesh, placements = parameter.device_mesh, parameter.placements
    return DTensor.from_local(shard, mesh, placements, shape=parameter.shape, stride=parameter.stride())
