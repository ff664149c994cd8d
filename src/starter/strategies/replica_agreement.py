"""fault_tolerance=torchft: replica groups must train the same thing. Each group's config, where it matters (the model,
its optimizer and schedule, the data and global batch, precision, the groups and their size), is compared with the
others' through the store of each new quorum, as torchft configures it, before any collective of that quorum: a group
joining with another config, or a number another group holds, is refused in one line naming the key; nothing reaches
a mismatched all-reduce."""

import json
from datetime import timedelta

HOST_OWN = ("root", "data_dir", "cache_dir", "download", "num_workers", "pin_memory", "persistent_workers")


def agreed_config(cfg, world: int) -> str:
    """What every replica group must train with, as JSON of dotted keys: the model (net, optimizer, lr schedule), the
    data (global batch, split; not where a host keeps it), precision, seed, epochs, clipping, the groups and their
    size. A group that differs is refused as it joins (`disagreement`), before any collective could mismatch."""
    from omegaconf import OmegaConf

    from starter.config_choices import leaves

    if not cfg.get("fault_tolerance"):
        return "{}"
    config = OmegaConf.to_container(cfg, resolve=True)
    trainer = {k: config["trainer"].get(k) for k in ("max_epochs", "max_steps", "gradient_clip_val")}
    data = {k: v for k, v in (config.get("data") or {}).items() if k not in HOST_OWN}
    chosen = {"model": config["model"], "data": data, "trainer": trainer, "precision": config["precision"]}
    chosen |= {"strategy": config["strategy"]["name"]}  # ddp's gradients, or fsdp's shards of them
    chosen |= {
        "seed": config["seed"],
        "fault_tolerance": {
            k: config["fault_tolerance"].get(k) for k in ("replica_groups", "sync_every", "outer_optimizer")
        },
    }
    return json.dumps(leaves(chosen | {"processes per group": world}), sort_keys=True, default=str)


def disagreement(store_addr: str, strategy, global_ranks: list[int], joining: bool) -> str | None:
    """Through the quorum's store (every group's process of this group rank writes there): a line where another
    group of the quorum claims this group's number, or trains with another config (said by a group `joining`, which
    is refused; a live group says whom it refuses); None where they agree."""
    from torchft.process_group import create_store_client

    me, ranks = strategy.ft.replica_group, list(global_ranks or ())
    if len(ranks) != len(set(ranks)):  # two groups of one number: torchft gives them one place
        taken = next(rank // strategy.world_size for rank in ranks if ranks.count(rank) > 1)
        if not joining:
            return f"a second replica group {taken} came: refused, training on"
        return f"replica group {taken} is here already; give each group its own fault_tolerance.replica_group"
    groups = sorted({rank // strategy.world_size for rank in ranks})
    store = create_store_client(store_addr, timedelta(seconds=strategy.ft.timeout_s))
    store.set(f"starter/config/{me}", strategy.agreed)
    ours = json.loads(strategy.agreed)
    for group in (g for g in groups if g != me):
        theirs = json.loads(store.get(f"starter/config/{group}"))
        if differ := sorted(key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key)):
            mine, other = (ours, theirs) if joining else (theirs, ours)
            said = ", ".join(f"{k}={mine.get(k, '(none)')} ({'replica group ' + str(group) if joining else 'here'}:"
                             f" {other.get(k, '(none)')})" for k in differ[:3])  # fmt: skip
            if not joining:
                return f"replica group {group} came with another config ({said}): refused, training on"
            return (
                f"replica group {me} trains another config than replica group {group}: {said}; start every group"
                " with the same config, its fault_tolerance.replica_group apart"
            )
    return None
