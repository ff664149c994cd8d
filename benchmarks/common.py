"""Shared by the benchmark scripts: train.py command lines, config composition, a step timer, result tables."""

import json
import re
import socket
import statistics
import struct
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write `array` (uint8 values) as an MNIST IDX file."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    Path(path).write_bytes(header + array.astype(np.uint8).tobytes())


def write_fake_mnist(data_dir: Path, train_size: int = 60_000, test_size: int = 10_000, seed: int = 0) -> Path:
    """MNIST-shaped random images and labels in torchvision's layout under `data_dir`/MNIST/raw: MNIST offline."""
    raw = Path(data_dir) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for prefix, n in (("train", train_size), ("t10k", test_size)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))
    return Path(data_dir)


def train_command(*overrides: str) -> list[str]:
    """`python train.py OVERRIDES` with this interpreter."""
    return [sys.executable, str(ROOT / "train.py"), *overrides]


def timed_training(overrides: list[str], scratch: Path, warmup: int = 10) -> dict:
    """Train with `python train.py OVERRIDES test=false` and a StepTimer; returns the timer's figures."""
    timing = scratch / f"timing-{time.time_ns()}.json"
    command = train_command(*overrides, "test=false", f"paths.log_dir={scratch / 'logs'}",
                            "+callbacks.timer._target_=benchmarks.common.StepTimer",
                            f"+callbacks.timer.output={timing}", f"+callbacks.timer.warmup={warmup}")  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(timing.read_text())


def compose_config(overrides: list[str], run_dir: Path, keep_hydra: bool = False):
    """The config train.py would run with these overrides, its run directory `run_dir` (under log_dir
    `run_dir.parent`), resolvable outside a Hydra run; for the tests and the benchmarks."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from starter.run_name import run_name

    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver("run_name", run_name, use_cache=True)  # as train.py does
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # lets ${hydra:...} resolve
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)
        cfg.paths.log_dir = str(Path(run_dir).parent)
        if not keep_hydra:
            del cfg.hydra
    return cfg


class StepTimer(L.Callback):
    """Writes {steps, seconds, samples} of training from batch `warmup` to the epoch's last batch (rank 0).

    On a GPU the clock is read after the device has finished its queued work (torch.cuda.synchronize), only at
    the first and the last timed step: the steps between run as they would. Samples count the global batch."""

    def __init__(self, output: str, warmup: int = 10):
        self.output, self.warmup = Path(output), warmup
        self.start = self.end = None
        self.steps = self.samples = 0

    @staticmethod
    def _now(pl_module) -> float:
        if pl_module.device.type == "cuda":
            import torch

            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if batch_idx == self.warmup:
            self.start = self._now(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if batch_idx >= self.warmup:
            self.steps += 1
            # the global batch (under tp and pp every rank sees all of it)
            dm = trainer.datamodule
            self.samples += dm.batch_size if dm is not None else len(batch[1]) * trainer.world_size
            if batch_idx + 1 == trainer.num_training_batches:
                self.end = self._now(pl_module)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            import resource

            peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # this process (rank 0)
            figures = {"steps": self.steps, "samples": self.samples, "seconds": self.end - self.start,
                       "peak_rss_mb": peak_mb}  # fmt: skip
            self.output.write_text(json.dumps(figures))


def summary(values: list[float]) -> str:
    """median [min - max]"""
    return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]"


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class StepClock(L.Callback):
    """Rank 0 appends `<global step> <unix time>` to `output` as each training batch ends; each step takes `seconds`
    longer (a model's step). With `kill_at`, global rank `kill_rank` SIGKILLs itself as that step begins, once per
    `output` (the run's restart does not again), as a lost machine ends a process."""

    def __init__(self, output: str, seconds: float = 0.0, kill_at: int | None = None, kill_rank: int = 0):
        self.output, self.seconds, self.kill_at, self.kill_rank = Path(output), seconds, kill_at, kill_rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        time.sleep(self.seconds)
        marker = self.output.with_suffix(".killed")
        if trainer.global_step == self.kill_at and trainer.global_rank == self.kill_rank and not marker.exists():
            import os
            import signal

            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.is_global_zero:
            with self.output.open("a") as f:
                f.write(f"{trainer.global_step} {time.time()}\n")


class ExitAtFirstStep(L.Callback):
    """Writes the wall-clock time of the first training step to `output`, then ends the process at once."""

    def __init__(self, output: str):
        self.output = Path(output)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self.output.write_text(repr(time.time()))
        import os

        os._exit(0)


class LocalS3:
    """moto's S3 server on 127.0.0.1 checking credentials as a real store does, a bucket `shards` in it, and the
    standard AWS variables that reach it with a user's key; its log has a line per request."""

    def __init__(self, folder: Path):
        self.port, self.log = free_port(), folder / "s3.log"
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log.open("w"))
        endpoint = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while "Running on" not in self.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        import boto3

        # until authentication is switched on, moto takes any key: make a user with one, and the bucket
        anyone = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="-", aws_secret_access_key="-")
        iam = boto3.client("iam", **anyone)
        iam.create_user(UserName="trainer")
        everything = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(everything))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        self.env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        boto3.client("s3", **anyone).create_bucket(Bucket="shards")
        switch_on = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", b"0", {"Content-Type": "text/plain"})
        urllib.request.urlopen(switch_on, timeout=10)

    def gets(self, prefix: str) -> Counter:
        """How often each object under `prefix` was read."""
        return Counter(re.findall(rf'"GET /shards/{prefix}/(\S+) HTTP', self.log.read_text()))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
