"""What `checkpoint_store` costs a run: on CPU, one process, digits and an MLP of width 1024 (a 13 MB checkpoint with
AdamW's state), a checkpoint every 10 steps (last.ckpt; best.ckpt each epoch), against the same run writing to its
local disk only; REPEATS runs of each, interleaved, into moto's S3 server on this machine (its own disk: what the
network adds elsewhere is not measured here, and the uploads run beside training wherever they go).

`--strategy fsdp`: the same on 2 processes, each checkpoint sharded (every rank uploads its own files, rank 0 names
the checkpoint once both ranks' lists are there).

Per run: the median step without a checkpoint, the median step that saves one (the local write, and with a store the
hand-over to the upload thread), what the run's end waits for the last uploads, and, for a run stopped by SIGTERM
mid-epoch, the seconds from the signal to its exit (a stop uploads its last.ckpt before it exits).
"""

import argparse
import json
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import lightning as L

from benchmarks.common import RESULTS, ROOT, LocalS3, markdown_table, train_command

REPEATS = 5
EVERY = 50  # steps between checkpoints
RUN = ["accelerator=cpu", "model.net.width=1024", "trainer.max_epochs=4", f"trainer.limit_train_batches={EVERY}",
       f"checkpoint_every_n_steps={EVERY}", "test=false", "trainer.enable_progress_bar=false"]  # fmt: skip


class StepTimes(L.Callback):
    """Writes the seconds from each training step's start to the next's (its checkpoint's save included: Lightning
    runs ModelCheckpoint after every other callback) to `output`, in each epoch."""

    def __init__(self, output: str):
        self.output, self.times, self.started = Path(output), [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        if self.started is not None and batch_idx > 0:
            self.times.append(now - self.started)
        self.started = now

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:  # rank 0's steps: a sharded save waits for every rank
            self.output.write_text(json.dumps(self.times))


def run(scratch: Path, store: list[str], env: dict, strategy: list[str]) -> dict:
    times = scratch / "times.json"
    command = train_command(*RUN, *strategy, *store, f"paths.log_dir={scratch / 'logs'}",
                            "+callbacks.times._target_=benchmarks.checkpoint_store.StepTimes",
                            f"+callbacks.times.output={times}")  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads(times.read_text())  # batch 1 to the last but one of each epoch: none saves a checkpoint
    per_epoch = EVERY - 2
    plain = [t for i, t in enumerate(steps) if i % per_epoch]  # not the epoch's first timed step
    waited = [float(line.split("waited for ")[1].split(" s")[0]) for line in (proc.stdout + proc.stderr).splitlines()
              if "every upload done" in line]  # fmt: skip
    uploads = [t for i, t in enumerate(steps) if i % per_epoch < 10]  # the 10 steps after the epoch's checkpoints
    return {"step_s": statistics.median(plain), "after_save_s": statistics.median(uploads),
            "end_wait_s": waited[0] if waited else 0.0}  # fmt: skip


def stopped(scratch: Path, store: list[str], env: dict, strategy: list[str]) -> float:
    """Seconds from SIGTERM (mid-run, after the second checkpoint) to the run's exit."""
    command = train_command(*RUN, *strategy, *store, "trainer.max_epochs=40", f"paths.log_dir={scratch / 'logs'}")
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    while not list(scratch.glob("logs/train/runs/*/checkpoints/best.ckpt")) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    return time.monotonic() - sent


def main() -> None:
    import os

    import boto3

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["auto", "fsdp"], default="auto")
    strategy = parser.parse_args().strategy
    overrides = ["strategy=fsdp", "devices=2"] if strategy == "fsdp" else []
    what = "one process, 13 MB checkpoints" if strategy == "auto" else "fsdp, 2 processes, 13 MB sharded checkpoints"
    output = "checkpoint_store" if strategy == "auto" else "checkpoint_store_fsdp"
    scratch = Path(tempfile.mkdtemp(prefix="checkpoint-store-"))
    (scratch / "s3").mkdir()
    s3 = LocalS3(scratch / "s3")
    env = {**os.environ, **s3.env}
    keys = {"aws_access_key_id": s3.env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": s3.env["AWS_SECRET_ACCESS_KEY"]}
    boto3.client("s3", endpoint_url=s3.env["AWS_ENDPOINT_URL"], region_name="us-east-1", **keys).create_bucket(
        Bucket="runs"
    )
    modes = {"local disk": lambda i: [], "checkpoint_store": lambda i: [f"checkpoint_store=s3://runs/bench-{i}"]}
    results = {name: {"runs": [], "stop_s": []} for name in modes}
    try:
        for i in range(REPEATS):  # interleaved: the machine's drift falls on both alike
            for name, store in modes.items():
                results[name]["runs"].append(run(scratch / f"{name[0]}{i}", store(i), env, overrides))
                results[name]["stop_s"].append(stopped(scratch / f"s{name[0]}{i}", store(f"stop-{i}"), env, overrides))
    finally:
        s3.stop()
    (RESULTS / f"{output}.json").write_text(json.dumps(results, indent=1))

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name]["runs"])

    def spread(name: str, key: str) -> str:
        values = [r[key] for r in results[name]["runs"]]
        return f"{statistics.median(values) * 1000:.1f} [{min(values) * 1000:.1f}-{max(values) * 1000:.1f}]"

    rows = []
    for name, figures in results.items():
        stops = figures["stop_s"]
        rows.append([name, spread(name, "step_s"), f"{median(name, 'step_s') / median('local disk', 'step_s'):.3f}",
                     spread(name, "after_save_s"), f"{median(name, 'end_wait_s'):.2f}",
                     f"{statistics.median(stops):.2f} [{min(stops):.2f}-{max(stops):.2f}]"])  # fmt: skip
    table = markdown_table([what, "step, ms (median [min-max] of 5 runs)", "/ local disk",
                            "the 10 steps after a save, ms", "end waits for uploads, s",
                            "SIGTERM to exit, s"], rows)  # fmt: skip
    text = (
        f"{table}\n\nMade by `python -m benchmarks.checkpoint_store{' --strategy fsdp' * (strategy == 'fsdp')}` on"
        f" {os.cpu_count()} CPUs: {REPEATS} runs of each,"
        f" interleaved, each 200 steps with last.ckpt and best.ckpt saved every {EVERY} (2 x 13 MB), uploaded to moto's"
        " S3 server on this machine: its CPU time, the upload thread's hashing and boto3's are on the training's 2"
        " cores; the save itself is local in both (the table's 'step' excludes the epoch boundary, which saves).\n"
    )
    if strategy == "fsdp":
        text += (
            "Rank 0's steps (a save waits for every rank's shards); each rank uploads its own shard, rank 0 the"
            " metadata and meta.pt, then names the checkpoint once both ranks' lists are in the store.\n"
        )
    (RESULTS / f"{output}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
