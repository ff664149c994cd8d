"""Modes are interchangeable: same seed, data and global batch give the same weights and the same metrics."""

import csv
from types import SimpleNamespace

import pytest
import torch

from conftest import MLP_20_STEPS, PROBES, max_difference, model_weights, read_metrics, run_dirs, train, trained_weights

pytestmark = pytest.mark.slow


def test_gradient_accumulation_of_two_half_batches_matches_the_full_batch(reference_weights, tmp_path):
    # Two micro-batches of 32 are the two halves of each 64-batch (same sampler order); Lightning divides
    # each half's loss by 2, so the summed gradient is the full batch's mean gradient.
    accumulated = trained_weights(tmp_path, *MLP_20_STEPS, "data.batch_size=32", "trainer.accumulate_grad_batches=2",
                          "trainer.limit_train_batches=10")  # fmt: skip
    assert max_difference(reference_weights, accumulated) <= 1e-5


def test_dp_on_one_device_is_identical_to_single_device(reference_weights, tmp_path):
    dp = trained_weights(tmp_path, *MLP_20_STEPS, "strategy=dp")
    assert all(torch.equal(reference_weights[k], dp[k]) for k in reference_weights)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("trained")
    train(tmp_path, "accelerator=cpu", "trainer.max_epochs=3")  # weights good enough that the test split matters
    return run_dirs(tmp_path)[0] / "checkpoints" / "best.ckpt"


@pytest.fixture(scope="module")
def single_eval(trained, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("single_eval")
    train(tmp_path, "train=false", f"ckpt_path={trained}", "accelerator=cpu")
    return read_metrics(run_dirs(tmp_path)[0])


def test_train_false_evaluates_a_runs_model_pt_as_the_weights_it_holds(trained, tmp_path):
    # model.pt, the final weights the README names, holds no training state: tested as init_from= tests it
    weights = trained.parent / "model.pt"
    by_ckpt_path = train(tmp_path / "a", "train=false", f"ckpt_path={weights}", "accelerator=cpu")
    train(tmp_path / "b", "train=false", f"init_from={weights}", "accelerator=cpu")
    assert f"ckpt_path={weights} holds weights only: tested as init_from tests them" in by_ckpt_path.stdout
    assert read_metrics(run_dirs(tmp_path / "a")[0]) == read_metrics(run_dirs(tmp_path / "b")[0])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp", "pp"])
def test_evaluation_on_an_odd_test_split_is_exact_under_every_strategy(trained, single_eval, strategy, tmp_path):
    train(tmp_path, "train=false", f"ckpt_path={trained}", f"strategy={strategy}", "devices=2", "accelerator=cpu")
    metrics = read_metrics(run_dirs(tmp_path)[0])
    # 271 test images: 136 + 135 over two ranks, none padded in twice (a padded sample would make the count
    # 272); under tp and pp both ranks see all 271, and only the last stage counts them (the last batch of 15
    # is padded to 64 for the pipeline, the padding never counted). Accuracy is a ratio of integer counts:
    # equal. The loss is a weighted sum of floats added in another order: equal to 1e-6.
    correct = metrics["test/acc"] * 271
    assert abs(correct - round(correct)) < 1e-4  # a whole number of the 271 images (float32 ratio)
    assert metrics["test/acc"] == single_eval["test/acc"]
    assert abs(metrics["test/loss"] - single_eval["test/loss"]) <= 1e-6


# 3 epochs of 8 batches = 24 steps; stopped by a stop signal after step 11 (epoch 1, batch 3), then the same command
# again in the same directory, as a requeued job runs it. Random numbers drawn in the training process: dropout, and
# a random shift of each batch (probes.AugmentedDigits), each rank its own.
RESUME = [
    "accelerator=cpu",
    "trainer.max_epochs=3",
    "trainer.limit_train_batches=8",
    "trainer.limit_val_batches=2",
    "test=false",
    "trainer.log_every_n_steps=1",
    "model.net.dropout=0.3",
    "data._target_=probes.AugmentedDigits",
]


def ranks(strategy: str) -> list[str]:
    return [f"strategy={strategy}", f"devices={1 if strategy == 'auto' else 2}"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted runs, one process and ddp on 2."""
    return {
        s: trained_weights(tmp_path_factory.mktemp(f"straight-{s}"), *RESUME, *ranks(s), env=PROBES)
        for s in ("auto", "ddp")
    }


@pytest.mark.parametrize(  # each stop signal: preemption, sbatch --signal, a time-out warning
    "strategy,workers,stop",
    [("auto", 0, "SIGTERM"), ("auto", 2, "SIGUSR1"), ("ddp", 0, "SIGUSR2"), ("ddp", 2, "SIGTERM")],
)
def test_a_run_stopped_mid_epoch_and_resumed_ends_bit_for_bit_where_the_straight_run_ends(
    strategy, workers, stop, straight, tmp_path
):
    # Loader workers fetch ahead of training; persistent ones (as image folders have them) also outlive an epoch.
    loader = [f"data.num_workers={workers}", *(["+data.persistent_workers=true"] if workers else [])]
    again = [*RESUME, *ranks(strategy), *loader, f"hydra.run.dir={tmp_path / 'run'}", "ckpt_path=auto"]
    stopped = train(tmp_path, *again, "+callbacks.stop._target_=probes.SigtermAtStep", "+callbacks.stop.step=11",
                    f"+callbacks.stop.signal={stop}", env=PROBES, expect_ok=False)  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    train(tmp_path, *again, env=PROBES)
    resumed = model_weights(tmp_path / "run")
    assert all(torch.equal(straight[strategy][k], resumed[k]) for k in resumed)  # bit for bit
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:  # every step trained once, none twice
        assert sorted(int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]) == list(range(24))


def test_each_data_parallel_rank_draws_numbers_of_its_own_and_rank_0_those_of_one_process():
    from starter.callbacks.random_state import RandomState

    draws = []
    for world, rank in ((1, 0), (2, 0), (2, 1)):
        torch.manual_seed(42)  # what every rank's model was built after
        place = {"num_replicas": world, "rank": rank} if world > 1 else None
        RandomState(42).setup(SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs=place)), None, "fit")
        draws.append(torch.rand(4))
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])


def test_resuming_with_more_epochs_replans_the_lr_schedule_unless_told_to_keep_it(tmp_path):
    # T_max follows trainer.max_epochs: a 1-epoch cosine schedule ends at lr 0, and kept as saved, a second
    # epoch would not move the weights at all.
    common = ["accelerator=cpu", "debug=limit", "test=false"]
    first = trained_weights(tmp_path / "first", *common, "trainer.max_epochs=1")
    last = run_dirs(tmp_path / "first")[0] / "checkpoints" / "last.ckpt"
    outputs = {}
    for mode in ("replan", "saved"):
        proc = train(
            tmp_path / mode, *common, "trainer.max_epochs=2", f"ckpt_path={last}", f"resume_lr_schedule={mode}"
        )
        outputs[mode] = (
            proc.stdout + proc.stderr,
            model_weights(run_dirs(tmp_path / mode)[0]),
        )
    said, replanned = outputs["replan"]
    assert "resumed lr schedule re-planned from the config (T_max: 1 -> 2), lr now 0.001;" in said
    assert "resume_lr_schedule=saved keeps the checkpoint's" in said
    assert max_difference(first, replanned) > 1e-3  # trained at lr 0.001 (half of 0.002, cosine over 2 epochs)
    said, kept = outputs["saved"]
    assert "resumed lr schedule continues as saved (the config now says T_max: 1 -> 2);" in said
    assert max_difference(first, kept) == 0.0  # lr 0, as the saved schedule says


class Mesh:
    """A device mesh of named dimensions {name: (size, this process's rank)}, as a strategy's `device_mesh` says."""

    def __init__(self, dims: dict):
        self.dims, self.mesh_dim_names = dims, tuple(dims)

    def __getitem__(self, name):
        size, rank = self.dims[name]
        return SimpleNamespace(size=lambda: size, get_local_rank=lambda: rank)


def process_of(world: int, rank: int, mesh: dict | None = None) -> SimpleNamespace:
    """A trainer as process `rank` of `world` sees it: ddp's (a data-parallel place), or a mesh's."""
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world, "rank": rank},
                               device_mesh=Mesh(mesh) if mesh else None)  # fmt: skip
    return SimpleNamespace(strategy=strategy, world_size=world, global_rank=rank, is_global_zero=rank == 0)


def saved_by(world: int, meshes=None) -> dict:
    """RandomState's checkpoint entry from `world` processes, each with generators of its own (seeded by its rank)."""
    from starter.callbacks.random_state import RandomState

    entries = {"ranks": [], "places": []}
    for rank in range(world):
        torch.manual_seed(1000 + rank)
        saver = RandomState(seed=0)
        saver.on_fit_start(process_of(world, rank, meshes[rank] if meshes else None), None)
        entry = saver.state_dict()  # one process's own (no process group): gathered, it is the list of all
        entries["ranks"] += entry["ranks"]
        entries["places"] += entry["places"]
    return entries


def resumed_as(entries: dict, trainer) -> torch.Tensor:
    from starter.callbacks.random_state import RandomState

    torch.manual_seed(7)  # the seed's numbers, where nothing is restored
    resumed = RandomState(seed=0)
    resumed.load_state_dict(entries)
    resumed.on_fit_start(trainer, None)
    resumed.on_train_start(trainer, None)
    return torch.rand(3)


def test_each_process_resumes_the_generators_of_its_own_place_on_every_node():
    # 2 nodes x 2 processes: global rank 3 is node 1's local rank 1, and gets rank 3's numbers, not rank 1's
    entries = saved_by(4)
    for rank in range(4):
        torch.manual_seed(1000 + rank)
        drawn = torch.rand(3)  # what rank's generators draw next
        assert torch.equal(resumed_as(entries, process_of(4, rank)), drawn)


def test_generators_saved_in_another_layout_of_as_many_processes_start_from_the_seed_said_once(caplog):
    entries = saved_by(2)  # ddp on 2, resumed under tp on 2: both are data-parallel rank 0 there
    tensor_parallel = {"data_parallel": (1, 0), "tensor_parallel": (2, 1)}
    with caplog.at_level("WARNING"):
        numbers = resumed_as(entries, process_of(2, 0, tensor_parallel))
    torch.manual_seed(7)
    assert torch.equal(numbers, torch.rand(3))
    assert "random generators of 2 processes (data_parallel 2), this run has 2 (data_parallel 1, tensor_parallel 2)" \
        in caplog.text  # fmt: skip
