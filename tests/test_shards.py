"""Shard sets (make_shards.py, data=shards): written once and whole, trained as the data they were made from (the
same weights, bit for bit, in one process and under ddp), each training sample once an epoch, a resume at another
number of processes and loader workers seeing each remaining sample once, a corrupt record or a missing set named in
one line."""

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_image_folder import make_image_folder

from benchmarks.common import LocalS3
from conftest import (
    MLP_20_STEPS,
    PROBES,
    QUIET,
    ROOT,
    SMALL_VIT_20_STEPS,
    Planted,
    as_rank,
    free_port,
    max_difference,
    model_weights,
    on_bed,
    read_metrics,
    run_dirs,
    start_all,
    sweep_jobs,
    train,
    trained_weights,
    with_env,
)

pytestmark = pytest.mark.slow

SHARDS = ["data=shards", "data.num_workers=0", "data.batch_size=64"]


def make_shards(out: Path | str, *overrides: str, logs: Path | None = None, env: dict | None = None):
    logs = logs or Path(out).parent / "logs"
    command = [sys.executable, str(ROOT / "make_shards.py"), f"out={out}", "num_workers=2", *overrides,
               f"paths.log_dir={logs}"]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=logs.parent, env=with_env(env))


@pytest.fixture(scope="module")
def digit_shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "digits"
    made = make_shards(out)
    assert made.returncode == 0, made.stderr[-3000:]
    return out


def test_make_shards_writes_each_split_as_its_data_set_holds_it_and_never_twice(digit_shards):
    from litdata import StreamingDataset

    from bed.data import Digits
    from starter.data.image_files import decode_image_data

    described = json.loads((digit_shards / "shards.json").read_text())
    digits = Digits(image_shape=[1, 8, 8], num_classes=10)
    digits.setup()
    assert described["splits"] == {"train": 1257, "val": 269, "test": 271}
    assert described["mean"] == [digits.mean[0]] and described["classes"] == digits.classes
    for split in ("train", "test"):
        records, held = StreamingDataset(str(digit_shards / split)), getattr(digits, f"{split}_set")
        images = torch.stack([decode_image_data(records[i]["image"], "L") for i in range(len(records))])
        assert torch.equal(images, held.images)  # PNG: lossless, in the split's order
        assert [records[i]["label"] for i in range(len(records))] == held.labels.tolist()
    chunks = {p: p.stat().st_mtime_ns for p in digit_shards.rglob("*.bin")}
    again = make_shards(digit_shards)
    assert again.returncode == 0 and "already holds a finished shard set" in again.stdout
    assert {p: p.stat().st_mtime_ns for p in digit_shards.rglob("*.bin")} == chunks
    not_a_set = digit_shards.parent / "elsewhere"
    not_a_set.mkdir()
    refused = make_shards(not_a_set)
    assert refused.returncode == 2 and "exists and is no finished shard set" in refused.stderr.strip().splitlines()[-1]


def test_a_corrupt_image_stops_make_shards_naming_it_and_leaves_no_set_to_train_from(tmp_path):
    root = make_image_folder(tmp_path)
    bad = root / "train" / "dog" / "3.JPEG"
    bad.write_bytes(b"not a jpeg")
    out = tmp_path / "shards"
    made = make_shards(out, "data=imagenet", f"data.root={root}", "data.image_shape=[3,32,32]", "data.num_classes=3")
    assert made.returncode == 2 and f"cannot read image {bad}" in made.stderr.strip().splitlines()[-1]
    assert not out.exists() and not Path(f"{out}.partial").exists()
    refused = train(tmp_path, *SHARDS, f"data.source={out}", expect_ok=False)
    assert refused.returncode == 2
    assert f"data.source={out}: no finished shard set there" in refused.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "processes", [["strategy=auto"], *[[f"strategy={s}", "devices=2"] for s in ("ddp", "ddp_spawn", "fsdp")]]
)
def test_training_from_shards_gives_the_weights_of_the_data_they_were_made_from(digit_shards, processes, tmp_path):
    steps = [*MLP_20_STEPS, *processes]
    train(tmp_path / "digits", *steps)
    train(tmp_path / "shards", *steps, *SHARDS, f"data.source={digit_shards}")
    (from_digits,), (from_shards,) = run_dirs(tmp_path / "digits"), run_dirs(tmp_path / "shards")
    digits_weights, shards_weights = model_weights(from_digits), model_weights(from_shards)
    assert all(torch.equal(digits_weights[k], shards_weights[k]) for k in digits_weights)
    # evaluation exact: every one of the 269 + 271 samples counted once, on one process or two
    assert read_metrics(from_shards)["test/acc"] == read_metrics(from_digits)["test/acc"]


def test_tensor_and_pipeline_parallel_runs_from_shards_train_the_weights_of_their_source(digit_shards, tmp_path):
    vit = ["-m", "strategy=tp,pp", "devices=2", *SMALL_VIT_20_STEPS, "test=false"]
    train(tmp_path / "digits", *vit)
    train(tmp_path / "shards", *vit, *SHARDS, f"data.source={digit_shards}")
    jobs = sweep_jobs(tmp_path / "digits"), sweep_jobs(tmp_path / "shards")
    assert [len(j) for j in jobs] == [2, 2]
    for from_digits, from_shards in zip(*jobs):
        digits_weights, shards_weights = model_weights(from_digits), model_weights(from_shards)
        assert all(torch.equal(digits_weights[k], shards_weights[k]) for k in digits_weights)


def test_an_image_folder_trains_from_its_shards_as_from_its_files_with_loader_workers(tmp_path):
    root = make_image_folder(tmp_path)
    folder = ["data=imagenet", f"data.root={root}", "data.image_shape=[3,32,32]", "data.num_classes=3"]
    made = make_shards(tmp_path / "shards", *folder[:-1])  # the class count read from the folders, as train.py does
    assert made.returncode == 0, made.stderr[-3000:]
    assert json.loads((tmp_path / "shards" / "shards.json").read_text())["num_classes"] == 3
    run = ["model=bed_cnn", "accelerator=cpu", "trainer.max_epochs=1", "data.batch_size=6", "data.num_workers=2",
           "data.image_shape=[3,32,32]", "model.optimizer._target_=torch.optim.SGD"]  # fmt: skip
    from_files = trained_weights(tmp_path / "files", *folder, *run)
    from_shards = trained_weights(tmp_path / "from_shards", "data=shards", f"data.source={tmp_path / 'shards'}", *run)
    # the same crops and flips: each loader worker draws them from the same seed in both
    assert all(torch.equal(from_files[k], from_shards[k]) for k in from_files)


def epoch_ids(run_dir: Path, epoch: int) -> Counter:
    return Counter(i for f in (run_dir / "samples").glob("rank*.jsonl") for line in f.read_text().splitlines()
                   if (batch := json.loads(line))["epoch"] == epoch for i in batch["ids"])  # fmt: skip


def test_a_run_stopped_mid_epoch_and_resumed_on_as_many_processes_ends_bit_for_bit_where_the_straight_run_ends(
    digit_shards, tmp_path
):
    common = [*SHARDS, f"data.source={digit_shards}", "strategy=ddp", "devices=2", "data.num_workers=1",
              "trainer.max_epochs=2", "trainer.limit_train_batches=8", "trainer.limit_val_batches=2", "test=false",
              "trainer.log_every_n_steps=1"]  # fmt: skip
    straight = trained_weights(tmp_path / "straight", *common)
    again = [*common, f"hydra.run.dir={tmp_path / 'run'}", "ckpt_path=auto"]
    stopped = train(tmp_path, *again, "+callbacks.stop._target_=probes.SigtermAtStep", "+callbacks.stop.step=11",
                    env=PROBES, expect_ok=False)  # fmt: skip
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    train(tmp_path, *again)
    resumed = model_weights(tmp_path / "run")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_run_resumed_at_another_number_of_processes_and_workers_sees_each_remaining_sample_once(
    digit_shards, tmp_path
):
    record = [
        "+callbacks.samples._target_=probes.RecordSamples",
        "+callbacks.samples.output=${paths.output_dir}/samples",
    ]
    common = [*SHARDS[:1], "data.batch_size=64", f"data.source={digit_shards}", "trainer.max_epochs=3", "test=false",
              "trainer.log_every_n_steps=1", "trainer.limit_val_batches=1", *record]  # fmt: skip
    straight = train(tmp_path / "straight", *common, "data.num_workers=0", env=PROBES)
    assert straight.returncode == 0
    (straight_dir,) = run_dirs(tmp_path / "straight")
    run_dir = tmp_path / "run"
    stop = ["+callbacks.stop._target_=probes.SigtermAtStep", f"hydra.run.dir={run_dir}", "ckpt_path=auto"]
    # 19 steps an epoch: stopped in epoch 1 on 2 processes, in epoch 2 on 1 process with 2 workers, ended on 2
    legs = [(["strategy=ddp", "devices=2", "data.num_workers=0"], 25), (["data.num_workers=2"], 45),
            (["strategy=ddp", "devices=2", "data.num_workers=1"], None)]  # fmt: skip
    said = []
    for processes, step in legs:
        stopping = [*stop, f"+callbacks.stop.step={step}"] if step else [f"hydra.run.dir={run_dir}", "ckpt_path=auto"]
        leg = train(tmp_path / "legs", *common, *processes, *stopping, env=PROBES, expect_ok=step is None)
        assert leg.returncode == (143 if step else 0), leg.stderr[-3000:]
        said.append(leg.stdout + leg.stderr)
    # the random generators of another number of processes are not restored, and the run says so
    assert "the checkpoint holds the random generators of 2 processes (data_parallel 2), this run has 1" in said[1]
    assert "the checkpoint holds the random generators of 1 process (data_parallel 1), this run has 2" in said[2]
    for epoch in range(3):  # the global batches of a straight run, whoever trained them
        assert epoch_ids(run_dir, epoch) == epoch_ids(straight_dir, epoch)
    assert max(epoch_ids(run_dir, 1).values()) == max(epoch_ids(straight_dir, 1).values())  # nothing seen twice more


def test_a_set_of_another_format_is_refused_in_one_line_saying_to_make_it_again(digit_shards, tmp_path):
    older = tmp_path / "older"
    older.mkdir()
    described = json.loads((digit_shards / "shards.json").read_text())
    (older / "shards.json").write_text(json.dumps({**described, "format": 1}))  # its records held Python bytes
    proc = train(tmp_path, *SHARDS, f"data.source={older}", expect_ok=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: data.source={older}: a shard set of format 1; this starter reads format 2: make it again with"
        " make_shards.py"
    )


@pytest.mark.parametrize(
    "tamper,said",
    [
        (lambda text: text[:-2], "its description is malformed (JSONDecodeError:"),
        (lambda text: json.dumps({**json.loads(text), "splits": [1, 2]}), "its description is malformed (TypeError:"),
        (lambda text: json.dumps({**json.loads(text), "splits": {"train": 10**6, "val": 10, "test": "val"}}),
         "(ValueError: its train split of 1000000 records, where its index holds"),
        (lambda text: json.dumps({**json.loads(text), "std": [0.0]}), "(mean, std and value_range are not finite"),
    ],
)  # fmt: skip
def test_a_malformed_description_is_one_line_naming_it(digit_shards, tamper, said, tmp_path):
    theirs = tmp_path / "theirs"
    shutil.copytree(digit_shards, theirs)
    description = theirs / "shards.json"
    description.write_text(tamper(description.read_text()))
    proc = train(tmp_path, *SHARDS, f"data.source={theirs}", expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: data.source={description}: ") and said in line, line


def planted_record(index: int) -> dict:
    return {"index": index, "image": Planted(), "label": 0}  # litdata's optimize pickles what it does not know


@pytest.fixture(scope="module")
def planted_shards(digit_shards, tmp_path_factory) -> Path:
    """A set made the way someone else would make one, with litdata's own writer: records holding a pickled object,
    beside a shards.json copied from a real set."""
    out = tmp_path_factory.mktemp("planted") / "set"
    write_set(planted_record, out, digit_shards)
    return out


def write_set(record, out: Path, like: Path) -> None:
    """A set of 8 records a split written by litdata's own writer with `record(i)`, a shards.json like `like`'s."""
    from litdata import optimize

    for split in ("train", "val", "test"):
        # start_method: litdata sets the process's own (spawn, by default) for the rest of the test session
        optimize(fn=record, inputs=list(range(8)), output_dir=str(out / split), chunk_bytes="1MB", num_workers=1,
                 verbose=False, start_method="fork")  # fmt: skip
    described = json.loads((like / "shards.json").read_text())
    (out / "shards.json").write_text(json.dumps({**described, "splits": {"train": 8, "val": 8, "test": 8}}))


def test_a_set_whose_records_hold_pickled_objects_is_refused_before_a_record_is_read(planted_shards, tmp_path):
    assert json.loads((planted_shards / "train" / "index.json").read_text())["config"]["data_format"][1] == "pickle"
    proc = train(tmp_path, *SHARDS, f"data.source={planted_shards}", "debug=fdr", expect_ok=False)
    assert proc.returncode == 2 and "CODE FROM THE CHECKPOINT RAN" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {planted_shards}/train/index.json: refused, its records are {{'index': 'int', 'image': 'pickle',"
        " 'label': 'int'}; this starter reads make_shards.py's ({'index': 'int', 'image': 'no_header_tensor:11',"
        " 'label': 'int'})"
    )


def test_a_record_of_another_kind_is_never_deserialized_whatever_its_index_said(planted_shards, capfd):
    # the reader itself, past the index's check (a store's file can change between two reads)
    from starter.data.shard_records import ShardRecords
    from starter.errors import UserError

    with pytest.raises(UserError, match=f"^{planted_shards}/train: record 3 refused, a field of another kind"):
        ShardRecords(str(planted_shards / "train"), 8, "L")[3]
    assert "CODE FROM THE CHECKPOINT RAN" not in capfd.readouterr().out


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "chunk-0-0.bin/../../../../etc/passwd"])
def test_a_set_naming_a_chunk_outside_its_directory_is_refused(name, digit_shards, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(digit_shards, elsewhere)
    index_file = elsewhere / "val" / "index.json"
    index = json.loads(index_file.read_text())
    index["chunks"][0]["filename"] = name  # the second starts as a chunk's name does
    index_file.write_text(json.dumps(index))
    proc = train(tmp_path, *SHARDS, f"data.source={elsewhere}", "debug=fdr", expect_ok=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {index_file}: refused, it names a chunk {name!r}: a chunk is a file beside it (chunk-<n>-<m>.bin)"
    )


def shifted_record(index: int) -> dict:
    """Record `index` of a set out of order: it holds sample index + 1's image and label, and says so."""
    import torch

    return {"index": (index + 1) % 8, "image": torch.zeros(4, dtype=torch.uint8), "label": 0}


def test_a_set_whose_records_are_out_of_order_is_refused_naming_the_record(digit_shards, tmp_path):
    out = tmp_path / "shifted"
    write_set(shifted_record, out, digit_shards)
    proc = train(tmp_path, *SHARDS, f"data.source={out}", "data.batch_size=8", "debug=fdr", expect_ok=False)
    assert proc.returncode == 2
    assert re.search(rf"error: {out}/(train|val): record \d+ holds sample \d+; the shard set is out of order",
                     proc.stderr.strip().splitlines()[-1]), proc.stderr[-2000:]  # fmt: skip


def test_a_record_the_store_cannot_give_is_a_user_error_and_a_bug_keeps_its_type(monkeypatch):
    from starter.data.object_store import ChunkUnreadable
    from starter.data.shard_records import ShardRecords

    records = ShardRecords("s3://shards/digits/train", 10, "L")
    failures = {
        "gone": RuntimeError("reader failed"),
        "disk": FileNotFoundError("chunk-0-3.bin"),
        "bug": KeyError("image"),
    }
    failures["gone"].__cause__ = ChunkUnreadable("s3://shards/digits/train/chunk-0-3.bin: GenericError: refused")
    try:  # a reader whose connection failed, chained implicitly: its error raised inside `except OSError`
        try:
            raise ConnectionResetError("peer reset")
        except OSError:
            raise RuntimeError("reader failed")  # noqa: B904
    except RuntimeError as implicitly:
        failures["implicit"] = implicitly
    said = {}
    for name, failure in failures.items():

        def read(index, failure=failure):
            raise failure

        monkeypatch.setattr(records, "_read", read)
        with pytest.raises(Exception) as raised:
            records[3]
        said[name] = (type(raised.value).__name__, str(raised.value))
    assert said == {
        "gone": (
            "UserError",
            "cannot read record 3 of s3://shards/digits/train: s3://shards/digits/train/chunk-0-3.bin:"
            " GenericError: refused",
        ),
        "disk": ("UserError", "cannot read record 3 of s3://shards/digits/train: FileNotFoundError: chunk-0-3.bin"),
        "implicit": ("UserError", "cannot read record 3 of s3://shards/digits/train: RuntimeError: reader failed"),
        "bug": ("KeyError", "'image'"),  # not the data's fault: raised as it is, with its traceback
    }


def test_a_corrupt_record_stops_the_run_naming_its_shard_and_index(digit_shards, tmp_path):
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(digit_shards), str(broken)], check=True)
    chunk = sorted((broken / "val").glob("chunk-*.bin"))[0]
    data = chunk.read_bytes()
    start = data.index(b"\x89PNG")  # the first record's image: its header no longer a PNG's
    chunk.write_bytes(data[:start] + b"\x00GIF" + data[start + 4 :])
    proc = train(tmp_path, *SHARDS, f"data.source={broken}", "accelerator=cpu", "debug=limit", expect_ok=False)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert re.search(rf"cannot decode record 0 of {broken}/val \({chunk.name}\)", line), line


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The local store, holding digits' shards at s3://shards/digits in chunks of 2 KB (200 of them)."""
    store = LocalS3(tmp_path_factory.mktemp("s3"))
    made = make_shards("s3://shards/digits", "chunk_bytes=2KB", logs=tmp_path_factory.mktemp("logs"), env=store.env)
    assert made.returncode == 0, made.stderr[-3000:]
    yield store
    store.stop()


def fetched_chunks(s3: LocalS3, before: Counter) -> dict[str, int]:
    """How often each chunk of s3://shards/digits was read since `before` (s3.gets("digits") then)."""
    return {name: n for name, n in (s3.gets("digits") - before).items() if "chunk-" in name}


def cached_chunks(home: Path) -> list[Path]:
    return list((home / ".lightning" / "chunks").rglob("chunk-*.bin"))  # litdata's cache, unless data.cache_dir


def test_a_set_on_an_object_store_trains_as_from_its_source_each_chunk_fetched_once_a_node(s3, tmp_path):
    before = s3.gets("digits")
    ddp = [*MLP_20_STEPS, "strategy=ddp", "devices=2"]
    from_digits = trained_weights(tmp_path / "digits", *ddp)
    remote = ["data=shards", "data.source=s3://shards/digits", "data.batch_size=64", "data.num_workers=1",
              f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    train(tmp_path / "store", *ddp, *remote, env=s3.env)
    from_store = model_weights(run_dirs(tmp_path / "store")[0])
    assert all(torch.equal(from_digits[k], from_store[k]) for k in from_digits)
    chunks = {str(p.relative_to(tmp_path / "cache")) for p in (tmp_path / "cache").rglob("chunk-*.bin")}
    fetched = fetched_chunks(s3, before)
    # 2 processes, a loader worker each, 4 epochs: every chunk read by the node once, into the shared cache
    assert len(fetched) > 20 and set(fetched.values()) == {1}
    assert len(chunks) == len(fetched)


def test_two_nodes_train_from_an_object_store_each_fetching_each_chunk_once(s3, reference_weights, tmp_path):
    before, port = s3.gets("digits"), free_port()
    source = ["data.source=s3://shards/digits", f"paths.log_dir={tmp_path / 'logs'}", *QUIET]
    command = [sys.executable, str(ROOT / "train.py"), *on_bed(["strategy=ddp", "devices=1", "num_nodes=2",
               *MLP_20_STEPS])]  # fmt: skip
    rendezvous = with_env(s3.env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # the same command on each node; each node's own disk: its own home, where litdata keeps its cache
    nodes = [
        ([*command, *SHARDS, *source], {**rendezvous, "NODE_RANK": str(n), "HOME": str(tmp_path / f"node{n}")})
        for n in (0, 1)
    ]
    start_all(nodes, tmp_path)
    (run_dir,) = run_dirs(tmp_path)
    assert max_difference(reference_weights, model_weights(run_dir)) <= 1e-5  # as two nodes train from digits
    fetched, cached = fetched_chunks(s3, before), [len(cached_chunks(tmp_path / f"node{n}")) for n in (0, 1)]
    # a node reads the chunks of its ranks' samples (not all of them in 20 steps), each fetched once into its cache
    assert min(cached) > 20 and sum(fetched.values()) == sum(cached) and max(fetched.values()) <= 2


def test_a_capped_cache_stays_near_its_cap_and_trains_as_the_source(s3, tmp_path):
    # one epoch (5 steps): a read from a capped cache is a fetch 5 times in 6, latency-bound (110 s for 20 steps in CI)
    one_epoch = [*MLP_20_STEPS, "trainer.max_epochs=1"]
    source = trained_weights(tmp_path / "source", *one_epoch)
    before = s3.gets("digits")
    capped = [*one_epoch, *SHARDS, "data.source=s3://shards/digits", "data.max_cache_size=100KB"]
    from_store = trained_weights(tmp_path / "store", *capped, env={**s3.env, "HOME": str(tmp_path / "home")})
    assert all(torch.equal(source[k], from_store[k]) for k in source)
    held = sum(chunk.stat().st_size for chunk in cached_chunks(tmp_path / "home"))
    fetched = fetched_chunks(s3, before)
    # the set's chunks hold some 600 KB; the cache keeps to its cap (litdata evicts as it reads: a few chunks over)
    # and fetches again what it evicted
    assert held < 200_000 and sum(fetched.values()) > len(fetched)


def test_a_set_on_a_store_holding_pickled_records_is_refused_as_read_before_and_as_fetched(
    s3, planted_shards, tmp_path, monkeypatch
):
    import boto3

    store = boto3.client("s3", **{"endpoint_url": s3.env["AWS_ENDPOINT_URL"]}, region_name="us-east-1",
                         aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
                         aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
    for path in planted_shards.rglob("*"):
        if path.is_file():
            store.upload_file(str(path), "shards", f"planted/{path.relative_to(planted_shards)}")
    proc = train(tmp_path, *SHARDS, "data.source=s3://shards/planted", "debug=fdr", env=s3.env, expect_ok=False)
    assert proc.returncode == 2 and "CODE FROM THE CHECKPOINT RAN" not in proc.stdout + proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: s3://shards/planted/train/index.json: refused, its records are {'index': 'int', 'image': 'pickle',"
        )
    )
    # the index litdata itself fetches (a store's file can change after the check before launch) is checked too
    from starter.data.object_store import use_plain_http_endpoints
    from starter.errors import UserError

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    use_plain_http_endpoints()
    from litdata.streaming.downloader import get_downloader

    fetcher = get_downloader("s3://shards/planted/train", str(tmp_path / "cache"), [])
    with pytest.raises(UserError, match="^s3://shards/planted/train/index.json: refused, its records are"):
        fetcher.download_file("s3://shards/planted/train/index.json", str(tmp_path / "cache" / "index.json"))


def test_a_chunk_gone_from_the_cache_is_fetched_again(s3, tmp_path, monkeypatch):
    from starter.data.shard_records import ShardRecords

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)

    class GoneFromTheCache:
        def __getitem__(self, index):  # litdata's reader where a chunk it counts as cached is not there
            raise FileNotFoundError(f"{chunk}: no such file")

    records = ShardRecords("s3://shards/digits/train", 1257, "L", cache_dir=str(tmp_path / "cache"))
    first = records[0]
    (chunk,) = [p for p in (tmp_path / "cache").rglob("chunk-*.bin")]  # records 0.. are in the first chunk fetched
    chunk.unlink()  # evicted by a capped cache, or its download failed...
    records._records = GoneFromTheCache()  # ...while the reader still counts it in the cache
    before = s3.gets("digits/train")
    again = records[0]  # a reader of its own fetches it again
    assert torch.equal(again[0], first[0]) and again[1] == first[1]
    assert sum(n for name, n in (s3.gets("digits/train") - before).items() if name == chunk.name) == 1


def test_a_missing_bucket_wrong_credentials_or_an_unreachable_store_is_one_line_naming_the_source(s3, tmp_path):
    missing = train(tmp_path, *SHARDS, "data.source=s3://nobucket/digits", env=s3.env, expect_ok=False)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        "error: s3://nobucket/digits/shards.json: The specified bucket does not exist"
    )
    wrong_secret = {**s3.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    refused = train(tmp_path, *SHARDS, "data.source=s3://shards/digits", env=wrong_secret, expect_ok=False)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: s3://shards/digits/shards.json: The request signature we calculated does not match the signature you"
        " provided. Check your key and signing method."
    )
    unknown_key = {**s3.env, "AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY0000000"}
    refused = make_shards("s3://shards/elsewhere", logs=tmp_path / "logs", env=unknown_key)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "error: s3://shards/elsewhere/shards.json: The AWS Access Key Id you provided does not exist in our records."
    )
    nowhere = {**s3.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_MAX_ATTEMPTS": "2"}
    unreachable = make_shards("s3://shards/elsewhere", logs=tmp_path / "logs", env=nowhere)
    assert unreachable.returncode == 2
    assert (
        unreachable.stderr.strip()
        .splitlines()[-1]
        .startswith("error: s3://shards/elsewhere/shards.json: Could not connect to the endpoint URL")
    )


def kill_after_chunk_gets(store: LocalS3, before: Counter, count: int) -> None:
    """Kills the store once it has served `count` more chunks of the train split than `before`."""
    while store.proc.poll() is None:
        if sum(n for name, n in (store.gets("digits/train") - before).items() if name.startswith("chunk-")) >= count:
            store.proc.kill()
        time.sleep(0.02)


def test_the_store_going_away_mid_epoch_stops_the_run_naming_it_and_keeps_last_ckpt(tmp_path):
    store = LocalS3(tmp_path)
    try:
        made = make_shards("s3://shards/digits", "chunk_bytes=2KB", logs=tmp_path / "logs", env=store.env)
        assert made.returncode == 0, made.stderr[-3000:]
        run = [*SHARDS, "data.source=s3://shards/digits", f"hydra.run.dir={tmp_path / 'run'}", "ckpt_path=auto",
               "test=false"]  # fmt: skip
        train(tmp_path, *run, "trainer.max_epochs=1", f"data.cache_dir={tmp_path / 'cache'}", env=store.env)
        last = tmp_path / "run" / "checkpoints" / "last.ckpt"
        saved = last.read_bytes()
        # another node's empty cache: the chunks of epoch 2 are fetched as it goes, and the store dies after 10 of
        # them (not at a step: a random order touches most chunks in a few batches, and under load the loader
        # workers had fetched every one before step 22 in 1 of 4 tries, the run then ending well)
        before = store.gets("digits/train")
        threading.Thread(target=kill_after_chunk_gets, args=(store, before, 10), daemon=True).start()
        # each fetch tried 3 times, as AWS_MAX_ATTEMPTS says (obstore's default 11 tries take a minute and more)
        stopped = train(tmp_path, *run, "trainer.max_epochs=3", f"data.cache_dir={tmp_path / 'other'}",
                        "data.num_workers=2", env={**store.env, "AWS_MAX_ATTEMPTS": "3"}, expect_ok=False)  # fmt: skip
    finally:
        store.stop()
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    (line,) = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]  # said once
    fetch = r"s3://shards/digits/train/chunk-\S+: GenericError: .* after 2 retries"
    assert re.match(rf"error: cannot read record \d+ of s3://shards/digits/train: {fetch}", line), line
    assert len(stopped.stderr.splitlines()) < 60  # litdata's report of each loader worker's fetch: ~16 lines
    assert last.read_bytes() == saved  # the last checkpoint before the store went, as it was


def test_decoding_on_the_device_gives_evaluation_the_images_the_loader_workers_give(tmp_path):
    from starter.data.imagenet import ImageFolderDataModule

    root = make_image_folder(tmp_path)
    batches = {}
    for decode in ("cpu", "gpu"):
        dm = ImageFolderDataModule(root=str(root), batch_size=6, num_workers=0, image_shape=[3, 32, 32],
                                   num_classes=3, decode=decode)  # fmt: skip
        dm.setup()
        loaders = as_rank(dm, 1, 0).val_dataloader(), dm.train_dataloader()
        dm.trainer = None  # evaluation's recipe
        evaluation, training = (next(iter(loader)) for loader in loaders)
        cpu = torch.device("cpu")
        batches[decode] = [
            dm.on_after_batch_transfer(dm.transfer_batch_to_device(b, cpu, 0), 0) for b in (evaluation, training)
        ]
    (cpu_eval, cpu_train), (gpu_eval, gpu_train) = batches["cpu"], batches["gpu"]
    assert isinstance(gpu_eval[0], torch.Tensor) and torch.equal(cpu_eval[0], gpu_eval[0])
    assert torch.equal(cpu_eval[1], gpu_eval[1])
    assert gpu_train[0].shape == cpu_train[0].shape == (6, 3, 32, 32)


def test_a_run_decoding_on_the_device_trains_under_ddp_and_evaluates_as_the_workers_decode(tmp_path):
    root = make_image_folder(tmp_path)
    folder = ["data=imagenet", f"data.root={root}", "data.image_shape=[3,32,32]", "data.num_classes=3",
              "model=bed_cnn", "data.batch_size=6", "accelerator=cpu"]  # fmt: skip
    train(tmp_path / "fit", *folder, "data.decode=gpu", "strategy=ddp", "devices=2", "data.num_workers=1",
          "trainer.max_epochs=1")  # fmt: skip
    (run_dir,) = run_dirs(tmp_path / "fit")
    figures = {}
    for decode in ("cpu", "gpu"):
        train(tmp_path / decode, *folder, f"data.decode={decode}", "train=false",
              f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}")  # fmt: skip
        figures[decode] = read_metrics(run_dirs(tmp_path / decode)[0])
    assert figures["gpu"]["test/acc"] == figures["cpu"]["test/acc"]
    assert figures["gpu"]["test/loss"] == figures["cpu"]["test/loss"]


def test_decoding_png_records_on_the_device_is_one_line_saying_what_to_do(digit_shards, tmp_path):
    proc = train(tmp_path, *SHARDS, f"data.source={digit_shards}", "data.decode=gpu", "debug=limit", expect_ok=False)
    assert proc.returncode == 2
    assert "data.decode=gpu decodes JPEG images only" in proc.stderr.strip().splitlines()[-1]
