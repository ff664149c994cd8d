"""`python train.py` end to end, as a user runs it: outputs, accuracy, evaluation, data sets, sweeps, errors."""

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, compose_config, on_bed, read_metrics, run_dirs, train, with_env

LIMIT = ["debug=limit"]  # 2 epochs of 5 batches: enough to prove a path runs, not to learn


def test_default_run_reaches_95_percent_test_accuracy(default_run):
    _, run_dir, _ = default_run
    metrics = read_metrics(run_dir)
    assert set(metrics) == {
        "train/loss",
        "train/acc",
        "val/loss",
        "val/acc",
        "test/loss",
        "test/acc",
        "val/acc_top5",
        "test/acc_top5",
        "val/acc_best",
        "train/images_per_s",
        "train/epoch_time",
        "lr",
    }
    assert metrics["test/acc"] >= 0.95 and metrics["val/acc"] >= 0.95
    assert metrics["val/acc_best"] >= metrics["val/acc"] and metrics["test/acc_top5"] >= metrics["test/acc"]


def test_each_epoch_logs_its_images_per_second_time_and_learning_rate(default_run):
    _, run_dir, _ = default_run
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/images_per_s")]
    assert len(rows) == 20  # one per epoch
    assert all(float(r["train/images_per_s"]) > 0 and float(r["train/epoch_time"]) > 0 for r in rows)
    with open(run_dir / "metrics.csv", newline="") as f:
        accs = [float(r["val/acc"]) for r in csv.DictReader(f) if r.get("val/acc")]
    assert [float(r["val/acc_best"]) for r in rows] == [max(accs[: i + 1]) for i in range(20)]  # the running best
    lrs = [float(r["lr"]) for r in rows]
    assert lrs[0] == pytest.approx(0.002) and lrs == sorted(lrs, reverse=True)  # cosine from the configured 0.002


def test_default_run_leaves_every_output_in_one_directory(default_run):
    _, run_dir, proc = default_run
    for name in ("config.yaml", "checkpoints/last.ckpt", "checkpoints/best.ckpt", "metrics.csv", "metrics.json",
                 "learning_curves.png", "train.log"):  # fmt: skip
        assert (run_dir / name).is_file(), name
    assert (run_dir / "learning_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "${" not in (run_dir / "config.yaml").read_text()  # resolved
    width = len("train/images_per_s")  # the longest name
    header, test_acc = f"{'metric':<{width}}  value", f"{'test/acc':<{width}}  {read_metrics(run_dir)['test/acc']:.4g}"
    assert proc.stdout.count(header) == 1 and f"{test_acc}    (checkpoints/best.ckpt)" in proc.stdout


def test_a_healthy_run_prints_what_runs_its_epochs_the_tested_checkpoint_the_table_and_where_it_is(default_run):
    # Nothing else: Lightning's notices, library chatter and Python's warnings go to train.log only.
    _, run_dir, proc = default_run
    lines = proc.stdout.splitlines() + proc.stderr.splitlines()
    table = len(read_metrics(run_dir)) + 2
    start = lines.index(next(line for line in lines if line.startswith("metric ")))
    said = [line for line in lines[:start] + lines[start + table :] if not line.startswith("epoch ")]
    relative = Path(os.path.relpath(run_dir, run_dir.parents[3]))  # the test ran in the logs' parent directory
    best = f"epoch {best_epoch(run_dir)}, val/acc {read_metrics(run_dir)['val/acc_best']:.4g}"
    assert said == [
        f"train: data=bed_digits model=bed_mlp strategy=auto precision=32, 1 process on cpu -> {relative}",
        f"testing checkpoints/best.ckpt ({best})",
        f"run directory: {relative}",
    ]
    log = (run_dir / "train.log").read_text()  # where everything else goes: the model's summary, with real rows
    assert "MLP: 85,002 parameters, 0.169 MFLOPs per image\n0      Flatten" in log and "SampleMean" not in log


def best_epoch(run_dir) -> int:
    with open(run_dir / "metrics.csv", newline="") as f:
        accs = [float(r["val/acc"]) for r in csv.DictReader(f) if r.get("val/acc")]
    return accs.index(max(accs)) + 1


def test_progress_in_a_log_file_is_one_line_per_epoch(default_run):
    _, _, proc = default_run  # stdout is a pipe, as in a SLURM log: no bar frames, one line per epoch
    lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in lines] == [f"epoch {e}/20" for e in range(1, 21)]
    assert "\r" not in proc.stdout
    assert lines[-1].startswith("epoch 20/20: 19 steps in ") and "train/loss" in lines[-1] and "val/acc" in lines[-1]
    assert not any("train/epoch_time" in line for line in lines)  # its own figure is "steps in"; not last epoch's


def test_progress_bar_on_a_terminal_is_redrawn_a_few_times_a_second_not_at_every_step(tmp_path):
    import fcntl
    import os
    import pty
    import re
    import struct
    import subprocess
    import sys
    import termios

    from conftest import ROOT

    master, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *on_bed([f"paths.log_dir={tmp_path}",
                             "accelerator=cpu", "data.batch_size=8", "trainer.max_epochs=2", "test=false"])],
                            stdout=terminal, env=with_env(),
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)  # fmt: skip
    os.close(terminal)
    output = b""
    while chunk := _read(master):
        output += chunk
    assert proc.wait() == 0
    seconds = time.monotonic() - started
    redraws = len(re.findall(r"\r(?!\n)", output.decode(errors="replace")))  # a bar frame starts with a bare CR
    # At most 4 a second, one frame each (the count and the figures together: Lightning's training bar draws two,
    # which under load passed this bound), plus a few at each epoch's start and end and around validation.
    # Lightning's bar, redrawn at every one of the 314 steps, drew 3 frames per step (about 900).
    assert 0 < redraws <= 4 * seconds + 2 * 20, (redraws, seconds)


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # the other end closed
        return b""


def test_checkpoints_load_with_torch_weights_only_and_plain_keys(default_run):
    _, run_dir, _ = default_run
    checkpoint = torch.load(run_dir / "checkpoints" / "best.ckpt", weights_only=True)  # torch's default since 2.6
    keys = list(checkpoint["state_dict"])
    assert keys and all(k.startswith("net.") for k in keys)
    from bed.nets import MLP

    net = MLP([1, 8, 8], 10)
    net.load_state_dict({k.removeprefix("net."): v for k, v in keys_values(checkpoint)})


def keys_values(checkpoint):
    return ((k, v) for k, v in checkpoint["state_dict"].items() if k.startswith("net."))


def test_evaluating_the_best_checkpoint_reproduces_the_test_metrics(default_run, tmp_path):
    _, run_dir, _ = default_run
    train(tmp_path, "train=false", f"ckpt_path={run_dir / 'checkpoints' / 'best.ckpt'}")
    (eval_dir,) = run_dirs(tmp_path)
    evaluated, trained = read_metrics(eval_dir), read_metrics(run_dir)
    tested = ("test/loss", "test/acc", "test/acc_top5")
    assert evaluated == {key: trained[key] for key in tested}


def test_ckpt_path_last_resumes_the_newest_run(default_run):
    tmp_path, run_dir, _ = default_run
    proc = train(tmp_path, "ckpt_path=last", "trainer.max_epochs=21")
    assert f"ckpt_path=last -> {run_dir / 'checkpoints' / 'last.ckpt'}" in proc.stdout + proc.stderr
    resumed = [d for d in run_dirs(tmp_path) if d != run_dir][0]
    with open(resumed / "metrics.csv", newline="") as f:
        trained_epochs = {row["epoch"] for row in csv.DictReader(f) if row["train/loss"]}
    assert trained_epochs == {"20"}  # the first run's 20 epochs (0-19) were restored, only epoch 20 is new


def test_the_vision_transformer_trains_the_digits_to_95_percent(tmp_path):
    train(tmp_path, "model=bed_vit")  # the default trainer: 20 epochs
    assert read_metrics(run_dirs(tmp_path)[0])["test/acc"] >= 0.95


def test_multirun_gives_each_job_its_own_directory(tmp_path):
    proc = train(tmp_path, "-m", "model=bed_mlp,bed_cnn", "seed=1,2", *LIMIT)
    sweeps = list((tmp_path / "logs" / "train" / "multiruns").glob("*"))
    assert len(sweeps) == 1
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir() and p.name.isdigit())
    assert [j.name for j in jobs] == ["0", "1", "2", "3"]
    seen = set()
    for job in jobs:
        cfg = (job / "config.yaml").read_text()
        seen.add((cfg.split("seed: ")[1].split()[0], "CNN" if "nets.CNN" in cfg else "MLP"))
        assert (job / "metrics.json").is_file() and (job / "checkpoints" / "last.ckpt").is_file()
    assert seen == {("1", "MLP"), ("2", "MLP"), ("1", "CNN"), ("2", "CNN")}
    assert not (tmp_path / "logs" / "train" / "runs").exists() and proc.returncode == 0
    # it ends with its answer: a table across the jobs, the best marked, and the same rows in summary.csv
    with open(sweeps[0] / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    values = [read_metrics(job)["val/acc"] for job in jobs]
    assert [float(r["val/acc"]) for r in rows] == values and [r["run_dir"] for r in rows] == [str(j) for j in jobs]
    assert [int(r["best"]) for r in rows] == [int(v == max(values)) for v in values]
    swept = [" ".join(o for o in r["overrides"].split() if o.startswith(("model=", "seed="))) for r in rows]
    assert swept == ["model=bed_mlp seed=1", "model=bed_mlp seed=2", "model=bed_cnn seed=1", "model=bed_cnn seed=2"]
    table = proc.stdout[proc.stdout.index("sweep of 4 job(s) by val/acc, the highest marked *:") :].splitlines()
    best = values.index(max(values))  # each row: the overrides that differ between the jobs
    assert table[1 + best].startswith(f"* job {best}   {swept[best]}  {values[best]:.4g}")
    assert table[-1] == f"summary: {(sweeps[0] / 'summary.csv').relative_to(tmp_path)}"  # from where it ran


def test_bad_config_exits_2_with_one_line_and_no_run_started(tmp_path):
    proc = train(tmp_path, "strategy=ddp", "devices=2", "data.batch_size=63", expect_ok=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: data.batch_size=63 is the global batch and does not divide by the 2 processes;"
        " use a multiple of 2, e.g. data.batch_size=62"
    ]
    assert not list(tmp_path.glob("logs/train/runs/*"))  # a run refused before it started leaves no directory


def no_such(given: str, *more: str) -> str:
    """The line for an unknown option `given` (group=option): the project's options of its group (conf/), and `more`."""
    group = given.split("=")[0]
    options = sorted([*(p.stem for p in (ROOT / "conf" / group).glob("*.yaml")), *more])
    return f"{given}: no such option; choose one of {', '.join(options)}"


FOREIGN_CONF = ROOT / "tests" / "foreign" / "conf"
FOREIGN_DATA = ["dict_digits", "template_digits", "token_stream"]


@pytest.mark.parametrize(
    "script,overrides,line",
    [
        ("train.py", ["strategy=fdsp"], no_such("strategy=fdsp")),
        ("train.py", ["-m", "seed=1,2", "model=mpl,nope"], no_such("model=mpl")),
        ("train.py", ["-m", "model=mpl", "seed=1,2"], no_such("model=mpl")),
        ("train.py", ["data=null"], no_such("data=null")),
        # --config-dir=DIR (Hydra's = form) is searched, and the overrides after it are read
        (
            "train.py",
            [f"--config-dir={FOREIGN_CONF}", "trainer.max_epochs=1", "data=dict_digit"],
            no_such("data=dict_digit", *FOREIGN_DATA),
        ),
        ("predict.py", ["strategy=dpp", "inputs=x"], no_such("strategy=dpp")),
        # a config folder of one's own adds its options (tests/foreign/conf: data=dict_digits, ...)
        (
            "train.py",
            [f"hydra.searchpath=[file://{FOREIGN_CONF}]", "data=dict_digit"],
            no_such("data=dict_digit", *FOREIGN_DATA),
        ),
    ],
)
def test_an_unknown_group_option_is_one_line_exit_2_and_no_run_directory(script, overrides, line, tmp_path):
    command = [sys.executable, str(ROOT / script), *overrides, f"paths.log_dir={tmp_path / 'logs'}"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    (said,) = proc.stderr.splitlines()
    assert said.startswith(f"error: {line}")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing made: no logs/, no outputs/


@pytest.mark.parametrize("flag", [["--config-dir=DIR"], ["--config-dir", "DIR"], ["-cd", "DIR"]])
def test_an_option_of_a_config_dir_given_either_way_hydra_reads_it_is_no_error(flag):
    from starter.config_choices import check_choices

    folder = str(ROOT / "tests" / "foreign" / "conf")
    check_choices(ROOT / "conf", "train", [f.replace("DIR", folder) for f in flag] + ["seed=1", "data=dict_digits"])


def test_metrics_json_is_flat_json(default_run):
    _, run_dir, _ = default_run
    data = json.loads((run_dir / "metrics.json").read_text())
    assert all(isinstance(v, float) for v in data.values())


def test_tf32_is_set_in_each_process_that_trains_on_a_gpu_and_never_on_cpu(tmp_path, monkeypatch):
    # Set where every process starts (run.start_process), so ddp_spawn's fresh interpreters get it too.
    from starter.run import start_process

    for seeded in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # start_process seeds: restored after the test
        monkeypatch.setenv(seeded, "0")

    def process(accelerator: str, *overrides: str):
        cfg = compose_config([f"accelerator={accelerator}", *overrides], tmp_path)  # as preflight settles it
        start_process(cfg)

    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        process("cpu")
        assert torch.get_float32_matmul_precision() == before[0]
        process("gpu")  # the default, tf32: true
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
        process("gpu", "tf32=false")
        assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_validating_every_other_epoch_keeps_the_best_checkpoint_without_a_word_about_the_monitor(tmp_path):
    # the first epoch logs no val/acc: no validation ran, which is not a task that logs no monitor
    proc = train(tmp_path, *LIMIT, "trainer.max_epochs=2", "trainer.check_val_every_n_epoch=2", "test=false")
    assert "logs no such metric" not in proc.stdout + proc.stderr
    assert (run_dirs(tmp_path)[0] / "checkpoints" / "best.ckpt").is_file()


def test_train_false_tests_exactly_the_weights_given_whichever_way_they_are_given(default_run, tmp_path):
    checkpoints = default_run[1] / "checkpoints"  # model.pt holds the final weights, as last.ckpt does
    by_weights = train(tmp_path / "weights", "train=false", f"init_from={checkpoints / 'model.pt'}")
    train(tmp_path / "checkpoint", "train=false", f"ckpt_path={checkpoints / 'last.ckpt'}")
    tested = [read_metrics(run_dirs(tmp_path / kind)[0])["test/acc"] for kind in ("weights", "checkpoint")]
    assert tested[0] == tested[1] >= 0.9  # trained weights, not a fresh initialisation's 0.1
    assert f"(init_from={checkpoints / 'model.pt'})" in by_weights.stdout


@pytest.mark.parametrize(
    "overrides,said",
    [
        (["train=false"], "train=false tests the weights given: give ckpt_path=PATH (a checkpoint; auto and last: one"),
        (["train=false", "ckpt_path=auto"], "train=false tests the weights given: give ckpt_path=PATH"),
        (["train=false", "test=false", "init_from=x.pt"], "train=false test=false: nothing to run;"),
    ],
)
def test_train_false_without_weights_to_test_is_one_line_before_the_run(overrides, said, tmp_path):
    (tmp_path / "x.pt").touch()
    proc = train(tmp_path, *overrides, expect_ok=False)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {said}") and proc.stderr.count("\n") == 1


def test_a_truncated_checkpoint_is_one_line_naming_the_whole_ones_beside_it(default_run, tmp_path):
    import shutil

    _, run_dir, _ = default_run
    saved = shutil.copytree(run_dir / "checkpoints", tmp_path / "copied")
    last = saved / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a copy cut short
    proc = train(tmp_path / "resumed", f"ckpt_path={last}", "trainer.max_epochs=21", expect_ok=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "Traceback"))]
    said = (
        f"error: ckpt_path={last} is not a readable Lightning checkpoint (RuntimeError: PytorchStreamReader failed"
        " reading zip archive: failed finding central directory); whole beside it:"
        f" ckpt_path={saved / 'best.ckpt'} resumes from best.ckpt, init_from={saved / 'model.pt'} starts afresh from"
        " its weights"
    )
    assert proc.returncode == 2 and lines == [said], lines


def test_a_checkpoint_is_continued_and_evaluated_on_the_split_it_was_trained_on(tmp_path):
    # the README's sweep, then the README's `ckpt_path=last`: it continues the newest job (seed 3) on seed 3's split,
    # says which job and why; a run that gives another seed for it is refused, naming both (digits' split is drawn
    # from data.seed: seed 42's test images are mostly seed 3's training images)
    from omegaconf import OmegaConf

    from conftest import sweep_jobs

    train(tmp_path, "-m", "seed=1,3", "debug=limit", "trainer.max_epochs=1")
    job = sweep_jobs(tmp_path)[-1]
    last = job / "checkpoints" / "last.ckpt"
    continued = train(tmp_path, "ckpt_path=last", "debug=limit", "trainer.max_epochs=1")
    said = continued.stdout + continued.stderr
    line = next(line for line in said.splitlines() if line.startswith("ckpt_path=last -> "))
    assert line.startswith(f"ckpt_path=last -> {last} (job 1 of the sweep {job.parent}: ") and " seed=3 " in line
    assert f"data.seed=3: the split ckpt_path={last} was trained on (its record)" in said
    (run,) = [r for r in run_dirs(tmp_path) if r.parent.name == "runs"]
    assert OmegaConf.load(run / "config.yaml").data.seed == 3
    refused = train(tmp_path, "train=false", f"ckpt_path={last}", "seed=42", expect_ok=False)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: ckpt_path={last} was trained on the split data.seed=3 draws; this run gives data.seed=42: its test"
        " samples would be among the checkpoint's training samples; give data.seed=3, or no data.seed"
    ]
