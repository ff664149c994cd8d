"""Every option of every config group composes, resolves and builds; the contract's keys exist."""

import logging
import re
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import CONF, ROOT, compose_config, predict, run_dirs, train
from starter.config_schema import PRECISIONS
from starter.errors import UserError
from starter.preflight import prepare
from starter.strategies.build import build_strategy
from starter.topology import Layout, Traits

GROUPS = ["data", "model", "strategy", "trainer", "callbacks", "logger", "paths", "hydra", "experiment", "debug",
          "hparams_search", "fault_tolerance"]  # fmt: skip
GROUPS += ["launcher"]  # full examples


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_contract_groups_and_top_level_keys_exist(tmp_path):
    # experiment: the project's saved recipes, none if it has none
    assert all((CONF / group).is_dir() and options(group) for group in GROUPS if group != "experiment")
    cfg = compose_config([], tmp_path)
    for key in ("devices", "num_nodes", "accelerator", "precision", "seed", "ckpt_path", "train", "test"):
        assert key in cfg
    assert cfg.data._target_ == "bed.data.Digits" and cfg.strategy.name == "auto"


@pytest.mark.parametrize(
    "group,option",
    [(g, o) for g in GROUPS for o in options(g) if g not in ("paths", "hydra")],
)
def test_every_option_composes_and_resolves(group, option, tmp_path):
    # data=none: for a module that owns its loaders, which reads no data key (the Classifier reads data's shape)
    alone = ["model=own_loaders", f"hydra.searchpath=[file://{ROOT / 'tests' / 'foreign' / 'conf'}]"]
    cfg = compose_config([f"{group}={option}", *(alone if (group, option) == ("data", "none") else [])], tmp_path)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert str(resolved["precision"]) in PRECISIONS


@pytest.mark.parametrize("value", PRECISIONS)
def test_the_precision_key_builds_the_precision_plugin_with_a_loss_scaler_for_fp16(value):
    import torch

    from starter.strategies.precision import SharedOverflowScaler, precision_plugin

    plugin = precision_plugin(value, "cpu", whole_weights=False)
    assert plugin.precision == {"32": "32-true"}.get(value, value)
    scaler = getattr(plugin, "scaler", None)
    assert isinstance(scaler, SharedOverflowScaler) == (value == "16-mixed")
    if value == "16-mixed":  # fp16 autocast on the CPU, not bf16; the overflow decision shared between ranks
        assert scaler.shared and plugin.device == "cpu"
        with plugin.forward_context():
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16


@pytest.mark.parametrize("option", options("model"))
def test_every_model_builds_and_maps_images_to_logits(option, tmp_path):
    import torch

    cfg = compose_config([f"model={option}"], tmp_path)  # the default data: 8x8 digits
    if cfg.data.image_shape[-1] % cfg.model.net.get("patch_size", 1):  # e.g. a ViT of 16x16 patches, for 224x224
        cfg = compose_config([f"model={option}", "data=bed_images", "data.num_classes=10"], tmp_path)
    model = instantiate(cfg.model)
    assert model(torch.zeros(2, *cfg.data.image_shape)).shape == (2, 10)


@pytest.mark.parametrize("option", options("strategy"))
def test_every_strategy_builds_the_class_its_config_names_and_declares_known_traits(option, tmp_path):
    from hydra.utils import get_class
    from lightning.pytorch.strategies import Strategy

    cfg = compose_config([f"strategy={option}"], tmp_path)
    Traits.of(cfg.strategy)  # an unknown trait name would be refused here
    strategy = build_strategy(cfg.strategy, Layout(1, 2))
    if "_target_" in cfg.strategy:
        assert isinstance(strategy, get_class(cfg.strategy._target_)) and isinstance(strategy, Strategy)
    else:
        assert strategy == option  # a name Lightning knows


# Each trait, declared on ddp (which supports everything), drives its check: the reason given is the one shown.
TRAIT_CHECKS = [
    (["+strategy.traits.compiles=it cannot", "compile=true"], "compile=true with strategy=ddp: it cannot"),
    (
        ["+strategy.traits.clips_gradients=it cannot", "trainer.gradient_clip_val=1"],
        "gradient_clip_val with strategy=ddp",
    ),
    (
        ["+strategy.traits.whole_weights=false", "callbacks.weight_averaging.decay=0.9"],
        "needs whole weights in each process",
    ),
    (["strategy.traits.syncs_batchnorm=false", "sync_batchnorm=true"], "sync_batchnorm=true is for strategy=ddp or"),
    (["~strategy.traits.launcher"], "strategy=ddp runs one process on one device, but devices=2"),
    (["+strategy.traits.pipeline=true", "+strategy.microbatches=3", "+strategy.schedule=gpipe"], "=3 does not divide"),
    (["+strategy.traits.unknown=true"], "declares unknown traits \\['unknown'\\]"),
]


@pytest.mark.parametrize("overrides,message", TRAIT_CHECKS)
def test_each_trait_a_strategy_declares_drives_its_check(overrides, message, tmp_path):
    with pytest.raises(UserError, match=message):
        prepare(compose_config(["strategy=ddp", "devices=2", "accelerator=cpu", *overrides], tmp_path))


def test_fault_tolerance_without_torchft_names_the_extra_in_one_line(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else find_spec(name, *a)
    )
    with pytest.raises(UserError, match=r"^fault_tolerance=torchft needs torchft: pip install -e '.\[ft\]'$"):
        prepare(compose_config(["fault_tolerance=torchft"], tmp_path))


def test_a_strategy_that_cannot_scale_fp16_is_refused_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr("starter.topology.cuda_device_count", lambda: 2)
    cfg = compose_config(["strategy=ddp", "devices=2", "accelerator=gpu", "precision=16-mixed",
                          "+strategy.traits.scales_fp16=no scaler"], tmp_path)  # fmt: skip
    with pytest.raises(UserError, match="strategy=ddp cannot scale fp16 losses \\(16-mixed\\): no scaler"):
        prepare(cfg)


@pytest.mark.parametrize("option", ["ddp", "ddp_spawn"])
def test_one_process_of_ddp_trains_without_the_ddp_wrapper_and_says_so(option, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="starter.strategies.build"):
        assert build_strategy(compose_config([f"strategy={option}"], tmp_path).strategy, Layout(1, 1)) == "auto"
    assert f"strategy={option} with one process: nothing to all-reduce, so it trains as strategy=auto" in caplog.text


def test_unknown_group_option_lists_valid_ones(tmp_path):
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["strategy=fdsp"], tmp_path)
    assert "ddp_spawn" in str(err.value.__cause__ or err.value) or "ddp_spawn" in str(err.value)


def test_help_lists_config_groups():
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for group in set(GROUPS) - {"hydra"}:  # Hydra's own settings are not an option users pick
        assert f"{group}: {', '.join(options(group))}\n" in out.stdout
    assert "precision: 32 |" in out.stdout


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["strategy=ddp", "devices=2", "data.batch_size=63"], "does not divide by the 2 processes"),
        (["strategy=ddp", "devices=2", "num_nodes=2", "data.batch_size=66"], "does not divide by the 4 processes"),
        (["strategy=ddp_spawn", "devices=2", "data.batch_size=63"], "does not divide by the 2 processes"),
        (["strategy=fsdp", "strategy.cpu_offload=true", "accelerator=cpu"], "this run is on CPU already"),
        (["devices=2"], "use strategy=ddp"),
        (["devices=0"], "must be at least 1"),
        (["precision=fp8"], "choose one of 32, 16-mixed, bf16-mixed, bf16-true"),
        (["stop_signals=[SIGTERM,SIGSTOPP]"], "stop_signals: SIGSTOPP is no signal here; use names such as SIGTERM"),
        (["ckpt_path=/nonexistent/x.ckpt"], "no such file"),
        (["ckpt_path=last"], "no checkpoints/last.ckpt"),
        (["ckpt_path=/"], "^ckpt_path=/ is a directory but no checkpoint; give a .ckpt file, a sharded checkpoint or"),
        # one copy of each device key: Lightning's own (trainer.devices=2) would start its launcher behind ours
        (["trainer.devices=2"], "^trainer.devices=2: set devices=2 instead; the top-level key is the one"),
        (["trainer.num_nodes=2"], "^trainer.num_nodes=2: set num_nodes=2 instead"),
        (["trainer.accelerator=cpu"], "^trainer.accelerator=cpu: set accelerator=cpu instead"),
        (["+trainer.strategy=ddp"], "^trainer.strategy=ddp: set strategy=ddp \\(a config group: conf/strategy/\\)"),
        (["+trainer.precision=bf16-mixed"], "^trainer.precision=bf16-mixed: set precision=bf16-mixed instead"),
        (["data._target_=not_a_package.Data"], "^data._target_=not_a_package.Data: no module not_a_package \\(is"),
        # what Lightning and numpy take unchecked or fail on mid-run (a traceback, or a run that never steps)
        (["seed=abc"], "^seed=abc: give a whole number from 0 to 4294967295$"),
        (["seed=-1"], "^seed=-1: give a whole number from 0"),
        (["seed=null"], "^seed=null: give a whole number from 0"),
        (["data.batch_size=0"], "^data.batch_size=0: give a whole number of 1 or more$"),
        (["trainer.accumulate_grad_batches=-2"], "^trainer.accumulate_grad_batches=-2: give a whole number of 1 or"),
        (["trainer.check_val_every_n_epoch=0"], "^trainer.check_val_every_n_epoch=0: give a whole number of 1 or"),
        # fault_tolerance=torchft: what it cannot run, said before any group starts
        (
            ["fault_tolerance=torchft", "strategy=tp", "devices=2"],
            "^fault_tolerance=torchft with strategy=tp: "
            "a replica group runs ddp or fsdp \\(or one process\\) inside; use strategy=ddp or fsdp$",
        ),
        (
            ["fault_tolerance=torchft", "strategy=fsdp", "devices=4", "strategy.tensor_parallel_size=2"],
            "^fault_tolerance=torchft with strategy=fsdp at tensor_parallel_size=2, pipeline_parallel_size=1: a"
            " replica group shards data only \\(fsdp inside, averaged across groups\\); set both to 1$",
        ),
        (["fault_tolerance=torchft", "fault_tolerance.replica_group=2"], "=2: the groups are 0 to 1"),
        (["fault_tolerance=torchft", "fault_tolerance.sync_every=0"], "^fault_tolerance.sync_every=0: give a whole"),
        (["fault_tolerance=torchft", "precision=16-mixed"], "a joining group would not get the loss scale"),
        (["fault_tolerance=torchft", "trainer.accumulate_grad_batches=2"], "accumulated batches would be lost"),
        (
            ["fault_tolerance=torchft", "fault_tolerance.replica_group=1"],
            "^replica group 1 needs the lighthouse's"
            " address: fault_tolerance.lighthouse=http://<replica group 0's host>:29510",
        ),
        (["fault_tolerance=torchft", "data.batch_size=63"], "does not divide by the 2 processes"),  # both groups'
        (["fault_tolerance=torchft", "strategy=ddp", "devices=2", "data.batch_size=66"], "by the 4 processes"),
    ],
)
def test_bad_config_is_refused_before_training(overrides, message, tmp_path):
    with pytest.raises(UserError, match=message):
        prepare(compose_config(overrides, tmp_path / "run"))


@pytest.mark.parametrize(
    "override,said",
    [
        ("+trainer.reload_dataloaders_every_n_epochs=-1", "`reload_dataloaders_every_n_epochs` should be an int >= 0"),
        ("trainer.limit_train_batches=0.001", "You requested to check 0.001 of the `train_dataloader` but"),  # fit
    ],
)
def test_a_setting_lightning_refuses_is_one_line_and_exit_2(override, said, tmp_path):
    proc = train(tmp_path, "debug=limit", override, expect_ok=False)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: Lightning: {said}")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    (run_dir,) = run_dirs(tmp_path)  # its traceback, for whoever debugs it, is in the log file
    assert "lightning.fabric.utilities.exceptions.MisconfigurationException" in (run_dir / "train.log").read_text()


@pytest.mark.parametrize(
    "overrides,said",
    [
        (
            ["+callbacks.x._target_=nonexistent.Cls"],
            "callbacks.x._target_=nonexistent.Cls: cannot import it: "
            "ModuleNotFoundError\\(\"No module named 'nonexistent'\"\\)",
        ),
        # each rank meets it (Hydra's own: a traceback from each), the first to report says it
        (
            ["strategy=ddp", "devices=2", "model.optimizer._target_=torch.optim.Nope"],
            "rank [01] \\(node 0\\): model.optimizer._target_=torch.optim.Nope: cannot import it: ",
        ),
    ],
)
def test_a_target_that_does_not_import_is_one_line_and_exit_2(overrides, said, tmp_path):
    proc = train(tmp_path, "debug=limit", *overrides, expect_ok=False)
    assert proc.returncode == 2 and re.match(f"error: {said}", proc.stderr)
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


def asked(key: str) -> str:
    return f"error: {key}: no value given; set {key}=... on the command line\n"


# Values users mistype, across the groups: each one line on stderr naming the key, exit 2, no traceback. Checked before
# the run starts (conf's types and ranges: starter/config_schema.py), so no run directory is left...
REFUSED_BEFORE_THE_RUN = [
    ("data.batch_size=abc", "data.batch_size=abc: give a whole number of 1 or more"),
    ("data.batch_size=true", "data.batch_size=True: give a whole number of 1 or more"),  # a bool is no number
    ("data.num_workers=-1", "data.num_workers=-1: give a whole number of 0 or more"),
    ("model.optimizer.lr=-1", "model.optimizer.lr=-1: give a number above 0"),
    ("model.optimizer.weight_decay=-0.1", "model.optimizer.weight_decay=-0.1: give a number of 0 or more"),
    ("model.net.width=abc", "model.net.width=abc: give a whole number of 1 or more"),
    ("model.net.depth=0", "model.net.depth=0: give a whole number of 1 or more"),
    ("model.net.dropout=1.5", "model.net.dropout=1.5: give a number from 0 to 1"),
    ("model.label_smoothing=2", "model.label_smoothing=2: give a number from 0 to 1"),
    ("trainer.max_epochs=abc", "trainer.max_epochs=abc: give a whole number of -1 or more"),
    ("+trainer.max_steps=1.5", "trainer.max_steps=1.5: give a whole number of -1 or more"),
    ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0: give a whole number of 1 or more"),
    ("trainer.limit_train_batches=-1", "trainer.limit_train_batches=-1: give a number of 0 or more"),
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val=-1: give a number of 0 or more"),
    ("+trainer.num_sanity_val_steps=-2", "trainer.num_sanity_val_steps=-2: give a whole number of -1 or more"),
    ("trainer.deterministic=sometimes", "trainer.deterministic=sometimes: give true or false"),
    ("trainer.enable_progress_bar=2", "trainer.enable_progress_bar=2: give true or false"),
    ("callbacks.freeze_backbone.epochs=-1", "callbacks.freeze_backbone.epochs=-1: give a whole number of 0 or more"),
    ("heartbeat_timeout_s=0", "heartbeat_timeout_s=0: give a number above 0"),
    ("stop_grace_s=-1", "stop_grace_s=-1: give a number above 0"),
    ("nodes_wait_s=abc", "nodes_wait_s=abc: give a number above 0"),
    ("channels_last=1", "channels_last=1: give true or false"),
    ("num_nodes=0", "num_nodes=0: give a whole number of 1 or more"),
    ("seed=1.5", "seed=1.5: give a whole number from 0 to 4294967295"),
]
# ...or refused by the library as the run builds its objects: one line naming the key and the library's reason, its
# traceback in the run's train.log
REFUSED_AS_BUILT = [
    ("+model.optimizer.betas=[2,0.9]", "model.optimizer: ValueError: Invalid beta parameter at index 0: 2"),
    ("model.scheduler._target_=torch.optim.lr_scheduler.StepLR", "model.scheduler: TypeError: StepLR.__init__()"),
    ("+trainer.foo=1", "trainer: TypeError: Trainer.__init__() got an unexpected keyword argument 'foo'"),
    ("+callbacks.x._target_=lightning.pytorch.callbacks.EarlyStopping", "callbacks.x: TypeError: EarlyStopping."),
    ("callbacks.best_checkpoint.mode=maxx", "Lightning: `mode` can be min, max but got maxx"),
    ("data.split=[0.5,0.5]", "data.split=[0.5, 0.5]: give three fractions (train, val, test) that sum to 1"),
]


def test_a_mistyped_value_is_refused_before_the_run_in_one_line_naming_its_key(tmp_path):
    for override, said in REFUSED_BEFORE_THE_RUN:
        with pytest.raises(UserError) as refused:
            prepare(compose_config(override.split(), tmp_path / "run"))
        assert str(refused.value) == said, override
    # as a user meets it: that line alone on stderr, exit 2, no run directory (main.main's handling of every one)
    proc = train(tmp_path, "debug=fdr", REFUSED_BEFORE_THE_RUN[0][0], expect_ok=False)
    assert (proc.returncode, proc.stderr) == (2, f"error: {REFUSED_BEFORE_THE_RUN[0][1]}\n")
    assert not list(tmp_path.glob("logs/train/runs/*"))


def test_a_node_count_that_is_no_number_is_one_line_not_a_traceback_from_the_run_directorys_name(tmp_path):
    # num_nodes names the run directory (several nodes share one name) and how the job ends: both read it as given
    proc = train(tmp_path, "debug=fdr", "num_nodes=abc", expect_ok=False)
    assert (proc.returncode, proc.stderr) == (2, "error: num_nodes=abc: give a whole number of 1 or more\n")


@pytest.mark.slow  # each builds a run's objects
def test_a_value_a_library_refuses_as_the_run_builds_is_one_line_naming_its_key_and_exit_2(tmp_path):
    for case, (override, said) in enumerate(REFUSED_AS_BUILT):
        run = tmp_path / str(case)
        proc = train(run, "debug=fdr", *override.split(), expect_ok=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith(f"error: {said}"), (override, errors)
        assert "Traceback" not in proc.stdout + proc.stderr, override
        (log,) = run.glob("logs/train/runs/*/train.log")  # the library's traceback, for whoever debugs it
        assert "Traceback" in log.read_text() or said.startswith(("Lightning", "data.split")), override


def test_a_value_the_config_leaves_to_the_user_is_asked_for_in_one_line(tmp_path):
    proc = predict(tmp_path, expect_ok=False)
    assert proc.returncode == 2 and proc.stderr == asked("inputs")
    assert not list(tmp_path.glob("logs/*/runs/*"))  # refused before the run started


# full examples: begin
def test_shards_ask_for_their_source_and_their_destination_in_one_line(tmp_path):
    proc = train(tmp_path, "data=shards", expect_ok=False)
    assert proc.returncode == 2 and proc.stderr == asked("data.source")
    command = [sys.executable, str(ROOT / "make_shards.py"), f"paths.log_dir={tmp_path}"]  # train() adds accelerator=
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == asked("out")


# full examples: end
def test_fp16_on_cpu_stays_fp16(tmp_path, caplog):
    cfg = compose_config(["precision=16-mixed", "accelerator=cpu"], tmp_path)
    prepare(cfg)
    assert cfg.precision == "16-mixed" and not caplog.records


def test_ckpt_path_last_picks_the_newest_earlier_run(tmp_path):
    import os

    older, newer = (tmp_path / "logs" / "train" / "runs" / name / "checkpoints" for name in ("a", "b"))
    for i, folder in enumerate((older, newer)):
        folder.mkdir(parents=True)
        (folder / "last.ckpt").write_bytes(b"x")
        os.utime(folder / "last.ckpt", (1000 + i, 1000 + i))
    cfg = compose_config(["ckpt_path=last"], tmp_path / "logs" / "train" / "runs" / "now")
    cfg.paths.log_dir = str(tmp_path / "logs")
    prepare(cfg)
    assert cfg.ckpt_path == str(newer / "last.ckpt")


def test_gpu_only_choices_are_decided_up_front(tmp_path, monkeypatch):
    monkeypatch.setattr("starter.topology.cuda_device_count", lambda: 0)
    with pytest.raises(UserError, match="accelerator=gpu: this machine has no CUDA GPU; use accelerator=cpu"):
        prepare(compose_config(["accelerator=gpu"], tmp_path))
    monkeypatch.setattr("starter.topology.cuda_device_count", lambda: 2)
    with pytest.raises(UserError, match="devices=4: this machine has 2 CUDA GPU"):
        prepare(compose_config(["accelerator=gpu", "strategy=ddp", "devices=4"], tmp_path))
    cfg = compose_config(["accelerator=gpu", "strategy=dp", "devices=2", "precision=16-mixed"], tmp_path)
    prepare(cfg)  # dp on 2 GPUs with real fp16: allowed, nothing redirected
    assert cfg.precision == "16-mixed"


def test_what_a_datamodule_declares_is_read_off_its_source_as_its_class_says_it(tmp_path):
    # preflight reads `shards_itself` without importing the DataModule (no torch before launch): it must agree with
    # the class itself, which run.py reads, for every shipped DataModule, foreign ones and one that turns it off
    from hydra.utils import get_object

    from starter.declared import declared

    off = "from bed.data import Digits as D\n\n\nclass Off(D):\n    shards_itself = False\n"
    (tmp_path / "turned_off.py").write_text(off)
    sys.path.insert(0, str(tmp_path))
    try:
        targets = [t for p in sorted((CONF / "data").glob("*.yaml")) if (t := OmegaConf.load(p).get("_target_"))]
        targets += ["bed.data.Digits", "bed.data.RandomImages"]
        targets += ["foreign.template.DigitsDataModule", "foreign.tokens.TokenStream", "turned_off.Off"]
        for target in targets:
            assert bool(declared(target, "shards_itself")) == getattr(get_object(target), "shards_itself", False)
    finally:
        sys.path.remove(str(tmp_path))
    assert declared("turned_off.Off", "shards_itself") is False and declared("turned_off.Off", "other") is None


def test_the_options_of_a_searchpath_that_conf_hydra_default_names_are_options(tmp_path):
    from starter.config_choices import check_choices

    # a project's conf/hydra/default.yaml naming a folder of its own, as `hydra.searchpath`s in the primary config do
    conf, own = tmp_path / "conf", tmp_path / "own"
    (conf / "hydra").mkdir(parents=True)
    (conf / "model").mkdir()
    (own / "model").mkdir(parents=True)
    (conf / "hydra" / "default.yaml").write_text(f"searchpath:\n  - file://{own}\n")
    (own / "model" / "mine.yaml").write_text("_target_: x.Y\n")
    check_choices(conf, "train", ["model=mine"])  # no exit: the option is there
    with pytest.raises(SystemExit):
        check_choices(conf, "train", ["model=theirs"])


def test_torchruns_restarts_key_the_runs_store_by_the_attempt_not_by_how_many_may_come(monkeypatch):
    from starter.topology import key_prefix

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    keys = []
    for attempt in ("0", "1"):  # a restart's keys are its own: the first attempt's stop or failure stops it not
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        keys.append(key_prefix())
    assert keys[0] != keys[1] and keys[1].endswith("/job/1")


def test_torchrun_agents_that_share_no_store_name_the_run_after_the_job_as_one_path_component(monkeypatch):
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: no store outlives a restart to keep a time stamp in (docs/clusters.md)
    from starter.run_name import run_name

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job 7/../x")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    run_name.cache_clear()
    try:
        assert run_name() == "torchrun-job_7_.._x"
    finally:
        run_name.cache_clear()


def test_unrelated_torchrun_jobs_with_the_default_rdzv_id_are_refused_rather_than_share_a_directory(
    monkeypatch, capsys
):
    from starter.run_name import run_name

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default --rdzv-id
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    monkeypatch.setenv("RANK", "0")
    run_name.cache_clear()
    try:
        with pytest.raises(SystemExit) as refused:
            run_name()
    finally:
        run_name.cache_clear()
    assert refused.value.code == 2
    assert capsys.readouterr().err.startswith("error: torchrun --rdzv-id is none (its default), and with")


def test_nodes_whose_own_directories_differ_run_one_config():
    from omegaconf import OmegaConf

    from starter.launch.nodes import meeting_config

    node = {"seed": 1, "model": {"lr": 0.1}, "ckpt_path": None}
    first = OmegaConf.create({**node, "paths": {"log_dir": "/node0/logs", "output_dir": "/node0/run"}})
    second = OmegaConf.create({**node, "paths": {"log_dir": "/scratch/logs", "output_dir": "/scratch/run"}})
    assert meeting_config(first) == meeting_config(second)
    assert meeting_config(first) != meeting_config(OmegaConf.merge(second, {"seed": 2}))


def test_ckpt_path_last_names_the_newest_run_for_training_predict_export_and_load_module(tmp_path):
    import os

    from omegaconf import OmegaConf

    from starter.checkpointing.resume import checkpoint_named, resolve_ckpt_path

    runs = tmp_path / "logs" / "train" / "runs"
    for age, name in enumerate(["b-newest", "a-older", "c-oldest"]):  # names that sort otherwise than their times
        checkpoints = runs / name / "checkpoints"
        checkpoints.mkdir(parents=True)
        for entry in (checkpoints / "last.ckpt", checkpoints / "model.pt", checkpoints):
            entry.touch()
            os.utime(entry, (1e9 - age * 1000, 1e9 - age * 1000))
    newest = runs / "b-newest" / "checkpoints"
    assert checkpoint_named("last", tmp_path / "logs") == newest / "model.pt"  # predict.py, export.py, load_module
    paths = {"log_dir": str(tmp_path / "logs"), "output_dir": str(tmp_path / "new")}
    cfg = OmegaConf.create({"ckpt_path": "last", "task_name": "train", "paths": paths})
    assert resolve_ckpt_path(cfg) == newest / "last.ckpt"  # train.py's resume
