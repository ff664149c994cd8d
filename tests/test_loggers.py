"""MLflow and W&B, each one override away (logger=mlflow, logger=wandb, logger=[csv,mlflow,wandb]): rank 0 alone
opens the store (one run for a ddp run of 2 processes), and a multirun is one run per job."""

import json

import pytest
from omegaconf import OmegaConf

from conftest import compose_config, run_dirs, sweep_jobs, train
from starter.errors import UserError
from starter.preflight import prepare

pytest.importorskip("mlflow", reason="the loggers extra: pip install -e '.[loggers]'")
pytest.importorskip("wandb", reason="the loggers extra: pip install -e '.[loggers]'")
pytestmark = pytest.mark.slow
SHORT = ["logger=[csv,mlflow,wandb]", "accelerator=cpu", "debug=limit", "trainer.max_epochs=1"]


def test_a_logger_whose_package_is_missing_is_refused_up_front_naming_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = compose_config(["logger=[csv,mlflow,wandb]", "accelerator=cpu"], tmp_path)
    with pytest.raises(UserError, match=r"logger=wandb needs the wandb package: pip install -e '.\[loggers\]'"):
        prepare(cfg)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """A 2-job multirun in one process, and a ddp run on 2 processes, each with both loggers."""
    sweep, ddp = tmp_path_factory.mktemp("sweep"), tmp_path_factory.mktemp("ddp")
    train(sweep, "-m", *SHORT, "seed=1,2")
    train(ddp, *SHORT, "strategy=ddp", "devices=2")
    return {"sweep": (sweep, sweep_jobs(sweep)), "ddp": (ddp, run_dirs(ddp))}


@pytest.mark.parametrize("case", ["sweep", "ddp"])
def test_mlflow_has_a_run_per_job_with_its_metrics_in_the_sqlite_store(case, logged):
    from mlflow import MlflowClient

    root, jobs = logged[case]
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'logs' / 'mlflow.db'}")  # where the README says
    runs = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    assert len(runs) == len(jobs)  # 2 jobs: 2 runs; ddp on 2 processes: 1 run
    for run in runs:
        assert {"val/acc", "val/loss", "test/acc", "test/loss"} <= run.data.metrics.keys()
        assert run.info.status == "FINISHED"
        assert run.data.params["strategy/name"] == ("ddp" if case == "ddp" else "auto")
    finals = sorted(run.data.metrics["test/acc"] for run in runs)
    assert finals == sorted(json.loads((job / "metrics.json").read_text())["test/acc"] for job in jobs)


@pytest.mark.parametrize("case", ["sweep", "ddp"])
def test_wandb_writes_one_offline_run_per_job_in_its_directory(case, logged):
    _, jobs = logged[case]
    for job in jobs:
        (run,) = (job / "wandb").glob("offline-run-*/run-*.wandb")  # one, also for the second job of one process
        logged_values = {}
        for record in wandb_records(run):
            if record.WhichOneof("record_type") == "history":
                logged_values |= {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
        assert logged_values["test/acc"] == pytest.approx(json.loads((job / "metrics.json").read_text())["test/acc"])
        assert "val/loss" in logged_values


def wandb_records(path):
    """The records of an offline W&B run file: after a 7-byte header, LevelDB's log format (32 KiB blocks of
    records, each a 4-byte checksum, a 2-byte length, a 1-byte type: full, first, middle, last), protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending = path.read_bytes(), 7, b""
    while position + 7 <= len(data):
        if (room := 32768 - position % 32768) < 7:  # a block's tail too short for a header: zeros
            position += room
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or a record's last part
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def test_a_resumed_run_continues_its_wandb_run_and_a_failed_or_stopped_run_is_marked_so(tmp_path):
    from mlflow import MlflowClient

    short = ["logger=[csv,mlflow,wandb]", "debug=limit", "test=false"]
    train(tmp_path, *short, "trainer.max_epochs=1")
    train(tmp_path, *short, "trainer.max_epochs=2", "ckpt_path=last")  # a new directory, the same W&B run
    first, resumed = run_dirs(tmp_path)
    ids = [OmegaConf.load(run / "config.yaml").logger.wandb.id for run in (first, resumed)]
    assert ids[0] == ids[1] and all(len(list((run / "wandb").glob(f"offline-run-*-{ids[0]}"))) == 1
                                    for run in (first, resumed))  # fmt: skip
    failed = train(tmp_path / "failed", *short, "+callbacks.bug._target_=probes.RaiseAtStep", "+callbacks.bug.step=2",
                   "+callbacks.bug.rank=0", expect_ok=False)  # fmt: skip
    assert failed.returncode == 1
    (run,) = (run_dirs(tmp_path / "failed")[0] / "wandb").glob("offline-run-*/run-*.wandb")
    exits = [r.exit.exit_code for r in wandb_records(run) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]  # finished as failed, not left running
    stopped = train(tmp_path / "failed", *short, "+callbacks.stop._target_=probes.SigtermAtStep",
                    "+callbacks.stop.step=3", expect_ok=False)  # fmt: skip
    assert stopped.returncode == 143
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'failed' / 'logs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("train").experiment_id], order_by=["start_time"])
    assert [run.info.status for run in runs] == ["FAILED", "KILLED"]


def test_the_projects_lines_reach_the_console_even_with_its_package_installed_as_a_library(tmp_path, monkeypatch):
    # `pip install .` (not editable) puts the project's package in site-packages, beside the libraries whose
    # chatter the console leaves to the log file: the project's own lines are told by its package's name
    import logging

    from starter.loggers import console

    monkeypatch.setattr(console, "PROJECT", set())
    installed = "/venv/lib/python3.11/site-packages/{}/models/classifier.py"

    def shown(name: str) -> bool:
        record = logging.LogRecord(name, logging.INFO, installed.format(name.split(".")[0]), 1, "a line", None, None)
        return console.Console().filter(record)

    assert not shown("bed.task") and not shown("lightning.pytorch.trainer")
    console.show_project(compose_config([], tmp_path))  # model and data from the test bed's package
    assert console.PROJECT == {"bed"} and shown("bed.task")
    assert not shown("lightning.pytorch.trainer")
