"""fault_tolerance=torchft: replica groups must be this job's, and train the same thing. As torchft configures each new
quorum, before any collective of it, every member says its config in the quorum's store, with the job token's proof
(job_token.py), and reads every other member's: a member that cannot prove it (a stranger, another job), claims a
number outside the job's, holds another's number, or trains another config is refused, in one line naming what differs.
The config compared is the whole config less `fault_tolerance.host_own`: a new key is compared unless someone says
a host may keep it to itself."""

import json
import time
from datetime import timedelta
from fnmatch import fnmatchcase

from starter.config_choices import differences
from starter.job_token import opened, signed


def agreed_config(cfg, world: int) -> str:
    """What every replica group must train with, as JSON of dotted keys: the config, resolved, less the keys
    `fault_tolerance.host_own` names, and the processes per group."""
    from omegaconf import OmegaConf

    from starter.config_choices import leaves

    if not cfg.get("fault_tolerance"):
        return "{}"
    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("hydra", None)
    own = [pattern.split(".") for pattern in cfg.fault_tolerance.get("host_own") or ()]
    chosen = {key: value for key, value in leaves(config).items() if not _host_own(key, own)}
    return json.dumps(chosen | {"processes per group": world}, sort_keys=True, default=str)


def _host_own(key: str, patterns: list[list[str]]) -> bool:
    """Whether `key` (dotted) or a key above it matches a pattern (`*`: any one part)."""
    parts = key.split(".")
    return any(
        len(pattern) <= len(parts) and all(fnmatchcase(part, p) for part, p in zip(parts, pattern))
        for pattern in patterns
    )


def disagreement(store_addr: str, strategy, global_ranks: list[int], joining: bool) -> tuple[bool, str] | None:
    """Through the quorum's store: (leaves, line) where a member of the quorum is refused: `leaves` where it is this
    group, joining (another config, a number taken, another job's lighthouse), which then ends in that line; else this
    group refuses the quorum (a stranger, a member numbered outside the job, one joining with another config) and says
    the line. None where every member is this job's and agrees."""
    from torchft.process_group import create_store_client

    me, ft = strategy.ft.replica_group, strategy.ft
    store = create_store_client(store_addr, timedelta(seconds=ft.timeout_s))
    where = f"{store_addr}|{me}|{strategy.nonce}"
    store.set(f"starter/member/{strategy.nonce}", signed(where, strategy.agreed))
    store.append("starter/members", f"{me}:{strategy.nonce} ")
    expected, deadline = len(global_ranks or ()), time.monotonic() + ft.timeout_s
    while len(members := store.get("starter/members").decode().split()) < expected:
        if time.monotonic() > deadline:
            return False, f"the quorum's members did not say their configs within {ft.timeout_s:g} s: refused"
        time.sleep(0.05)
    ours, lighthouse = json.loads(strategy.agreed), ft.lighthouse or "the lighthouse"
    for member in members:
        group, _, nonce = member.partition(":")
        if nonce == strategy.nonce:
            continue
        if not group.isdigit() or not 0 <= int(group) < ft.replica_groups:
            return False, (
                f"a member claiming replica group {group[:20]} came, outside this job's 0 to {ft.replica_groups - 1}:"
                " refused"
            )
        said = store.get(f"starter/member/{nonce}")
        config = opened(f"{store_addr}|{group}|{nonce}", said)
        if config is None and int(group) == me and joining:
            return True, (
                f"replica group {group} at {lighthouse} is another job's (it cannot prove it holds this job's"
                " STARTER_JOB_TOKEN): give each job its own fault_tolerance.lighthouse_port"
            )
        if config is None:
            return False, (
                f"replica group {group} came without proof that it holds this job's STARTER_JOB_TOKEN (a stranger,"
                f" or another job's group at {lighthouse}): refused"
            )
        theirs = json.loads(config)
        differ = differences(ours, theirs, f"replica group {group}")
        if int(group) == me:
            if differ and joining:
                said = differences(ours, theirs, "theirs")
                return True, (
                    f"replica group {group} at {lighthouse} trains another config ({said}): it is another job's;"
                    " give each job its own fault_tolerance.lighthouse_port"
                )
            if not joining:
                return False, f"a second replica group {group} came: refused, training on"
            return True, f"replica group {me} is here already; give each group its own fault_tolerance.replica_group"
        if differ and not joining:
            said = differences(theirs, ours, "here")
            return False, f"replica group {group} came with another config ({said}): refused, training on"
        if differ:
            return True, (
                f"replica group {me} trains another config than replica group {group}: {differ}; start every group"
                " with the same config, its fault_tolerance.replica_group apart"
            )
    return None
