"""What a pipeline run is asked for, checked before launch: its schedule, stages per process and micro-batches, and
the cut of the net a sharded checkpoint was saved with. Imports nothing heavy; strategies/pipeline.py runs it."""

from omegaconf import DictConfig

from starter.errors import UserError
from starter.topology import Layout, Plan, Traits

PIPELINE_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def stages_per_process(schedule: str, given: int | None) -> int:
    """The pipeline stages each process runs: as given, else 2 for the interleaved schedule and 1 for the others."""
    return int(given or (2 if schedule == "interleaved_1f1b" else 1))


def pipelined(strategy_cfg: DictConfig, layout: Layout) -> bool:
    """Whether the run cuts the net into a pipeline: the strategy always does (pp), or its layout has stages."""
    return Traits.of(strategy_cfg).pipeline or layout.pipeline_parallel > 1


def check_pipeline(cfg: DictConfig, plan: Plan) -> None:
    """A pipeline runs each process's batch as micro-batches through its stages, by a schedule that fits them
    (`plan.process_batch` None: the DataModule's batch is its own, checked by the pipeline as it splits it)."""
    strategy, stages = cfg.strategy, plan.layout.pipeline_parallel
    if cfg.get("compile"):
        raise UserError(
            "compile=true with a pipeline: the pipeline schedule runs the stages; use strategy=ddp or"
            " fsdp without strategy.pipeline_parallel_size"
        )
    schedule, micro = str(strategy.schedule), int(strategy.microbatches)
    if schedule not in PIPELINE_SCHEDULES:
        raise UserError(f"strategy.schedule={schedule}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    per_process = stages_per_process(schedule, strategy.get("stages_per_rank"))
    if (schedule == "interleaved_1f1b") != (per_process > 1):
        fix = "strategy.stages_per_rank=2 (or more)" if per_process == 1 else "strategy.schedule=interleaved_1f1b"
        raise UserError(
            f"strategy.schedule={schedule} with strategy.stages_per_rank={per_process}: gpipe and 1f1b run"
            f" one stage per process, interleaved_1f1b several; use {fix}"
        )
    batch = plan.process_batch or 0
    if batch % micro:
        raise UserError(
            f"data.batch_size={cfg.data.batch_size} gives each pipeline {batch} samples a step,"
            f" which strategy.microbatches={micro} does not divide; give each pipeline a"
            f" multiple of {micro}"
        )
    if schedule == "1f1b" and micro < stages:
        raise UserError(
            f"strategy.microbatches={micro} is fewer than the {stages} stages of the pipeline, which 1f1b"
            f" needs at least; use strategy.microbatches={stages} or more"
        )
    if schedule == "interleaved_1f1b" and micro % max(1, micro // stages):
        raise UserError(
            f"strategy.microbatches={micro}: interleaved_1f1b on {stages} processes needs a multiple of {stages}"
        )


def check_cut(path, saved: DictConfig, cfg: DictConfig, layout: Layout) -> None:
    """A pipeline's sharded checkpoint holds each stage's optimizer state: training continues with the same cut."""
    was, asked = _cut(saved.strategy, Layout.of(saved)), _cut(cfg.strategy, layout)
    if was != asked:
        raise UserError(
            f"ckpt_path={path} was saved by {_describe(was)}; this run asks for {_describe(asked)}:"
            " resume it with the strategy.pipeline_parallel_size and strategy.stages_per_rank it was"
            " saved with (evaluating it works: train=false)"
        )


def _cut(strategy_cfg: DictConfig, layout: Layout) -> tuple[int, int] | None:
    """(stages of a pipeline, stages per process) where the strategy runs the net as a pipeline; else None."""
    if not pipelined(strategy_cfg, layout):
        return None
    return layout.pipeline_parallel, stages_per_process(str(strategy_cfg.schedule), strategy_cfg.get("stages_per_rank"))


def _describe(cut: tuple[int, int] | None) -> str:
    return f"a pipeline of {cut[0]} processes x {cut[1]} stages each" if cut else "a net not cut into a pipeline"
