"""checkpoint_store=s3://...: a run's checkpoints in an object store (moto's S3 server, started here), continued on
another machine (a run directory that shares nothing with the first but the bucket) to the uninterrupted run's
weights; never half a checkpoint, never someone else's; bad input in one line before training."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.common import LocalS3
from conftest import (
    MLP_20_STEPS,
    PROBES,
    QUIET,
    ROOT,
    compose_config,
    correct,
    model_weights,
    on_bed,
    predict,
    predictions,
    reaped,
    run_dirs,
    train,
    with_env,
)
from starter.errors import UserError
from starter.preflight import prepare


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The local store, with a bucket `runs`."""
    store = LocalS3(tmp_path_factory.mktemp("s3"))
    client(store).create_bucket(Bucket="runs")
    yield store
    store.stop()


def client(store: LocalS3):
    import boto3

    env = store.env
    keys = dict(aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1", **keys)


def keys(store: LocalS3, prefix: str) -> list[str]:
    listed = client(store).list_objects_v2(Bucket="runs", Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in listed)


def pointer(store: LocalS3, key: str) -> dict | None:
    try:
        return json.loads(client(store).get_object(Bucket="runs", Key=key)["Body"].read())
    except client(store).exceptions.NoSuchKey:
        return None


# 12 epochs of 5 steps, SGD: stopped in the middle (its steps slow until it is stopped), continued elsewhere
LONG = [*(o for o in MLP_20_STEPS if not o.startswith("trainer.max_epochs=")), "trainer.max_epochs=12", "test=false",
        "ckpt_path=auto"]  # fmt: skip


def slow(folder: Path) -> list[str]:
    """Each step 0.2 s longer until `folder`/go exists: the first run cannot end before the test stops it."""
    probe = "+callbacks.slow"
    return [f"{probe}._target_=probes.SlowSteps", f"{probe}.seconds=0.2", f"{probe}.output={folder / 'steps.txt'}",
            f"{probe}.until={folder / 'go'}"]  # fmt: skip


def start(machine: Path, env: dict, prefix: str, *more: str) -> subprocess.Popen:
    """`python train.py` on a machine of its own (`machine`: its working directory, its logs)."""
    machine.mkdir(parents=True, exist_ok=True)
    overrides = on_bed([*LONG, f"checkpoint_store=s3://runs/{prefix}", f"paths.log_dir={machine / 'logs'}", *QUIET,
                        *more])  # fmt: skip
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *overrides], cwd=machine, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=with_env(PROBES, **env))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("processes", [["strategy=auto"], ["strategy=ddp", "devices=2"]], ids=["one", "ddp"])
def test_a_run_stopped_on_one_machine_continues_on_another_from_the_store_to_the_uninterrupted_weights(
    s3, processes, digit_files, tmp_path
):
    prefix, same = f"continued-{len(processes)}", [*processes, *slow(tmp_path)]
    client(s3).put_object(Bucket="runs", Key="elsewhere/keep", Body=b"not this run's")  # outside the prefix
    first = start(tmp_path / "first", s3.env, prefix, *same)
    with reaped(first):
        deadline = time.monotonic() + 120
        while pointer(s3, f"{prefix}/checkpoints/last.ckpt.json") is None:  # an epoch's checkpoint is in the store
            assert time.monotonic() < deadline and first.poll() is None, first.communicate()[1][-3000:]
            time.sleep(0.2)
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 143, err[-3000:]
    saved = torch.load(next((tmp_path / "first").glob("logs/train/runs/*/checkpoints/last.ckpt")), weights_only=True)
    stopped_at = saved["global_step"]
    uploaded = pointer(s3, f"{prefix}/checkpoints/last.ckpt.json")
    assert uploaded["object"].startswith(f"checkpoints/last.ckpt.versions/{stopped_at:09d}-")  # the stop's, uploaded
    (tmp_path / "go").touch()  # steps at full speed from here on
    train(tmp_path / "reference", *LONG, *same)  # never stopped; here: tests/ (the probes) is on this process's path
    expected = model_weights(run_dirs(tmp_path / "reference")[0])
    second = start(tmp_path / "second", s3.env, prefix, *same)  # nothing of the first machine's but the bucket
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-3000:]
    assert f"s3://runs/{prefix}/checkpoints/last.ckpt fetched" in out + err
    (run_dir,) = run_dirs(tmp_path / "second")
    continued = model_weights(run_dir)
    assert all(torch.equal(expected[k], continued[k]) for k in expected), "not the uninterrupted run's weights"
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 60
    # retention: one version of each name of the second run's; the first's last (resumed from) kept; nothing else
    held = keys(s3, f"{prefix}/")
    assert {k.split("/", 1)[1] for k in held} >= {"checkpoints/last.ckpt.json", "checkpoints/best.ckpt.json",
                                                  "checkpoints/model.pt.json", "run/config.json", "run/config.yaml",
                                                  "run/metrics.csv", "run/metrics.json"}  # fmt: skip
    versions = [k for k in held if ".versions/" in k]
    assert sorted(k.split("/")[2] for k in versions if "/last.ckpt." in k) == ["last.ckpt.versions"] * 2
    assert uploaded["object"] in {k.split("/", 1)[1] for k in versions}  # the one the second run resumed from
    assert len([k for k in versions if "/model.pt." in k]) == 1 and len([k for k in versions if "/best." in k]) <= 2
    assert keys(s3, "elsewhere/") == ["elsewhere/keep"]
    if processes == ["strategy=auto"]:  # predict.py reads the store's prefix as a run directory: its best.ckpt
        rows = predictions(predict(tmp_path / "predict", f"ckpt_path=s3://runs/{prefix}", f"inputs={digit_files}",
                                   env=s3.env))  # fmt: skip
        assert len(rows) == len(list(digit_files.iterdir())) and correct(rows) > len(rows) // 2  # chance: a tenth


def test_a_spoiled_checkpoint_in_the_store_is_refused_in_one_line_and_nothing_is_loaded(s3, tmp_path, monkeypatch):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    from starter.checkpointing.store import CheckpointStore, Uploads

    store = CheckpointStore("s3://runs/spoiled")
    uploads = Uploads(store)
    saved = tmp_path / "machine" / "last.ckpt"
    saved.parent.mkdir()
    torch.save({"global_step": 7, "state_dict": {}}, saved)
    uploads.put(saved, 7)
    assert uploads.flush(timeout=60)
    named = pointer(s3, "spoiled/checkpoints/last.ckpt.json")["object"]
    client(s3).put_object(Bucket="runs", Key=f"spoiled/{named}", Body=b"someone else's bytes")
    with pytest.raises(UserError, match=r"s3://runs/spoiled/checkpoints/last\.ckpt\.versions/000000007-[0-9a-f]+ is"
                                        r" not the checkpoint its pointer names"):  # fmt: skip
        store.fetch("last.ckpt", tmp_path / "fresh" / "last.ckpt")
    assert not (tmp_path / "fresh" / "last.ckpt").exists()
    for planted in ({"object": "../../etc/passwd", "size": 1, "sha256": "0" * 64}, {"object": 5}, "[]"):
        body = planted if isinstance(planted, str) else json.dumps(planted)
        client(s3).put_object(Bucket="runs", Key="spoiled/checkpoints/last.ckpt.json", Body=body.encode())
        with pytest.raises(UserError, match="checkpoints/last.ckpt.json is no pointer this starter writes"):
            store.fetch("last.ckpt", tmp_path / "fresh" / "last.ckpt")


def test_an_upload_cut_short_leaves_the_previous_checkpoint_named(s3, tmp_path, monkeypatch):
    # a kill or a stop mid-upload: the object is never completed, the pointer never moved
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    from starter.checkpointing.store import CheckpointStore, Uploads

    store = CheckpointStore("s3://runs/cut")
    uploads = Uploads(store)
    first, second = tmp_path / "a" / "last.ckpt", tmp_path / "b" / "last.ckpt"
    for path, step in ((first, 5), (second, 10)):
        path.parent.mkdir()
        torch.save({"global_step": step}, path)
    uploads.put(first, 5)
    assert uploads.flush(timeout=60)
    upload = store.client.upload_fileobj

    def cut_short(file, bucket, key, **kwargs):
        file.read(10)
        raise ConnectionError("the machine went away mid-upload")

    monkeypatch.setattr(store.client, "upload_fileobj", cut_short)
    uploads.put(second, 10)
    assert uploads.flush(timeout=60) and "the machine went away" in uploads.failed
    monkeypatch.setattr(store.client, "upload_fileobj", upload)
    assert store.fetch("last.ckpt", tmp_path / "fresh" / "last.ckpt")
    assert torch.load(tmp_path / "fresh" / "last.ckpt", weights_only=True)["global_step"] == 5


@pytest.mark.parametrize(
    "env,url,said",
    [
        ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "s3://runs/x", "cannot reach it: its endpoint http://127.0.0.1:9"
         " does not answer; check AWS_ENDPOINT_URL and the network"),
        ({"AWS_ACCESS_KEY_ID": "AKIANOBODY"}, "s3://runs/x", "refuses these credentials"),
        ({}, "s3://nobucket/x", "no bucket nobucket at http://127.0.0.1:"),
        ({}, "gs://runs/x", "give s3://bucket/prefix (AWS, or an S3-compatible store through AWS_ENDPOINT_URL)"),
    ],
    ids=["unreachable", "credentials", "bucket", "scheme"],
)  # fmt: skip
def test_bad_store_input_is_one_line_before_training(s3, env, url, said, tmp_path, monkeypatch):
    for name, value in {**s3.env, **env}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(UserError, match=said.replace("(", r"\(").replace(")", r"\)")):
        prepare(compose_config([f"checkpoint_store={url}", "accelerator=cpu"], tmp_path / "run"))


def test_a_prefix_of_another_configs_run_is_refused_and_sharded_checkpoints_are_not_uploaded(s3, tmp_path, monkeypatch):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    store = ["checkpoint_store=s3://runs/configs", "accelerator=cpu"]
    prepare(compose_config(store, tmp_path / "run"))  # records its config there
    with pytest.raises(UserError, match=r"s3://runs/configs holds a run of another config: seed=3 \(there: 42\)"):
        prepare(compose_config([*store, "seed=3"], tmp_path / "other"))
    with pytest.raises(
        UserError, match="checkpoint_store with strategy=fsdp: its sharded checkpoints are not uploaded"
    ):
        prepare(compose_config([*store, "strategy=fsdp", "devices=2"], tmp_path / "fsdp"))
