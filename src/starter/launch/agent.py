"""Starts one worker per device of this node with torch's elastic agent, the engine inside torchrun (`elastic_launch`),
for the strategies whose traits name a start method (ddp, ddp_spawn, fsdp, tp, pp).

Lightning's own launcher re-runs `sys.argv` in every child, which under Hydra re-composes the config, makes a second run
directory and re-launches a sweep: here the Hydra job only launches, and every worker runs its resolved config. The
agent's rendezvous is torchrun's static one (this node's rank: NODE_RANK, as `torchrun --node-rank`) at a store that
node 0's job serves: on one node on a free port (one another process takes first: the next); on several at MASTER_PORT,
the store that named the run (run_name.py). Workers fork from a fork server that imported torch and Lightning once
(ddp_spawn's are spawned), each running worker.py's `work`. Inside each, our watchdog (watchdog.py) ends the run when a
rank fails, stops answering or stalls; beside the agent, oversight.py names a worker a signal killed, ends this node's
workers on another node's failure, and kills a stopped worker rather than wait for it. The nodes meet first (nodes.py).
Details: docs/modes.md, "How ddp is launched"."""

import logging
import os
import signal
import time
from pathlib import Path

from starter.errors import PREEMPTED_EXIT_CODE
from starter.fork_server import fork_server
from starter.launch.nodes import join_nodes, meeting_config, node_store, wait_for_all_nodes
from starter.launch.oversight import Oversight
from starter.launch.worker import work
from starter.topology import Layout, key_prefix, node_rank


def start_workers(
    job: str,
    preload: tuple[str, ...],
    config_path: Path,
    layout: Layout,
    run_id: str,
    start_method: str = "forkserver",
    stop_signals=("SIGTERM",),
    grace_s: float = 10.0,
    linger_s: float = 0.0,
    wait_s: float = 300.0,
    composed=None,
) -> None:
    """Runs `job` ("module:function") with the config at `config_path` in one worker per device of this node.
    `composed`: the job's config as composed, what this node must agree on with node 0 (nodes.meeting_config)."""
    devices, node = layout.processes_per_node, node_rank()
    # OMP_NUM_THREADS as torchrun's: the cores shared out, not every worker running a thread per core of the machine
    threads = int(os.environ.get("OMP_NUM_THREADS", max(1, len(os.sched_getaffinity(0)) // devices)))
    if start_method == "forkserver":
        fork_server(preload)  # first: its imports and this process's (the agent's torch) overlap
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    elastic = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    for name in [*elastic, *logging.Logger.manager.loggerDict]:  # our lines say what failed; each of torch's elastic
        if name.startswith(elastic):  # modules sets a level of its own ("Received 15 death signal...": a warning)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT") or 0)
    store = (layout.nodes > 1 and node_store()) or join_nodes(address, port, serve=node == 0)
    prefix = key_prefix(run_id)
    meeting = meeting_config(composed) if composed is not None else "{}"
    wait_for_all_nodes(store, prefix, layout.nodes, node, wait_s, meeting)
    config = LaunchConfig(
        min_nodes=layout.nodes,
        max_nodes=layout.nodes,
        nproc_per_node=devices,
        run_id=run_id,
        rdzv_backend="static",
        rdzv_endpoint=f"{address}:{store.port}",
        rdzv_configs={"rank": node},
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=os.devnull),
        signals_to_handle=",".join(stop_signals or ["SIGTERM"]),
        shutdown_timeout=int(grace_s),
    )
    oversight = Oversight(store, prefix, layout, config_path.parent, grace_s, linger_s)
    try:
        elastic_launch(config, work)(str(config_path), job, dict(os.environ, OMP_NUM_THREADS=str(threads)), os.getpid())
    except SignalException as stop:  # the agent forwarded it to the workers and gave them `grace_s` to end
        raise oversight.stopped(signal.Signals(stop.sigval).name, wait_s=grace_s if layout.nodes > 1 else 1.0) from None
    except ChildFailedError as err:
        failed = oversight.failed(err.failures)
        # this job serves the store: the other nodes read the failure from it first, but for the one that wrote it
        stop = failed.exit_code == PREEMPTED_EXIT_CODE  # the other nodes have read it (Oversight.stopped)
        if node == 0 and layout.nodes > 1 and not stop and not (layout.nodes == 2 and failed.node == 1):
            time.sleep(linger_s)
        raise failed from None
    finally:
        oversight.stop()
