"""STARTER_JOB_TOKEN: the job's secret, given to every node and replica group in the environment and never written to a
file. What the job's processes tell each other where a stranger could write too (a failure, a stop or a lifeline in
the run's store; a replica group's config in a quorum's store; a heal's state) is believed only with a proof made with
it: an HMAC of what it says and where it says it, so nothing read can be replayed elsewhere. Without a token nothing is
proven, and anyone who reaches the ports can end the run (docs/guarantees.md)."""

import hashlib
import hmac
import os
import secrets

VARIABLE = "STARTER_JOB_TOKEN"
UNGUARDED = (
    f"{VARIABLE} is not set: anyone who reaches this job's ports can end it (the run's store) or, under torchft, join"
    f" its replica groups and replace their weights; give every node and group the same secret, e.g."
    f" export {VARIABLE}=$(python -c 'import secrets; print(secrets.token_hex(16))')"
)


def given() -> bool:
    return bool(os.environ.get(VARIABLE))


def make_for_this_host() -> None:
    """A job all of whose processes run on this host and start from this one: a token for them, where none is given."""
    if not given():
        os.environ[VARIABLE] = secrets.token_hex(16)


def proof(where: str, what: str | bytes) -> str:
    """The proof that `what`, said at `where`, was said by a holder of the token; "" where there is none."""
    if not (token := os.environ.get(VARIABLE)):
        return ""
    mac = hmac.new(token.encode(), where.encode() + b"\0", hashlib.sha256)
    mac.update(what if isinstance(what, bytes) else what.encode())
    return mac.hexdigest()


def proven(where: str, what: str | bytes, said: str) -> bool:
    return hmac.compare_digest(proof(where, what), said)


def signed(where: str, value: str) -> str:
    """`value` as a record at `where` carries it: its proof first."""
    return f"{proof(where, value)}:{value}"


def read_signed(store, key: str) -> str | None:
    """The value of the record at `key` in a store of torch's (check, then get: a get waits for a missing key); None
    where there is none, or its proof is not the token's."""
    return opened(key, store.get(key)) if store.check([key]) else None


def opened(where: str, record: bytes | str) -> str | None:
    """The value of a record at `where` (signed); None where its proof is not the token's (a stranger wrote it)."""
    text = record.decode(errors="replace") if isinstance(record, bytes) else record
    said, colon, value = text.partition(":")
    return value if colon and proven(where, value, said) else None
