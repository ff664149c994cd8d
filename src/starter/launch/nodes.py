"""How the jobs of a run's nodes meet: the store they share (node 0's job serves it at MASTER_ADDR:MASTER_PORT; one
node's on a free port), the wait until every node is ready with the config node 0 has, said in one line where one
is missing, has failed, or runs another config, and a node's failure told to the others."""

import hashlib
import json
import os
import time
from datetime import timedelta

from starter.config_choices import differences, leaves
from starter.errors import LOST_EXIT_CODE, USER_ERROR_EXIT_CODE, WorkerFailed
from starter.job_token import read_signed, signed
from starter.run_failure import failure, report
from starter.run_store import answers, free_port, listening, serve_store
from starter.topology import key_prefix, node_rank

_node_store = None  # the store this job serves (node 0) or shares, held for as long as it runs


def join_nodes(address: str, port: int, serve: bool, timeout_s: float = 300.0):
    """The store at address:port (0: a free port) that the agent's rendezvous, the workers and the nodes' jobs share;
    node 0's job serves it. `multi_tenant`: the agent's rendezvous in this process serves through it, found by its
    port in torch's cache of servers. Never port 0: that cache keeps the entry of an ended store (an earlier job of a
    sweep) on a port the OS hands out again, and the rendezvous would then bind the port a second time (EADDRINUSE;
    after 63 stores in one process here)."""
    global _node_store
    from torch.distributed import DistNetworkError, TCPStore

    timeout = timedelta(seconds=timeout_s)
    for attempt in range(5):
        try:
            if not serve:
                _served(address, port, timeout_s)
                _node_store = TCPStore(address, port, wait_for_workers=False, multi_tenant=True, timeout=timeout)
            else:
                _node_store = serve_store(address, port or free_port(address), multi_tenant=True, timeout=timeout)
            return _node_store
        except (DistNetworkError, OSError):
            if port or attempt == 4:
                raise  # else another process took the free port first: another


def _served(address: str, port: int, timeout_s: float) -> None:
    """Until node 0's job serves the store at address:port (a client would wait in C, deaf to signals, a trace a try);
    a line where it has not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not listening(address, port):
        if time.monotonic() > deadline:
            line = f"node 0 has not served the nodes' store at {address}:{port} within {timeout_s:.0f} s (not started,"
            line += " or gone); start train.py on node 0 with the same MASTER_ADDR and MASTER_PORT"
            raise WorkerFailed(line, LOST_EXIT_CODE)
        time.sleep(0.2)


def node_store():
    """The store this job serves or shares with the other nodes' jobs; None before either."""
    return _node_store


def tell_the_other_nodes(run_id: str, code: int, line: str, wait_s: float, linger_s: float, say=False, nodes=2) -> None:
    """Writes this node's failure in the run's store (and prints `line` if `say`), where the other nodes' jobs and
    workers read it: they leave with `code`, saying it. A node that failed before it joined the others joins to tell
    them (within `wait_s`); node 0's job serves the store until the `nodes` have come (within `wait_s`), then
    `linger_s` for them to read it."""
    node, address, port = node_rank(), os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    store = node_store()
    if store is None and address and port:
        try:
            store = join_nodes(address, int(port), serve=node == 0, timeout_s=wait_s)
        except Exception:
            store = None  # node 0 never came: said here only
    prefix = key_prefix(run_id)
    report(store, code, line, node, prefix, say=say)  # under the workers' keys
    if node == 0 and store is not None:
        came = [[f"{prefix}/{what}/{n}" for what in ("ready", "failed/read")] for n in range(1, nodes)]  # met, or read
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not all(store.check(keys[:1]) or store.check(keys[1:]) for keys in came):
            time.sleep(0.2)
        time.sleep(linger_s)


def wait_for_all_nodes(store, prefix: str, nodes: int, node: int, wait_s: float, config: str) -> None:
    """Until every node's job is ready to launch with the config node 0's has (`config`: meeting_config); raises
    where another node failed before (it said why: said here too), has not come within `wait_s` (the agent's
    rendezvous would wait for it far longer, in a call nothing ends), or runs another config (every node says which).
    Each node's records carry the job token's proof, and are written again while the nodes meet: a stranger's is
    no node's, and one written over a node's lasts a moment."""
    fingerprint = hashlib.sha256(config.encode()).hexdigest()
    deadline = time.monotonic() + wait_s
    while True:
        for key, value in ((f"{prefix}/config/{node}", config), (f"{prefix}/ready/{node}", fingerprint)):
            store.set(key, signed(key, value))
        if node and not answers(store):
            line = f"node 0, which serves the nodes' store at {store.host}:{store.port}, is gone (killed, or its host"
            raise WorkerFailed(f"{line} lost) while the nodes met; start every node again", LOST_EXIT_CODE, node=0)
        if reported := failure(store, prefix):
            code, line, failed_node = reported
            raise WorkerFailed(line, code, node=failed_node)
        fingerprints = [read_signed(store, f"{prefix}/ready/{n}") for n in range(nodes)]
        missing = [n for n, fingerprint in enumerate(fingerprints) if fingerprint is None]
        if not missing:
            break
        if time.monotonic() > deadline:
            who = f"nodes {', '.join(map(str, missing))} have" if len(missing) > 1 else f"node {missing[0]} has"
            line = f"{who} not started within {wait_s:.0f} s; start train.py on every node with the same MASTER_ADDR"
            raise WorkerFailed(f"{line} and MASTER_PORT", LOST_EXIT_CODE)
        time.sleep(0.2)
    other = next((n for n in range(1, nodes) if fingerprints[n] != fingerprints[0]), None)
    if other is None:
        return
    configs = [read_signed(store, f"{prefix}/config/{n}") or "{}" for n in (other, 0)]
    line = disagreement(other, *map(json.loads, configs))
    store.set(f"{prefix}/disagreement_read/{node}", "")
    read_by_every_node = [f"{prefix}/disagreement_read/{n}" for n in range(nodes)]
    while node == 0 and time.monotonic() < deadline and not store.check(read_by_every_node):
        time.sleep(0.2)  # this job serves the store: until every node has read what it says
    raise WorkerFailed(line, USER_ERROR_EXIT_CODE, node=other)


NODE_OWN = ("paths", "log_file", "ckpt_path")  # keys a node may set for itself: its directories, its run's resume


def meeting_config(cfg) -> str:
    """What every node's job must agree on: its config as composed, not resolved (a value may name the node's own
    directory), but the keys each node may set for itself."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(cfg, resolve=False)
    return json.dumps({key: value for key, value in config.items() if key not in NODE_OWN}, sort_keys=True)


def disagreement(node: int, theirs: dict, ours: dict) -> str:
    """One line: how node `node`'s config differs from node 0's (a few keys)."""
    return (
        f"node {node} runs another config than node 0: {differences(leaves(theirs), leaves(ours), 'node 0')}; start"
        " every node with the same command and overrides (NODE_RANK apart), or give another run its own MASTER_PORT"
    )
