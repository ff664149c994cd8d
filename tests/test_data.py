"""The engine's DataModule (starter/data/base.py) on the test bed's data: sharding, batch-size semantics, loader
workers, mixing. The examples' data modules: tests/examples/test_example_data.py."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bed.data import Digits, RandomImages
from conftest import as_rank
from starter.errors import UserError

DIGITS = dict(image_shape=[1, 8, 8], num_classes=10)


def batches(loader, epoch: int = 0):
    sampler = loader.batch_sampler.sampler
    sampler.set_epoch(epoch)  # what Lightning's fit loop does each epoch
    return list(loader)


def test_two_ranks_together_load_exactly_the_single_process_global_batches():
    single, ranks = (
        Digits(batch_size=64, **DIGITS),
        [Digits(batch_size=64, **DIGITS) for _ in range(2)],
    )
    for dm in (single, *ranks):
        dm.setup()
    for epoch in (0, 1):
        full = batches(as_rank(single, 1, 0).train_dataloader(), epoch)
        shards = [batches(as_rank(dm, 2, r).train_dataloader(), epoch) for r, dm in enumerate(ranks)]
        assert len(full) == len(shards[0]) == len(shards[1]) == 1257 // 64
        for step, (x, _) in enumerate(full):
            assert x.shape == (64, 1, 8, 8) and shards[0][step][0].shape == (32, 1, 8, 8)
            together = torch.cat([shards[0][step][0], shards[1][step][0]])
            assert sorted(map(tuple, together.flatten(1).tolist())) == sorted(map(tuple, x.flatten(1).tolist()))
    first_epoch, second_epoch = (batches(single.train_dataloader(), e)[0][1] for e in (0, 1))
    assert not torch.equal(first_epoch, second_epoch)  # reshuffled each epoch


class RandomCrops(torch.utils.data.Dataset):
    """An augmenting data set: each item drawn from the loader worker's random generator."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int):
        return torch.randint(0, 256, (1, 2, 2), dtype=torch.uint8), index % 2


def test_loader_workers_of_one_tensor_parallel_group_draw_the_same_augmentations(monkeypatch):
    # Two processes of one tensor-parallel group (or pipeline) of 4 processes in 2 groups: data-parallel place 1,
    # global ranks 2 and 3. The trainer seeds loader workers as Lightning does (seed_everything(workers=True)), from
    # the global rank unless the loader brings its own; and each process's global generator has drawn differently.
    from lightning.fabric.utilities.data import _auto_add_worker_init_fn

    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    drawn = []
    for global_rank in (2, 3):
        data = RandomImages(batch_size=4, image_shape=[1, 2, 2], num_classes=2, num_workers=1)
        dm = as_rank(data, world=2, rank=1, global_rank=global_rank, processes=4)
        dm.train_set = RandomCrops()
        torch.manual_seed(global_rank)
        loader = dm.train_dataloader()
        _auto_add_worker_init_fn(loader, global_rank)
        drawn.append(torch.cat([images for images, _ in batches(loader)]))
    assert torch.equal(drawn[0], drawn[1])


def test_loader_workers_of_two_places_or_two_ids_draw_differently():
    drawn = {}
    for place in (0, 1):
        dm = as_rank(RandomImages(batch_size=4, image_shape=[1, 2, 2], num_classes=2, num_workers=2), 2, place)
        dm.train_set = RandomCrops()
        drawn[place] = [images for images, _ in batches(dm.train_dataloader())]
    # each worker reads every other batch: batches 0 and 1 come from workers 0 and 1
    assert not torch.equal(drawn[0][0], drawn[1][0]) and not torch.equal(drawn[0][0], drawn[0][1])


class ParentOfTheWorker(torch.utils.data.Dataset):
    """Each item: the process id of the parent of the loader worker that read it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        return torch.tensor(os.getppid()), index % 2


def test_loader_workers_are_forks_of_a_server_that_imports_the_data_set_not_of_the_training_process():
    # A fork copies the training process's threads (gloo's, the store's, the watchdog's, pyarrow's jemalloc thread)
    # at an arbitrary instant: a lock one of them held stays held in the worker. One fork server starts them all,
    # asked to import the data set's module and the workers' seeding (a process's first loader's: its server's).
    from starter.fork_server import fork_server

    dm = as_rank(RandomImages(batch_size=4, image_shape=[1, 2, 2], num_classes=2, num_workers=2), 1, 0)
    dm.train_set = ParentOfTheWorker()
    loader = dm.train_dataloader()
    parents = {int(pid) for pids, _ in batches(loader) for pid in pids}
    assert len(parents) == 1 and parents != {os.getpid()}
    assert loader.multiprocessing_context is fork_server((__name__, "starter.data.worker_seed"))


IMPORTED_BY = """
import atexit
import os
import subprocess
import sys
IMPORTED_BY = os.getpid()
# Torch's, Lightning's exit hooks, in a server that preloaded them: it ends without them (fork_server_exit.py)
atexit.register(lambda: open(os.path.join(os.path.dirname(__file__), f"torn_down.{os.getpid()}"), "w").close())


def report(queue):
    queue.put((os.getppid(), IMPORTED_BY))
"""

PRELOADED = """
import os, sys
sys.path.insert(0, sys.argv[1])
from starter.fork_server import fork_server
import where_it_was_imported

if __name__ == "__main__":
    context = fork_server(("where_it_was_imported",))
    queue = context.SimpleQueue()
    child = context.Process(target=where_it_was_imported.report, args=(queue,))
    child.start()
    child.join()
    print(*queue.get(), os.getpid())
"""


def test_a_fork_server_imports_its_preload_from_this_processs_sys_path_and_ends_without_a_teardown(tmp_path):
    # Python 3.10-3.11 hand the server this process's sys.path and do not apply it (CPython gh-117378): a module found
    # only there failed its preload in silence, and every process started from the server imported it itself.
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "where_it_was_imported.py").write_text(IMPORTED_BY)
    script = tmp_path / "preloaded.py"
    script.write_text(PRELOADED)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "modules")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)  # fmt: skip
    parent, importer, asking = map(int, out.stdout.split())
    assert importer == parent != asking, out.stderr
    # Its job ended, the server ended at once (its pipes closed, so run() returned): no teardown, no exit hooks.
    assert not (tmp_path / "modules" / f"torn_down.{parent}").exists()
    assert (tmp_path / "modules" / f"torn_down.{asking}").exists()  # as the job's own process did


def test_mixup_and_cutmix_are_drawn_alike_by_every_process_of_a_pipeline():
    # A pipeline's first stage mixes the images, its last stage the labels: both must draw the same mixing,
    # whatever each process's global generator has drawn before.
    images, labels = torch.randint(0, 256, (8, 1, 8, 8), dtype=torch.uint8), torch.arange(8) % 10
    mixed = []
    for global_rank in (0, 1):
        dm = as_rank(Digits(mixup_alpha=0.8, cutmix_alpha=1.0, **DIGITS), 1, 0)
        progress = SimpleNamespace(total=SimpleNamespace(ready=3))
        dm.trainer.training = True
        dm.trainer.fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress))
        dm.trainer.precision_plugin = SimpleNamespace(convert_input=lambda x: x)
        torch.manual_seed(global_rank)
        mixed.append(dm.on_after_batch_transfer((images, labels), 0))
    assert torch.equal(mixed[0][0], mixed[1][0]) and torch.equal(mixed[0][1], mixed[1][1])
    assert not torch.equal(mixed[0][1], torch.nn.functional.one_hot(labels, 10).float())  # mixed indeed


def test_evaluation_shards_cover_an_odd_split_exactly_once():
    dm = Digits(batch_size=64, **DIGITS)
    dm.setup()
    assert len(dm.test_set) % 2 == 1
    seen = [y for r in range(2) for _, y in as_rank(dm, 2, r).test_dataloader()]
    assert sum(len(y) for y in seen) == len(dm.test_set)
    assert torch.equal(torch.cat(seen).sort().values, dm.test_set.labels.sort().values)


def test_global_batch_that_does_not_divide_is_refused():
    dm = as_rank(Digits(batch_size=63, **DIGITS), 2, 0)
    dm.setup()
    with pytest.raises(UserError, match="data.batch_size=63 is the global batch and does not divide by the 2"):
        dm.train_dataloader()


def test_shape_mismatch_with_config_is_a_clear_error():
    with pytest.raises(UserError, match=r"digits has images of shape \[1, 8, 8\].*data.image_shape=\[1, 28, 28\]"):
        Digits(image_shape=[1, 28, 28], num_classes=10).setup()


def test_loaders_pin_host_memory_exactly_when_batches_go_to_a_gpu():
    # a copy from pageable memory waits for the GPU's queued work: pinned memory lets the step run ahead
    def loader_of_process_on(device: str):
        dm = RandomImages(batch_size=8, image_shape=[3, 8, 8], num_classes=4, train_size=16, eval_size=8)
        dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))
        dm.setup()
        return dm.train_dataloader()

    assert loader_of_process_on("cuda").pin_memory and not loader_of_process_on("cpu").pin_memory


def test_the_sharded_datamodule_of_docs_extending_runs_as_written_and_shards_the_global_batch():
    from conftest import ROOT

    text = (ROOT / "docs" / "extending.md").read_text()
    snippet = text.split("<!-- the sharded data snippet -->\n```python\n")[1].split("```")[0]
    written = {}
    exec(snippet, written)
    ranks = [as_rank(written["MyData"](batch_size=10, image_shape=[1, 8, 8], num_classes=3), 2, r) for r in (0, 1)]
    for data in ranks:
        data.setup()
    batches = [next(iter(data.train_dataloader())) for data in ranks]
    assert [len(images) for images, _ in batches] == [5, 5]  # the global batch of 10, shared by 2 ranks
    assert torch.equal(ranks[0].train_set.tensors[0], ranks[1].train_set.tensors[0])  # one data set, two shares of it
    assert len(ranks[0].val_dataloader().dataset) == 15 and ranks[0].shards_itself
