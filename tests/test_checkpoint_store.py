"""checkpoint_store=s3://...: a run's checkpoints in an object store (moto's S3 server, started here), continued on
another machine (a run directory that shares nothing with the first but the bucket) to the uninterrupted run's
weights; never half a checkpoint, never someone else's; bad input in one line before training."""

import json
import os
import re
import signal
import socket
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
    free_port,
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


def version_step(key: str) -> int:
    """The global step of an uploaded version (`.../<name>.versions/<step>-<token>`)."""
    return int(key.rsplit("/", 1)[1].split("-")[0])


def global_step(checkpoint: Path) -> int:
    """The step a checkpoint was saved at: a file, or a sharded one's meta.pt."""
    return torch.load(checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint, weights_only=True)["global_step"]


def slow(folder: Path) -> list[str]:
    """Each step 0.2 s longer until `folder`/go exists: the first run cannot end before the test stops it."""
    probe = "+callbacks.slow"
    return [f"{probe}._target_=probes.SlowSteps", f"{probe}.seconds=0.2", f"{probe}.output={folder / 'steps.txt'}",
            f"{probe}.until={folder / 'go'}"]  # fmt: skip


def train_command(disk: Path, prefix: str, *more: str, scheme: str = "s3") -> list[str]:
    """`python train.py` of LONG, its checkpoints in the store's `prefix`, its logs on `disk`."""
    overrides = on_bed([*LONG, f"checkpoint_store={scheme}://runs/{prefix}", f"paths.log_dir={disk / 'logs'}", *QUIET,
                        "accelerator=cpu", *more])  # fmt: skip
    return [sys.executable, str(ROOT / "train.py"), *overrides]


def start(machine: Path, env: dict, prefix: str, *more: str, scheme: str = "s3") -> subprocess.Popen:
    """`python train.py` on a machine of its own (`machine`: its working directory, its logs)."""
    machine.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(train_command(machine, prefix, *more, scheme=scheme), cwd=machine, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=with_env(PROBES, **env))  # fmt: skip


def start_nodes(machine: Path, env: dict, prefix: str, *more: str) -> list[subprocess.Popen]:
    """`python train.py` as two nodes of one process each (loopback), each with a disk of its own: `machine`/node<n>,
    bound over the one path `machine`/disk in a mount namespace of its own, as a cluster's nodes without a shared file
    system see the same path on their own disks."""
    port, disk = free_port(), machine / "disk"
    disk.mkdir(parents=True)
    nodes = []
    for node in (0, 1):
        (machine / f"node{node}").mkdir()
        bound = ["unshare", "-m", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh",
                 str(machine / f"node{node}"), str(disk)]  # fmt: skip
        variables = with_env(PROBES, **env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node))
        command = [*bound, *train_command(disk, prefix, *more)]
        nodes.append(subprocess.Popen(command, cwd=disk.parent, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=variables))  # fmt: skip
    return nodes


@pytest.fixture(scope="module")
def one_process_weights(tmp_path_factory) -> dict:
    """The weights of LONG's one-process run, never stopped: where each continuation of it must end."""
    folder = tmp_path_factory.mktemp("reference")
    train(folder, *LONG)
    return model_weights(run_dirs(folder)[0])


@pytest.mark.slow
@pytest.mark.parametrize(
    "processes",
    [["strategy=auto"], ["strategy=ddp", "devices=2"], ["strategy=fsdp", "devices=1", "num_nodes=2"]],
    ids=["one", "ddp", "fsdp sharded, two nodes with a disk each"],
)
def test_a_run_stopped_on_one_machine_continues_on_another_from_the_store_to_the_uninterrupted_weights(
    s3, processes, digit_files, tmp_path, monkeypatch, request
):
    prefix, same = f"continued-{processes[0].split('=')[1]}", [*processes, *slow(tmp_path)]
    client(s3).put_object(Bucket="runs", Key="elsewhere/keep", Body=b"not this run's")  # outside the prefix
    nodes = "num_nodes=2" in processes  # no disk shared by the nodes either: each sends its ranks' shards
    first = start_nodes(tmp_path / "first", s3.env, prefix, *same) if nodes else [start(tmp_path / "first", s3.env,
                                                                                         prefix, *same)]  # fmt: skip
    with reaped(*first):
        deadline = time.monotonic() + 120
        while pointer(s3, f"{prefix}/checkpoints/last.ckpt.json") is None:  # an epoch's checkpoint is in the store
            ended = [p.communicate()[1][-3000:] for p in first if p.poll() is not None]
            assert time.monotonic() < deadline and not ended, ended
            time.sleep(0.2)
        for proc in first:  # a scheduler's preemption reaches every node
            proc.send_signal(signal.SIGTERM)
        errs = [proc.communicate(timeout=120)[1] for proc in first]
    assert [p.returncode for p in first] == [143] * len(first), [err[-3000:] for err in errs]
    for err in errs:
        assert "upload failed" not in err and "uploading" not in err, err[-3000:]  # each checkpoint sent once, whole
    home = tmp_path / "first" / ("node0" if nodes else "")
    stopped_at = global_step(next(home.glob("logs/train/runs/*/checkpoints/last.ckpt")))
    uploaded = pointer(s3, f"{prefix}/checkpoints/last.ckpt.json")
    assert uploaded["object"].startswith(f"checkpoints/last.ckpt.versions/{stopped_at:09d}-")  # the stop's, uploaded
    if nodes:  # node 1's disk: its rank's shards of the newest version of each name only; its line says where
        shards = sorted(p.relative_to(p.parents[1]) for p in (tmp_path / "first" / "node1").rglob("*.distcp"))
        assert [(str(p.parent).split(".ckpt.")[0], p.name) for p in shards] == [
            ("best", "__1_0.distcp"), ("last", "__1_0.distcp")], shards  # fmt: skip
        assert f"at step {stopped_at}; rank 0 saved checkpoints/last.ckpt on its node\n" in errs[1], errs[1][-3000:]
    (tmp_path / "go").touch()  # steps at full speed from here on
    if processes == ["strategy=auto"]:  # the default
        expected = request.getfixturevalue("one_process_weights")
    else:  # never stopped, on one machine; here: tests/ (the probes) is on this process's path
        train(tmp_path / "reference", *LONG, *(["strategy=fsdp", "devices=2"] if nodes else processes))
        expected = model_weights(run_dirs(tmp_path / "reference")[0])
    if nodes:  # the second machines: each node fetches the whole checkpoint onto its own disk
        second = start_nodes(tmp_path / "second", s3.env, prefix, *same)
        with reaped(*second):
            outputs = [proc.communicate(timeout=300) for proc in second]
        assert [p.returncode for p in second] == [0, 0], [err[-3000:] for _, err in outputs]
        said = [out + err for out, err in outputs]
        (run_dir,) = run_dirs(tmp_path / "second" / "node0")
    else:  # the second machine's run, made in this process (no imports to wait for)
        for name, value in s3.env.items():
            monkeypatch.setenv(name, value)
        second = train(tmp_path / "second", *LONG, f"checkpoint_store=s3://runs/{prefix}", *same)  # only the bucket
        said = [second.stdout + second.stderr]
        (run_dir,) = run_dirs(tmp_path / "second")
    assert all(f"s3://runs/{prefix}/checkpoints/last.ckpt fetched" in text for text in said)
    continued = model_weights(run_dir)
    assert all(torch.equal(expected[k], continued[k]) for k in expected), "not the uninterrupted run's weights"
    assert global_step(run_dir / "checkpoints" / "last.ckpt") == 60
    # retention: one version of each name of the second run's; the first's last (resumed from) kept; nothing else
    held = keys(s3, f"{prefix}/")
    assert {k.split("/", 1)[1] for k in held} >= {"checkpoints/last.ckpt.json", "checkpoints/best.ckpt.json",
                                                  "checkpoints/model.pt.json", "run/config.json", "run/config.yaml",
                                                  "run/metrics.csv", "run/metrics.json"}  # fmt: skip
    versions = {"/".join(k.split("/")[1:4]) for k in held if ".versions/" in k}  # a sharded one: a folder of files
    assert len([v for v in versions if v.startswith("checkpoints/last.")]) == 2
    assert uploaded["object"] in versions  # the one the second run resumed from
    assert len([v for v in versions if "/model.pt." in v]) == 1 and len([v for v in versions if "/best." in v]) <= 2
    assert ("files" in uploaded) == ("strategy=fsdp" in processes)  # a sharded checkpoint: its files listed
    if "files" in uploaded:  # every rank's shards, the metadata, meta.pt; nothing else of that version's is left
        assert set(uploaded["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"}
        assert {k.rsplit("/", 1)[1] for k in held if uploaded["object"] in k} == {*uploaded["files"], "part-0.json",
                                                                                    "part-1.json"}  # fmt: skip
    assert keys(s3, "elsewhere/") == ["elsewhere/keep"]
    if "devices=2" not in processes or "files" in uploaded:  # predict.py reads the prefix as a run directory: its
        # best.ckpt, a sharded one too
        rows = predictions(predict(tmp_path / "predict", f"ckpt_path=s3://runs/{prefix}", f"inputs={digit_files}",
                                   env=s3.env))  # fmt: skip
        assert len(rows) == len(list(digit_files.iterdir())) and correct(rows) > len(rows) // 2  # chance: a tenth
    if processes == ["strategy=auto"]:  # export.py and train=false read the prefix as predict.py does: its best.ckpt
        store = f"ckpt_path=s3://runs/{prefix}"
        exported = train(tmp_path / "export", store, "format=torch_export", script="export.py")
        assert re.search(r"^exported \S*model\.pt2: uint8 images", exported.stdout, re.M), exported.stdout
        scores = [train(tmp_path / f"test-{i}", *MLP_20_STEPS, "train=false", checkpoint).stdout for i, checkpoint in
                  enumerate([store, f"ckpt_path={run_dir / 'checkpoints' / 'best.ckpt'}"])]  # fmt: skip
        assert re.findall(r"test/acc\s+(\S+)", scores[0]) == re.findall(r"test/acc\s+(\S+)", scores[1]) != []


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3", "az"])
def test_a_run_killed_mid_upload_leaves_the_checkpoint_before_named_and_continues_from_it_elsewhere(
    scheme, one_process_weights, request, tmp_path, monkeypatch
):
    # SIGKILL while the second checkpoint is on its way: the store still names the first, whole; another machine
    # continues from it to the uninterrupted run's weights (S3; Azure Blob, whose blocks sent are no blob until the
    # last call commits them)
    env = request.getfixturevalue("s3").env if scheme == "s3" else request.getfixturevalue("azurite")
    prefix, hang = "killed", ["+callbacks.hang._target_=probes.HangingUploads", "+callbacks.hang.seconds=60",
                              f"+callbacks.hang.output={tmp_path / 'uploading'}"]  # fmt: skip
    first = start(tmp_path / "first", env, prefix, *hang, scheme=scheme)
    with reaped(first):
        deadline = time.monotonic() + 120
        while not (tmp_path / "uploading").exists():
            assert time.monotonic() < deadline and first.poll() is None, first.communicate()[1][-3000:]
            time.sleep(0.1)
        first.kill()
        first.wait(timeout=60)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    from starter.checkpointing.store import CheckpointStore

    named, cut_short = (
        pointer_at(CheckpointStore(f"{scheme}://runs/{prefix}"), "last.ckpt"),
        (tmp_path / "uploading").read_text(),
    )
    assert cut_short.startswith(f"{prefix}/checkpoints/last.ckpt.versions/") and named.startswith(
        "checkpoints/last.ckpt.versions/"
    )
    assert version_step(named) < version_step(cut_short)  # an earlier one, whole, still named
    second = train(tmp_path / "second", *LONG, f"checkpoint_store={scheme}://runs/{prefix}", *hang)  # the same config
    assert f"{scheme}://runs/{prefix}/checkpoints/last.ckpt fetched" in second.stdout + second.stderr
    assert global_step(next((tmp_path / "second").glob("logs/train/runs/*/checkpoints/last.ckpt"))) == 60
    continued = model_weights(run_dirs(tmp_path / "second")[0])
    expected = one_process_weights
    assert all(torch.equal(expected[k], continued[k]) for k in expected), "not the uninterrupted run's weights"


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
        torch.save({"global_step": step, "weights": torch.zeros(11 << 19)}, path)  # 22 MB: uploaded in parts
    uploads.put(first, 5)
    assert uploads.flush(timeout=60)
    put = store.objects.put

    def cut_short(key, body):
        if isinstance(body, bytes):  # a pointer
            return put(key, body)
        body.read(10)
        raise ConnectionError("the machine went away mid-upload")

    monkeypatch.setattr(store.objects, "put", cut_short)
    uploads.put(second, 10)
    assert uploads.flush(timeout=60) and "the machine went away" in uploads.failed
    monkeypatch.setattr(store.objects, "put", put)
    assert store.fetch("last.ckpt", tmp_path / "fresh" / "last.ckpt")
    assert torch.load(tmp_path / "fresh" / "last.ckpt", weights_only=True)["global_step"] == 5
    uploads.put(second, 10)  # the next save's upload goes through: nothing failed is said any more
    assert uploads.flush(timeout=60) and uploads.failed is None


@pytest.mark.parametrize(
    "env,url,said",
    [
        ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "s3://runs/x", "cannot reach it: its endpoint http://127.0.0.1:9"
         " does not answer; check AWS_ENDPOINT_URL and the network"),
        ({"AWS_ACCESS_KEY_ID": "AKIANOBODY"}, "s3://runs/x", "refuses these credentials"),
        ({}, "s3://nobucket/x", "no bucket nobucket at http://127.0.0.1:"),
        ({}, "hdfs://runs/x", "give s3://bucket/prefix (AWS, or an S3-compatible store through AWS_ENDPOINT_URL),"
         " gs://bucket/prefix (Google Cloud Storage) or az://container/prefix (Azure Blob)"),
    ],
    ids=["unreachable", "credentials", "bucket", "scheme"],
)  # fmt: skip
def test_bad_store_input_is_one_line_before_training(s3, env, url, said, tmp_path, monkeypatch):
    for name, value in {**s3.env, **env}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(UserError, match=said.replace("(", r"\(").replace(")", r"\)")):
        prepare(compose_config([f"checkpoint_store={url}", "accelerator=cpu"], tmp_path / "run"))


def test_a_prefix_of_another_configs_run_is_refused(s3, tmp_path, monkeypatch):
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    store = ["checkpoint_store=s3://runs/configs", "accelerator=cpu"]
    prepare(compose_config(store, tmp_path / "run"))  # records its config there
    with pytest.raises(UserError, match=r"s3://runs/configs holds a run of another config: seed=3 \(there: 42\)"):
        prepare(compose_config([*store, "seed=3"], tmp_path / "other"))


def sharded(folder: Path, step: int, ranks: int = 2) -> Path:
    """A sharded checkpoint's directory as the strategy writes it (strategies/model_parallel.py): each rank's shard,
    DCP's metadata, Lightning's meta.pt."""
    folder.mkdir(parents=True)
    for rank in range(ranks):
        (folder / f"__{rank}_0.distcp").write_bytes(bytes([rank, step]) * 1000)
    (folder / ".metadata").write_bytes(b"metadata")
    torch.save({"global_step": step}, folder / "meta.pt")
    return folder


def test_a_sharded_checkpoint_is_named_only_once_every_ranks_part_is_in_the_store(s3, tmp_path, monkeypatch):
    # two ranks, each uploading its own files from a disk of its own; a rank that never sends its part (killed
    # mid-upload) leaves the previous checkpoint named; a spoiled shard or a rank's list naming another's file refused
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    import starter.checkpointing.store as store_module
    from starter.checkpointing.resume import saved_config
    from starter.checkpointing.store import CheckpointStore, Uploads, fetch_for_resume

    monkeypatch.setattr(store_module, "PART_WAIT_S", 2.0)
    store = CheckpointStore("s3://runs/shards")
    ranks = [Uploads(store, rank, world=2) for rank in range(2)]
    disks = [sharded(tmp_path / f"node{rank}" / "last.ckpt.a", 5) for rank in range(2)]
    for rank, uploads in enumerate(ranks):
        uploads.put_shards(disks[rank], "last.ckpt", 5)
    assert all(uploads.flush(timeout=60) for uploads in ranks)
    first = pointer(s3, "shards/checkpoints/last.ckpt.json")
    assert set(first["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"}
    (tmp_path / "node0" / "config.yaml").write_text("model:\n  lr: 0.1\nstrategy:\n  name: tp\n")  # rank 0's record
    ranks[0].put_record(tmp_path / "node0")
    assert ranks[0].flush(timeout=60)
    resumed = tmp_path / "resumed" / "checkpoints"  # ckpt_path=auto on a fresh machine: the checkpoint, and the
    assert fetch_for_resume(store, resumed)  # config of the run that wrote it beside (a sharded one is tp's here)
    assert saved_config(resumed / "last.ckpt").strategy.name == "tp" and (resumed / "last.ckpt" / "meta.pt").is_file()
    assert store.fetch("last.ckpt", tmp_path / "fresh" / "last.ckpt")
    fetched = tmp_path / "fresh" / "last.ckpt"
    assert fetched.is_symlink() and (fetched / "__1_0.distcp").read_bytes() == bytes([1, 5]) * 1000
    ranks[0].put_shards(sharded(tmp_path / "node0" / "last.ckpt.b", 10), "last.ckpt", 10)  # rank 1 is gone
    assert ranks[0].flush(timeout=60)
    assert pointer(s3, "shards/checkpoints/last.ckpt.json") == first  # the one before, still named, still whole
    assert len(keys(s3, f"shards/{first['object']}/")) == 6  # four files, two parts: none deleted
    client(s3).put_object(Bucket="runs", Key=f"shards/{first['object']}/__1_0.distcp", Body=b"someone else's")
    with pytest.raises(UserError, match=r"last\.ckpt\.versions/000000005-[0-9a-f]+/__1_0\.distcp is not the"):
        store.fetch("last.ckpt", tmp_path / "spoiled" / "last.ckpt")
    assert not (tmp_path / "spoiled" / "last.ckpt").exists() and not list((tmp_path / "spoiled").iterdir())
    forged = {"__0_0.distcp": {"size": 1, "sha256": "0" * 64}}  # rank 1's list naming rank 0's shard
    for rank, listed in enumerate(({}, forged)):
        client(s3).put_object(Bucket="runs", Key=f"shards/forged/part-{rank}.json", Body=json.dumps(listed).encode())
    with pytest.raises(UserError, match=r"forged/part-1\.json names '__0_0\.distcp': not rank 1's"):
        ranks[0]._parts("checkpoints/last.ckpt", "forged")
    outside = {"../x": {"size": 1, "sha256": "0" * 64}}
    for files in (outside, {"__0_0.distcp": first["files"]["__0_0.distcp"]}):  # a path; no metadata, no meta.pt
        planted = json.dumps({"object": first["object"], "files": files}).encode()
        client(s3).put_object(Bucket="runs", Key="shards/checkpoints/last.ckpt.json", Body=planted)
        with pytest.raises(UserError, match="checkpoints/last.ckpt.json is no pointer this starter writes"):
            store.fetch("last.ckpt", tmp_path / "planted" / "last.ckpt")


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """Google Cloud Storage's API on 127.0.0.1 (gcp-storage-emulator, in memory), with a bucket `runs`: the variable
    that reaches it."""
    port, log = free_port(), tmp_path_factory.mktemp("gcs") / "gcs.log"
    command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
               "--in-memory", "--default-bucket", "runs"]  # fmt: skip
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_for_port(port, server, log)
    yield {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}
    server.kill()
    server.wait()


AZURITE_ACCOUNT = "devstoreaccount1"  # Azurite's own account and key, the same in every copy of it
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    """Azure Blob's API on 127.0.0.1 (Azurite, in memory: `make install` puts it in .venv/azurite where npm is), with
    a container `runs`: the variable that reaches it."""
    from azure.storage.blob import ContainerClient

    program = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    if not program.exists():
        missing = f"Azurite is not installed ({program}: `make install` installs it where npm is)"
        pytest.fail(missing) if os.environ.get("CI") else pytest.skip(f"{missing}: az:// untested here")
    port, log = free_port(), tmp_path_factory.mktemp("azurite") / "azurite.log"
    command = [str(program), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
               "--skipApiVersionCheck", "--disableTelemetry", "--silent"]  # fmt: skip
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_for_port(port, server, log)
    connection = (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                  f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};")  # fmt: skip
    ContainerClient.from_connection_string(connection, "runs").create_container()
    yield {"AZURE_STORAGE_CONNECTION_STRING": connection}
    server.kill()
    server.wait()


def wait_for_port(port: int, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)


def listed(store) -> list[str]:
    """Every object's key under the store's prefix."""
    objects = store.objects
    if hasattr(objects, "fs"):  # gcsfs
        return [key.partition("/")[2] for key in objects.fs.find(f"{store.bucket}/{store.prefix}")]
    return list(objects.container.list_blob_names(name_starts_with=store.prefix))


@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_a_gs_or_az_store_keeps_names_fetches_and_refuses_as_an_s3_one_does(scheme, request, tmp_path, monkeypatch):
    # the same store through Google Cloud Storage's and Azure Blob's APIs: a whole file and a sharded one uploaded,
    # named, fetched; the one before deleted; an upload cut short never makes an object; a spoiled one refused; a
    # missing bucket said
    for name, value in request.getfixturevalue({"gs": "gcs", "az": "azurite"}[scheme]).items():
        monkeypatch.setenv(name, value)
    from starter.checkpointing.store import CheckpointStore, Uploads

    store = CheckpointStore(f"{scheme}://runs/g")
    ranks = [Uploads(store, rank, world=2) for rank in range(2)]
    whole = tmp_path / "node0" / "last.ckpt"
    whole.parent.mkdir(parents=True)
    for step in (5, 10):
        torch.save({"global_step": step, "weights": torch.zeros(11 << 19)}, whole)  # 22 MB: sent in several blocks
        ranks[0].put(whole, step)
        assert ranks[0].flush(timeout=60) and ranks[0].failed is None
    for rank, uploads in enumerate(ranks):
        uploads.put_shards(sharded(tmp_path / f"disk{rank}" / "best.ckpt.a", 10), "best.ckpt", 10)
    assert all(uploads.flush(timeout=60) for uploads in ranks)
    keys = listed(store)
    assert len([k for k in keys if "/last.ckpt.versions/" in k]) == 1  # the one before: deleted
    assert len([k for k in keys if "/best.ckpt.versions/" in k]) == 6  # four files, two lists
    assert store.fetch("last.ckpt", tmp_path / "fresh" / "last.ckpt") and store.fetch(
        "best.ckpt", tmp_path / "fresh" / "best.ckpt"
    )
    assert torch.load(tmp_path / "fresh" / "last.ckpt", weights_only=True)["global_step"] == 10
    assert (tmp_path / "fresh" / "best.ckpt" / "__1_0.distcp").read_bytes() == bytes([1, 10]) * 1000
    put = store.objects.put

    def cut_short(key, body):
        if isinstance(body, bytes):
            return put(key, body)
        return put(key, Breaking(body))

    monkeypatch.setattr(store.objects, "put", cut_short)
    torch.save({"global_step": 15}, whole)
    ranks[0].put(whole, 15)
    assert ranks[0].flush(timeout=60) and "the machine went away" in ranks[0].failed
    assert not [k for k in listed(store) if "/000000015-" in k]  # nothing of it committed
    monkeypatch.setattr(store.objects, "put", put)
    named = pointer_at(store, "last.ckpt")
    assert named.startswith("checkpoints/last.ckpt.versions/000000010-")
    store.objects.put(store.key(named), b"someone else's")
    with pytest.raises(
        UserError, match=rf"{scheme}://runs/g/checkpoints/last\.ckpt\.versions/000000010-\w+ is not the"
    ):
        store.fetch("last.ckpt", tmp_path / "spoiled" / "last.ckpt")
    with pytest.raises(
        UserError,
        match=rf"checkpoint_store={scheme}://nobucket/x: no (bucket|container) nobucket at http://127\.0\.0\.1:",
    ):
        prepare(compose_config([f"checkpoint_store={scheme}://nobucket/x", "accelerator=cpu"], tmp_path / "run"))


@pytest.mark.parametrize("credentials", ["wrong key", "none", "an endpoint that does not answer"])
def test_bad_az_input_is_one_line_before_training(credentials, azurite, tmp_path, monkeypatch):
    # Azurite checks Shared Key signatures as Azure does; the SDK's retries (a minute) are not waited for
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    connection = azurite["AZURE_STORAGE_CONNECTION_STRING"]
    if credentials == "none":
        monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
        said = "checkpoint_store=az://runs/x: no Azure storage account: set AZURE_STORAGE_CONNECTION_STRING, or"
    elif credentials == "an endpoint that does not answer":
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:9", connection))
        said = (
            r"checkpoint_store=az://runs/x: cannot reach it: its endpoint http://127\.0\.0\.1:9/devstoreaccount1 does"
        )
        said += " not answer; check AZURE_STORAGE_CONNECTION_STRING and the network"
    else:
        wrong = connection.replace(AZURITE_KEY, "A" * 86 + "==")
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
        said = r"checkpoint_store=az://runs/x: cannot reach it: http://127\.0\.0\.1:\d+/devstoreaccount1 refuses"
        said += r" these credentials \(AuthorizationFailure\); check AZURE_STORAGE_CONNECTION_STRING"
    with pytest.raises(UserError, match=said):
        prepare(compose_config(["checkpoint_store=az://runs/x", "accelerator=cpu"], tmp_path / "run"))


class Breaking:
    """A file that gives 10 bytes, then fails as a machine going away mid-upload."""

    def __init__(self, file):
        self.file, self.given = file, 0

    def read(self, size=-1) -> bytes:
        if self.given:
            raise ConnectionError("the machine went away mid-upload")
        self.given = 10
        return self.file.read(10)


def pointer_at(store, name: str) -> str:
    return json.loads(store.read(store.key(f"checkpoints/{name}.json"), limit=4096))["object"]
