"""fsdp (FSDP2 on 2 CPU processes): same training as ddp, half the state per rank, sharded checkpoints, full export."""

import csv
import json
import os
import pickle
import shutil
from pathlib import Path, PosixPath

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import (
    CONFIG_DIRS,
    PROBES,
    ROOT,
    Planted,
    model_weights,
    plant,
    predict,
    predictions,
    read_metrics,
    run_dirs,
    train,
)
from starter.checkpointing.sharded import point_atomically

pytestmark = pytest.mark.slow
# 20 steps of SGD with momentum (optimizer state to shard): ddp and fsdp differ by summation order only, which Adam's
# normalised steps would amplify past the weights' bound
SHORT = ["accelerator=cpu", "devices=2", "callbacks=state_bytes", "debug=limit", "trainer.max_epochs=4"]
SHORT += ["model.optimizer._target_=torch.optim.SGD", "model.optimizer.lr=0.05", "+model.optimizer.momentum=0.9"]


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    """ddp and fsdp, 20 optimizer steps each from the same seed, with per-rank state sizes recorded."""
    runs = {}
    for strategy in ("ddp", "fsdp"):
        tmp_path = tmp_path_factory.mktemp(strategy)
        train(tmp_path, f"strategy={strategy}", *SHORT, *STEPS_WHILE_WRITING, env=PROBES)
        (runs[strategy],) = run_dirs(tmp_path)
    return runs


STEPS_WHILE_WRITING = ["+callbacks.writing._target_=probes.StepsWhileWriting",
                       "+callbacks.writing.output=${paths.output_dir}/writes"]  # fmt: skip


def test_fsdp_writes_its_sharded_checkpoints_while_training_goes_on(short_runs):
    # strategy.async_save (the default): each epoch's best.ckpt and last.ckpt are copied to memory at the epoch's end
    # and written by a thread; the probe holds a write until training has made 2 more steps (or the next save begins),
    # which a save that held the step would never see (it would wait 10 s, then write at the step it began)
    writes = [tuple(map(int, line.split())) for line in (short_runs["fsdp"] / "writes").read_text().splitlines()]
    assert len(writes) >= 4 and sum(went_on >= began + 2 for began, went_on in writes) >= 3, writes
    last = short_runs["fsdp"] / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and (last / ".metadata").is_file()
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 20  # the final save, named at the end


def test_a_sharded_checkpoint_is_repointed_in_one_rename_and_older_versions_go(tmp_path):
    (tmp_path / "best.ckpt.1").mkdir()
    (tmp_path / "last.ckpt.1").mkdir()
    point_atomically(tmp_path / "last.ckpt", "last.ckpt.1")
    (tmp_path / "last.ckpt.2").mkdir()  # a save that a kill interrupted
    (tmp_path / "last.ckpt.3").mkdir()
    point_atomically(tmp_path / "last.ckpt", "last.ckpt.3")
    assert os.readlink(tmp_path / "last.ckpt") == "last.ckpt.3"  # relative: the run directory can move
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.ckpt.1", "last.ckpt", "last.ckpt.3"]


def test_fsdp_holds_at_most_055_of_ddp_state_per_rank(short_runs):
    for rank in (0, 1):
        ddp, fsdp = (
            json.loads((short_runs[s] / "state_bytes" / f"rank{rank}.json").read_text()) for s in ("ddp", "fsdp")
        )
        for kind in ("parameters", "gradients", "optimizer"):
            assert fsdp[kind] <= 0.55 * ddp[kind], (rank, kind, fsdp[kind], ddp[kind])
            assert fsdp[kind] > 0


def test_fsdp_weights_match_ddp_after_20_steps(short_runs):
    ddp, fsdp = (model_weights(short_runs[s]) for s in ("ddp", "fsdp"))
    assert ddp.keys() == fsdp.keys()
    assert max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp) <= 1e-5  # same maths, other summation order


def test_fsdp_checkpoints_are_sharded_and_the_export_loads_into_a_plain_model(short_runs):
    run_dir = short_runs["fsdp"]
    last = run_dir / "checkpoints" / "last.ckpt"  # a symlink to this save's directory, repointed atomically
    assert last.is_symlink() and last.resolve().parent == last.parent
    assert sorted(p.name for p in last.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    saved = sorted(p.name.split(".")[:2] == ["last", "ckpt"] for p in last.parent.iterdir())
    assert saved.count(True) == 2  # the link and the one directory it points at: older saves were deleted
    model = instantiate(OmegaConf.load(run_dir / "config.yaml").model)
    model.load_state_dict(model_weights(run_dir))  # strict, no prefix
    # docs/modes.md's snippet, as it is written there
    snippet = (ROOT / "docs" / "modes.md").read_text().split("<!-- the model.pt snippet -->\n```python\n")[1]
    exec(snippet.split("```")[0], {"run_dir": str(run_dir)})


def test_predict_reads_a_sharded_checkpoint_as_the_weights_it_holds(short_runs, digit_files, tmp_path):
    checkpoints = short_runs["fsdp"] / "checkpoints"  # last.ckpt: the final weights, as model.pt
    rows = [predictions(predict(tmp_path / name, f"ckpt_path={checkpoints / name}", f"inputs={digit_files}"))
            for name in ("last.ckpt", "model.pt")]  # fmt: skip
    assert rows[0] == rows[1] and len(rows[0]) == 271


def test_a_run_of_any_strategy_gives_its_trained_module_back_in_one_call(short_runs):
    import starter

    run_dir = short_runs["fsdp"]  # its best.ckpt: a sharded directory
    module = starter.load_module(run_dir, CONFIG_DIRS)
    best = module.state_dict()
    saved = starter.load_module(run_dir / "checkpoints" / "model.pt", CONFIG_DIRS).state_dict()
    assert type(module).__name__ == "Classifier" and best.keys() == saved.keys()
    last = starter.load_module(run_dir / "checkpoints" / "last.ckpt", CONFIG_DIRS)
    assert torch.equal(last.net[1].weight, saved["net.1.weight"])


def test_fsdp_resumes_from_its_sharded_checkpoint(short_runs, tmp_path):
    last = short_runs["fsdp"] / "checkpoints" / "last.ckpt"
    train(
        tmp_path,
        "strategy=fsdp",
        f"ckpt_path={last}",
        *SHORT[:2],
        *SHORT[5:],  # its optimizer
        "debug=limit",
        "trainer.max_epochs=5",
        "trainer.log_every_n_steps=1",
    )
    (resumed,) = run_dirs(tmp_path)
    with open(resumed / "metrics.csv", newline="") as f:
        assert {row["epoch"] for row in csv.DictReader(f) if row["train/loss"]} == {"4"}  # epochs 0-3 restored


def test_a_sharded_checkpoint_holding_pickled_code_is_refused_by_the_load_itself(short_runs, tmp_path):
    # a directory: the single-file pre-check does not read it, Lightning's load does
    planted = tmp_path / "planted.ckpt"
    shutil.copytree((short_runs["fsdp"] / "checkpoints" / "last.ckpt").resolve(), planted)
    plant(planted / "meta.pt")
    proc = train(tmp_path, "strategy=fsdp", "train=false", f"ckpt_path={planted}", *SHORT[:2], expect_ok=False)
    assert proc.returncode == 2 and "CODE FROM THE CHECKPOINT RAN" not in proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds pickled objects besides tensors" in errors[0] and "Traceback" not in proc.stderr


def planted_copy(short_runs, tmp_path, tamper) -> Path:
    """A copy of the fsdp run's last sharded checkpoint whose `.metadata` `tamper(metadata)` changed, pickled again with
    pickle itself, as whoever hands the directory on would."""
    planted = tmp_path / "planted.ckpt"
    shutil.copytree((short_runs["fsdp"] / "checkpoints" / "last.ckpt").resolve(), planted)
    metadata = pickle.loads((planted / ".metadata").read_bytes())
    tamper(metadata)
    (planted / ".metadata").write_bytes(pickle.dumps(metadata))
    return planted


def refused_everywhere(tmp_path, planted: Path, digit_files) -> list[str]:
    """The error line of each reader of a sharded checkpoint given `planted`: resuming, evaluating, predicting,
    exporting; each exits 2 and no code from the checkpoint runs."""
    runs = [
        train(tmp_path / "fit", "strategy=fsdp", f"ckpt_path={planted}", *SHORT[:2], expect_ok=False),
        train(tmp_path / "test", "strategy=fsdp", "train=false", f"ckpt_path={planted}", *SHORT[:2], expect_ok=False),
        predict(tmp_path / "predict", f"ckpt_path={planted}", f"inputs={digit_files}", expect_ok=False),
        train(tmp_path / "export", f"ckpt_path={planted}", "format=torch_export", script="export.py", expect_ok=False),
    ]
    lines = []
    for proc in runs:
        assert proc.returncode == 2 and "CODE FROM THE CHECKPOINT RAN" not in proc.stdout + proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        lines.append(line)
    return lines


def test_a_sharded_checkpoint_whose_metadata_names_code_is_refused_by_every_reader(short_runs, digit_files, tmp_path):
    planted = planted_copy(short_runs, tmp_path, lambda metadata: setattr(metadata, "planner_data", Planted()))
    for line in refused_everywhere(tmp_path, planted, digit_files):
        assert line == (
            f"error: {planted}/.metadata: refused, not a checkpoint's metadata (it names"
            " builtins.print, which is no checkpoint metadata); loading it could run code"
        )


def test_a_sharded_checkpoint_pointing_outside_its_directory_is_refused(short_runs, digit_files, tmp_path):
    def elsewhere(metadata):
        first = next(iter(metadata.storage_data))
        metadata.storage_data[first].relative_path = "../../../../etc/passwd"

    planted = planted_copy(short_runs, tmp_path, elsewhere)
    line = f"error: {planted}/.metadata: refused, it points at '../../../../etc/passwd', not a shard file of its"
    assert refused_everywhere(tmp_path, planted, digit_files) == [f"{line} directory"] * 4


def test_a_sharded_checkpoint_whose_offsets_run_past_its_shards_is_one_line(short_runs, digit_files, tmp_path):
    def past_the_end(metadata):
        for info in metadata.storage_data.values():
            info.offset += 10**9

    planted = planted_copy(short_runs, tmp_path, past_the_end)
    runs = [
        train(tmp_path / "test", "strategy=fsdp", "train=false", f"ckpt_path={planted}", *SHORT[:2], expect_ok=False),
        predict(tmp_path / "predict", f"ckpt_path={planted}", f"inputs={digit_files}", expect_ok=False),
    ]
    for proc in runs:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert f"ckpt_path={planted}: its content is malformed (EOFError" in line, line  # under fsdp: rank 0's


class PathSayingOtherwise:
    """Pickles as a PosixPath that joins as ../elsewhere/__0_0.distcp and prints as __0_0.distcp (its cached text
    set as the object is unpickled)."""

    def __reduce__(self):
        return PosixPath, ("../elsewhere/__0_0.distcp",), (None, {"_str": "__0_0.distcp"})


def test_a_sharded_checkpoint_whose_shard_path_prints_as_a_shard_file_but_is_not_one_is_refused(short_runs, tmp_path):
    from starter.checkpointing.sharded_read import read_metadata
    from starter.errors import UserError

    def elsewhere(metadata):
        metadata.storage_data[next(iter(metadata.storage_data))].relative_path = PathSayingOtherwise()

    planted = planted_copy(short_runs, tmp_path, elsewhere)
    with pytest.raises(UserError) as refused:
        read_metadata(planted)
    assert (
        str(refused.value)
        == f"{planted}/.metadata: refused, it points at a PosixPath, not a shard file of its directory"
    )


def test_metadata_naming_any_other_torch_object_is_refused_before_it_is_called(tmp_path):
    from starter.checkpointing.sharded_read import read_metadata
    from starter.errors import UserError

    # torch.ops.load_library("<file>") would load a shared library: a global of torch, yet no checkpoint metadata
    library = str(tmp_path / "library.so").encode()
    calls = b"\x80\x04\x8c\x05torch\x8c\x10ops.load_library\x93\x8c" + bytes([len(library)]) + library + b"\x85R."
    (tmp_path / ".metadata").write_bytes(calls)
    with pytest.raises(UserError) as refused:
        read_metadata(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path}/.metadata: refused, not a checkpoint's metadata (it names torch.ops.load_library, which is no"
        " checkpoint metadata); loading it could run code"
    )


def test_a_sharded_checkpoint_entry_holding_pickled_code_is_refused(short_runs, digit_files, tmp_path):
    from torch.distributed.checkpoint import save

    # torch's own writer, as an attacker would use it: a weight's entry saved as a pickled object
    planted = tmp_path / "planted.ckpt"
    weights = {f"state_dict.{name}": value for name, value in model_weights(short_runs["fsdp"]).items()}
    weights[next(iter(weights))] = Planted()
    save(weights, checkpoint_id=planted)
    shutil.copy(short_runs["fsdp"] / "checkpoints" / "last.ckpt" / "meta.pt", planted / "meta.pt")
    proc = predict(tmp_path / "predict", f"ckpt_path={planted}", f"inputs={digit_files}", expect_ok=False)
    assert proc.returncode == 2 and "CODE FROM THE CHECKPOINT RAN" not in proc.stdout + proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {planted}: refused, state_dict.{next(iter(weights))[11:]} holds a pickled object")


def test_a_block_applied_at_several_places_trains_under_fsdp_as_under_one_process(tmp_path):
    # ALBERT's shape (probes.SharedBlockMLP): one block, held by name and in the list of its uses, sharded once
    shared = ["model.net._target_=probes.SharedBlockMLP", "model.net.width=64", "model.net.depth=3",
              "model.optimizer._target_=torch.optim.SGD", "model.optimizer.lr=0.05", "debug=limit",
              "trainer.max_epochs=2", "accelerator=cpu"]  # fmt: skip
    train(tmp_path / "one", *shared, env=PROBES)
    train(tmp_path / "fsdp", *shared, "strategy=fsdp", "devices=2", env=PROBES)
    one, fsdp = (model_weights(run_dirs(tmp_path / run)[0]) for run in ("one", "fsdp"))
    assert one.keys() == fsdp.keys() and max((one[k] - fsdp[k]).abs().max().item() for k in one) < 1e-5


def test_fsdp_trains_to_the_single_process_accuracy(default_run, tmp_path):
    train(tmp_path, "strategy=fsdp", "devices=2", "accelerator=cpu")
    fsdp, single = read_metrics(run_dirs(tmp_path)[0]), read_metrics(default_run[1])
    assert abs(fsdp["test/acc"] - single["test/acc"]) <= 1 / 271 + 1e-9 and fsdp["test/acc"] >= 0.95


# full examples: begin
def test_sharding_units_stay_units_in_a_net_where_nothing_is_tied():
    # A unit is FSDP2's granule of all-gather and free: losing one costs memory and speed, never the weights, so only
    # counting them shows it. resnet18: the stem conv, 8 residual blocks and the head.
    from torch import nn
    from torchvision.models import resnet18

    from starter.strategies.fsdp import DEFAULT_UNITS, sharding_units, tied

    module = nn.Module()
    module.net = resnet18()
    units, roots = tied(module, sharding_units(module, DEFAULT_UNITS))
    assert len(units) == 10 and roots == [[module.net]]


# full examples: end
def test_a_ties_owners_shard_together_and_the_rest_stay_units():
    # a tie (a decoder sharing its encoder's weight) takes its two owners out of the units, into the group around
    # them, and leaves the rest units
    from torch import nn

    from starter.strategies.fsdp import DEFAULT_UNITS, sharding_units, tied

    module = nn.Module()
    module.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    module.net[4].weight = module.net[0].weight
    units, roots = tied(module, sharding_units(module, DEFAULT_UNITS))
    assert units == [module.net[2]] and roots == [[module.net]]
    module.head = nn.Linear(8, 8)  # a tie across the module's children: the module is the one group
    module.head.weight = module.net[0].weight
    units, roots = tied(module, sharding_units(module, DEFAULT_UNITS))
    assert units == [module.net[2]] and roots == [[module]]
