"""ddp_spawn: Lightning's DDPStrategy with processes started by torch.multiprocessing.spawn, made safe on CPU.

Four things a spawned run needs that Lightning 2.6 does not do:
- Unshare every tensor of the model. mp.spawn passes tensors through shared memory; Lightning clones the
  parameters and buffers in each process, but a torchmetrics state is a plain tensor attribute, so all ranks
  added into ONE `weight`/`tp` tensor (counts doubled before the sync, and doubled again by it) and two ranks'
  unsynchronised `+=` could lose an update: test/loss wrong by one batch's weight, seen in CI.
- Hold the rendezvous port. Lightning picks a port that is free now and rank 0 binds it seconds later (after
  importing torch), so two runs started at once could take the same one. The store is served by this
  process instead, on a port the OS picks, as in launch/launcher.py; the children are its clients.
- Close the process group when the process is done. Left to interpreter shutdown, gloo can abort a rank
  after a successful run ("terminate called without an active exception", exit -6). Done after the whole
  fit/test, user hooks included, and only on success: a failed rank must exit, not wait for the others.
- Run the watchdog (launch/watchdog.py) in every rank, as our launcher's workers do: an error is said once, in one
  line naming its rank, and a rank that stops answering (or a run in which no rank moves) ends the run within
  `heartbeat_timeout_s` (`stall_timeout_s`) instead of the process group's 30 minutes; a stopped rank is killed by
  the rank that names it (torch's join would give it 30 s to act on a SIGTERM it cannot see). A failed rank's code
  becomes the job's (WorkerFailed).
"""

import os

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn
from torch.multiprocessing import ProcessExitedException

from starter.launch.launcher import AGENT_STORE, WorkerFailed, name_process, serve_store, worker_failed
from starter.launch.quick_exit import quick_exit
from starter.launch.watchdog import Watchdog, failure


class DDPSpawnStrategy(DDPStrategy):
    def __init__(self, watchdog: dict, **kwargs):
        """`watchdog`: the run's `heartbeat_timeout_s` and `stall_timeout_s` (conf/strategy/ddp_spawn.yaml), for each
        rank's watchdog."""
        super().__init__(start_method="spawn", **kwargs)
        self.timeouts_s = (float(watchdog["heartbeat_timeout_s"]), float(watchdog["stall_timeout_s"]))

    def _configure_launcher(self) -> None:
        self._launcher = _SafeSpawnLauncher(self, start_method=self._start_method)


class _SafeSpawnLauncher(_MultiProcessingLauncher):
    def launch(self, function, *args, trainer=None, **kwargs):
        environment = self._strategy.cluster_environment
        if "MASTER_PORT" in os.environ or type(environment) is not LightningEnvironment:
            return self._launch(function, *args, trainer=trainer, **kwargs)  # a port the user or cluster chose
        store = serve_store(environment.main_address)
        environment._main_port = store.port  # Lightning sets MASTER_PORT from it for the children
        os.environ.update(AGENT_STORE)  # every rank a client of this store
        try:
            return self._launch(function, *args, trainer=trainer, store=store, **kwargs)
        finally:  # the next fit/test gets a store of its own; nothing leaks into later runs from this process
            environment._main_port = -1
            for name in ("MASTER_PORT", *AGENT_STORE):
                os.environ.pop(name, None)

    def _launch(self, function, *args, trainer=None, store=None, **kwargs):
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except ProcessExitedException as err:  # a rank ended: it said why, or a signal ended it (said here)
            if store is not None and (found := failure(store)):  # a watchdog said it (and killed a stopped rank)
                raise WorkerFailed(None, found[0]) from None
            raise worker_failed(err.error_index, self._strategy.num_processes, err.exit_code) from None

    def _wrapping_function(self, process_idx, trainer, function, args, kwargs, *rest, **more) -> None:
        strategy = self._strategy
        rank = strategy.node_rank * strategy.num_processes + process_idx
        name_process(f"rank {rank}")
        holder = "train.py, which spawned the ranks," if AGENT_STORE.keys() <= os.environ.keys() else "rank 0 (node 0)"
        watchdog = Watchdog(strategy.cluster_environment.main_address, int(os.environ["MASTER_PORT"]), rank,
                            strategy.num_nodes * strategy.num_processes, strategy.num_processes, *strategy.timeouts_s,
                            store_holder=holder, kills_stopped_peers=True)  # fmt: skip
        with quick_exit(), watchdog.reporting():  # rank 0's results are in the parent's queue by the end
            args, kwargs = apply_to_collection((args, kwargs), dtype=nn.Module, function=unshare_tensor_attributes)
            super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest, **more)
            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()


def unshare_tensor_attributes(module: nn.Module) -> nn.Module:
    """Give this process its own copy of every shared-memory tensor kept as a plain module attribute."""
    for submodule in module.modules():
        for name, value in list(vars(submodule).items()):
            if isinstance(value, torch.Tensor) and value.is_shared():
                setattr(submodule, name, value.clone())
    return module
