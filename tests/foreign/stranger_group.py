"""A stranger to a torchft job, written with torchft's own Manager: knowing only the lighthouse's address, it joins as
replica group 2 claiming step 10**6, echoes the first config it finds in the quorum's store as its own (the job's
format, the job's proof, under another number), and serves all-zero weights of the default model to any group that
heals from it. Runs for `seconds`, then leaves. python stranger_group.py LIGHTHOUSE SECONDS"""

import sys
import time
from datetime import timedelta
from functools import partial

import torch
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.process_group import create_store_client

from bed.nets import MLP
from bed.task import Classifier

lighthouse, seconds = sys.argv[1], float(sys.argv[2])
module = Classifier(MLP([1, 8, 8], 10), 10, partial(torch.optim.AdamW, lr=0.002))
optimizer = module.configure_optimizers()
zeros = {name: torch.zeros_like(t) for name, t in [*module.named_parameters(), *module.named_buffers()]}
state = {"model": zeros, "optimizer": optimizer.state_dict(), "schedulers": [],
         "position": torch.tensor([0, 0, 10**6, 1])}  # fmt: skip


class Echoing(ProcessGroupGloo):
    def configure(self, store_addr: str, *args, **kwargs):
        store = create_store_client(store_addr, timedelta(seconds=10))
        members = store.get("starter/members").decode().split()  # waits for the job's first member
        theirs = store.get(f"starter/member/{members[0].split(':')[1]}")
        store.set("starter/member/beef", theirs)
        store.append("starter/members", "2:beef ")
        super().configure(store_addr, *args, **kwargs)


served = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
manager = Manager(
    pg=Echoing(timeout=timedelta(seconds=10)),
    load_state_dict=lambda _: None,
    state_dict=lambda: state,
    min_replica_size=1,
    timeout=timedelta(seconds=10),
    rank=0,
    world_size=1,
    store_addr="127.0.0.1",
    store_port=served.port,
    lighthouse_addr=lighthouse,
    replica_id="replica_group_2",
    hostname="127.0.0.1",
    checkpoint_transport=HTTPTransport(timeout=timedelta(seconds=10), num_chunks=0),
)
manager.load_state_dict({"step": 10**6, "batches_committed": 0})
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    manager.start_quorum()
    manager.allreduce(torch.zeros(4)).wait()
    manager.should_commit()
    time.sleep(0.1)
print("stranger left", flush=True)
manager.shutdown(wait=False)
