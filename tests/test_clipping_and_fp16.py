"""Gradient clipping by the whole model's norm, and fp16 loss scaling, in every mode.

Clipping: after 20 optimizer steps, each mode's weights equal the single-process clipped run's (fp32), with a clip
value below the gradient norm of every step, so every step is clipped. fp16 (`16-mixed`, for real on CPU): an
overflow that one rank alone meets makes every rank skip that step and halve the scale; the scale is in the
checkpoint and a resume continues with it.
"""

import json

import pytest
import torch

from conftest import (
    CLIPPED_ON_TWO,
    OVERFLOW_ON_TWO,
    PROBES,
    SMALL_VIT_20_STEPS,
    max_difference,
    model_weights,
    run_dirs,
    sweep_jobs,
    train,
)

pytestmark = pytest.mark.slow
VIT = [*SMALL_VIT_20_STEPS, "test=false"]
CLIP = 0.05
SAME = 1e-5


def probe(name: str, target: str, **kwargs) -> list[str]:
    return [f"+callbacks.{name}._target_=probes.{target}", *(f"+callbacks.{name}.{k}={v}" for k, v in kwargs.items())]


@pytest.fixture(scope="module")
def clipped(tmp_path_factory):
    """One process, clipped, with the norm of each step's gradient before clipping recorded."""
    tmp_path = tmp_path_factory.mktemp("clipped")
    norms = tmp_path / "norms.json"
    train(tmp_path, *VIT, f"trainer.gradient_clip_val={CLIP}", *probe("norms", "RecordGradientNorms", output=norms))
    return model_weights(run_dirs(tmp_path)[0]), json.loads(norms.read_text())


@pytest.fixture(scope="module")
def clipped_on_two(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("clipped2")
    strategies = ",".join(CLIPPED_ON_TWO)
    train(tmp_path, "-m", f"strategy={strategies}", "devices=2", *VIT, f"trainer.gradient_clip_val={CLIP}")
    return dict(zip(CLIPPED_ON_TWO, sweep_jobs(tmp_path)))


def test_the_clip_value_clips_every_step(clipped):
    _, norms = clipped
    assert len(norms) == 20 and min(norms) > 2 * CLIP


@pytest.mark.parametrize("strategy", CLIPPED_ON_TWO)
def test_two_processes_clip_by_the_norm_of_the_whole_model(strategy, clipped, clipped_on_two):
    job = clipped_on_two[strategy]  # a multirun of forkserver jobs and of ddp_spawn: each job its strategy
    assert f"name: {strategy}\n" in (job / "config.yaml").read_text() and (job / "metrics.json").is_file()
    assert max_difference(clipped[0], model_weights(job)) <= SAME


@pytest.mark.parametrize(
    "mode,overrides",
    [
        ("2D", ["strategy=fsdp", "strategy.tensor_parallel_size=2"]),
        ("pp x dp", ["strategy=pp", "strategy.pipeline_parallel_size=2"]),
        ("3D", ["strategy=fsdp", "strategy.tensor_parallel_size=2", "strategy.pipeline_parallel_size=2"]),
    ],
)
def test_four_processes_clip_by_the_norm_of_the_whole_model(mode, overrides, clipped, tmp_path):
    # 3D on 4 processes: a pipeline of 2 stages, each a tensor-parallel pair, fsdp over a mesh dimension of 1
    train(tmp_path, *overrides, "devices=4", *VIT, f"trainer.gradient_clip_val={CLIP}")
    assert max_difference(clipped[0], model_weights(run_dirs(tmp_path)[0])) <= SAME


# fp16: an inf in one gradient element of rank 1, after the backward of step 3.
FP16 = [*VIT, "precision=16-mixed", *probe("scale", "RecordLossScale", output="${paths.output_dir}/scale")]
OVERFLOW = probe("overflow", "InfGradientAtStep", step=3, rank=1)


@pytest.fixture(scope="module")
def single_fp16(tmp_path_factory):
    """One process at 16-mixed: straight, and with the overflow (its only rank is rank 0: the probe says 1, so the
    single run is given rank 0's overflow instead)."""
    runs = {}
    for name, extra in (("straight", []), ("overflow", probe("overflow", "InfGradientAtStep", step=3, rank=0))):
        tmp_path = tmp_path_factory.mktemp(name)
        train(tmp_path, *FP16, *extra)
        runs[name] = run_dirs(tmp_path)[0]
    return runs


@pytest.fixture(scope="module")
def tolerance(single_fp16, tmp_path_factory):
    """How far two fp16 runs that round in different places may end apart: twice the distance fp16 rounding alone
    moves the single-process run from its fp32 twin (each run is about that far from the fp32 weights; by the
    triangle inequality, two of them at most twice that from each other)."""
    tmp_path = tmp_path_factory.mktemp("fp32")
    train(tmp_path, *VIT)
    return 2 * max_difference(model_weights(run_dirs(tmp_path)[0]), model_weights(single_fp16["straight"]))


def test_fp16_runs_for_real_on_cpu_and_skipping_a_step_is_far_beyond_the_fp16_tolerance(single_fp16, tolerance):
    assert "precision: 16-mixed" in (single_fp16["straight"] / "config.yaml").read_text()  # no bf16 substitution
    assert 0 < tolerance < 1e-3
    skipped = max_difference(model_weights(single_fp16["straight"]), model_weights(single_fp16["overflow"]))
    assert skipped > 20 * tolerance  # the tests below can tell a skipped step from rounding
    scale = json.loads((single_fp16["overflow"] / "scale" / "rank0.json").read_text())
    assert scale == {"start": 65536.0, "end": 32768.0}


@pytest.fixture(scope="module")
def overflow_on_rank_1(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("overflow2")
    train(tmp_path, "-m", f"strategy={','.join(OVERFLOW_ON_TWO)}", "devices=2", *FP16, *OVERFLOW, env=PROBES)
    runs = dict(zip(OVERFLOW_ON_TWO, sweep_jobs(tmp_path)))
    tmp_path = tmp_path_factory.mktemp("overflow2d")
    train(tmp_path, "strategy=fsdp", "strategy.tensor_parallel_size=2", "devices=4", *FP16, *OVERFLOW, env=PROBES)
    return runs | {"2D": run_dirs(tmp_path)[0]}


@pytest.mark.parametrize("mode", [*OVERFLOW_ON_TWO, "2D"])
def test_an_overflow_on_one_rank_skips_the_step_and_backs_off_the_scale_on_every_rank(
    mode, overflow_on_rank_1, single_fp16, tolerance
):
    run_dir = overflow_on_rank_1[mode]
    assert max_difference(model_weights(single_fp16["overflow"]), model_weights(run_dir)) <= tolerance
    for scale_file in sorted((run_dir / "scale").glob("rank*.json")):
        assert json.loads(scale_file.read_text()) == {"start": 65536.0, "end": 32768.0}, scale_file.name
    assert len(list((run_dir / "scale").glob("rank*.json"))) == (4 if mode == "2D" else 2)


def test_the_loss_scale_is_in_the_checkpoint_and_a_resume_continues_with_it(overflow_on_rank_1, single_fp16, tmp_path):
    sharded = overflow_on_rank_1["fsdp"] / "checkpoints" / "last.ckpt"
    assert torch.load(sharded / "meta.pt", weights_only=True)["AutocastPrecision"]["scale"] == 32768.0
    last = single_fp16["overflow"] / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["AutocastPrecision"]["scale"] == 32768.0
    train(tmp_path, *FP16, "trainer.max_epochs=5", f"ckpt_path={last}")
    (run_dir,) = run_dirs(tmp_path)
    assert json.loads((run_dir / "scale" / "rank0.json").read_text())["start"] == 32768.0
