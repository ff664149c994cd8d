"""The `run_name` config resolver: the time-stamped name of this run's directory.

Under torchrun (or two torchrun "nodes"), every rank runs train.py and composes its own config; rank 0's name
is shared with the others through torchrun's own key-value store, so all ranks write into one directory.
"""

import os
from datetime import datetime
from functools import cache


@cache  # one name per process, however often Hydra resolves the run directory
def run_name() -> str:
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")  # microseconds: concurrent runs never collide
    if "TORCHELASTIC_RUN_ID" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return stamp
    from datetime import timedelta

    from torch.distributed import TCPStore  # only under torchrun

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=120))  # fmt: skip
    key = f"starter/run_name/{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    if int(os.environ["RANK"]) == 0:
        store.set(key, stamp)
    return store.get(key).decode()  # waits for rank 0
