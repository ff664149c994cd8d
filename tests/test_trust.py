"""Every file the starter reads may be someone else's, the files the frameworks read and write for it included: a path a
file or a restored state names is used only inside its run, a run or sweep directory to continue is a real tree, a
moved run continues in place, a sweep's files supply values only, and a value is checked for what it means. Each
hostile file is made with the library's own writer (torch.save, OmegaConf, Optuna)."""

import csv
import json
import os
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config, predict, read_metrics, run_dirs, train

TWO_EPOCHS = ["debug=limit", "trainer.max_epochs=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short run: its directory, to copy and tamper with."""
    tmp_path = tmp_path_factory.mktemp("run")
    train(tmp_path, *TWO_EPOCHS)
    (run_dir,) = run_dirs(tmp_path)
    return run_dir


def copy_of(run, tmp_path, name="theirs"):
    copied = tmp_path / name
    shutil.copytree(run, copied, symlinks=True)
    return copied


def tamper(checkpoint, change) -> None:
    """`change(saved)` on a checkpoint's contents, saved again with torch.save."""
    saved = torch.load(checkpoint, weights_only=True)
    change(saved)
    torch.save(saved, checkpoint)


def callback_state(saved: dict, name: str) -> dict:
    (key,) = [key for key in saved["callbacks"] if key.startswith(name)]
    return saved["callbacks"][key]


def error_line(proc) -> str:
    """The one line a refused run says (exit 2, no traceback)."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    return line


def test_a_checkpoint_naming_a_path_outside_its_run_deletes_nothing_there_and_says_so(run, tmp_path):
    theirs, kept = copy_of(run, tmp_path), tmp_path / "x"
    kept.mkdir()
    (kept / "precious").write_text("mine\n")
    outside = f"{theirs}/checkpoints/../../x"  # Lightning's own test compares this text with its folder's

    def point_outside(saved):
        for name in ("BestCheckpoint", "RunCheckpoint"):
            state = callback_state(saved, name)
            state |= {"best_model_path": outside, "kth_best_model_path": outside, "best_k_models": {outside: 2.0}}

    tamper(theirs / "checkpoints" / "last.ckpt", point_outside)
    proc = train(tmp_path, "ckpt_path=auto", f"hydra.run.dir={theirs}", "debug=limit", "trainer.max_epochs=4")
    assert (kept / "precious").read_text() == "mine\n"
    said = f"RunCheckpoint state's best_model_path names {outside}, outside {theirs}/checkpoints: dropped"
    assert said in proc.stdout
    # the run tests its own best checkpoint, never a file the checkpoint chose
    assert "testing checkpoints/best.ckpt" in proc.stdout and "test/acc" in read_metrics(theirs)
    assert sorted(p.name for p in (theirs / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt", "model.pt"]


def test_a_copied_run_directory_continues_in_place_saving_last_and_best_again(run, tmp_path):
    copied = copy_of(run, tmp_path, "B")
    before = torch.load(copied / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    proc = train(tmp_path, "ckpt_path=auto", f"hydra.run.dir={copied}", "debug=limit", "trainer.max_epochs=3")
    assert sorted(p.name for p in (copied / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt", "model.pt"]
    assert torch.load(copied / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] > before
    assert "dropped" not in proc.stdout  # its own files, named relative to its folder


def test_a_checkpoint_whose_kth_best_lies_outside_its_run_continues_from_the_best_it_keeps(run, tmp_path):
    theirs, outside = copy_of(run, tmp_path), str(tmp_path / "x.ckpt")

    def kth_outside(saved):  # its k-th best (the one a better one replaces) outside, beside one of its own
        state = callback_state(saved, "BestCheckpoint")
        state |= {"kth_best_model_path": outside, "best_k_models": {outside: 0.0, "best.ckpt": state["kth_value"]}}

    tamper(theirs / "checkpoints" / "last.ckpt", kth_outside)
    train(tmp_path, "ckpt_path=auto", f"hydra.run.dir={theirs}", "debug=limit", "trainer.max_epochs=3")
    assert torch.load(theirs / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 2


@pytest.mark.parametrize("name,made", [("metrics.csv", "bytes"), ("metrics.csv", "another header"),
                                       ("train.log", "a folder"), ("metrics.json", "a folder"),
                                       ("learning_curves.png", "a folder")])  # fmt: skip
def test_a_file_of_a_run_directory_to_continue_that_no_run_wrote_is_one_line_before_training(name, made, run, tmp_path):
    theirs = copy_of(run, tmp_path)
    last, entry = theirs / "checkpoints" / "last.ckpt", theirs / name
    before = last.stat().st_mtime_ns
    entry.unlink()
    if made == "a folder":
        entry.mkdir()
        said = f"error: {entry} is not a file, and the run writes one there; a run directory to continue holds what a"
    elif made == "bytes":
        entry.write_bytes(bytes(range(256)))
        said = f"error: hydra.run.dir={theirs}: its metrics.csv is malformed ("
    else:
        with open(entry, "w", newline="") as f:
            csv.writer(f).writerows([["loss", "when"], ["0.5", "yesterday"]])
        said = f"error: hydra.run.dir={theirs}: its metrics.csv is malformed ("
    proc = train(tmp_path, "ckpt_path=auto", f"hydra.run.dir={theirs}", *TWO_EPOCHS, expect_ok=False)
    assert error_line(proc).startswith(said), error_line(proc)
    assert last.stat().st_mtime_ns == before  # nothing trained, nothing saved


@pytest.mark.parametrize("entry", ["checkpoints", "checkpoints/old.ckpt", ".hydra/config.yaml", ".hydra/hydra.yaml"])
def test_a_run_directory_holding_a_symlink_is_refused_before_anything_is_written_or_read(run, entry, tmp_path):
    theirs, elsewhere = copy_of(run, tmp_path), tmp_path / "elsewhere"
    shutil.copytree(run / "checkpoints", elsewhere) if entry == "checkpoints" else elsewhere.write_text("theirs\n")
    link = theirs / entry
    shutil.rmtree(link) if link.is_dir() else link.unlink(missing_ok=True)
    link.symlink_to(elsewhere)
    before = {p: p.stat().st_mtime_ns for p in [elsewhere, *elsewhere.rglob("*")]}
    proc = train(tmp_path, "ckpt_path=auto", f"hydra.run.dir={theirs}", expect_ok=False)
    assert error_line(proc) == (
        f"error: {link} is a symlink; a run or sweep directory to continue holds none: give another one"
    )
    assert {p: p.stat().st_mtime_ns for p in [elsewhere, *elsewhere.rglob("*")]} == before


def test_a_file_the_run_writes_replaces_a_symlink_at_its_name_and_never_follows_it(tmp_path):
    from starter.atomic_write import replacing, unlink_symlink

    target, written, appended = tmp_path / "theirs", tmp_path / "metrics.json", tmp_path / "train.log"
    target.write_text("theirs\n")
    written.symlink_to(target)
    appended.symlink_to(target)
    with replacing(written) as file:
        file.write("mine\n")
    unlink_symlink(appended)  # a file the run appends to starts anew
    assert target.read_text() == "theirs\n" and written.read_text() == "mine\n" and not appended.exists()


def test_removing_a_checkpoint_never_follows_a_symlink_out_of_its_folder(tmp_path):
    from starter.checkpointing.sharded import remove_saved

    folder, elsewhere = tmp_path / "checkpoints", tmp_path / "elsewhere"
    (folder / "best.ckpt.1").mkdir(parents=True)
    elsewhere.mkdir()
    (folder / "best.ckpt").symlink_to("best.ckpt.1")  # a sharded checkpoint's name: it goes with its directory
    (folder / "old.ckpt").symlink_to(elsewhere)  # anything else: the link goes, its target stays
    remove_saved(folder / "best.ckpt")
    remove_saved(folder / "old.ckpt")
    assert list(folder.iterdir()) == [] and elsewhere.is_dir()


@pytest.mark.parametrize(
    "callback,state,said",
    [
        ("RandomState", {"places": [5]}, "its RandomState state is malformed (TypeError:"),
        ("MidEpochResume", {"world": "two"}, "its MidEpochResume state is malformed (ValueError: world='two'"),
        ("BestCheckpoint", {"best_k_models": [1]}, "its BestCheckpoint state is malformed (AttributeError:"),
    ],
)
def test_a_malformed_callback_state_is_one_line_naming_the_checkpoint(run, callback, state, said, tmp_path):
    checkpoint = tmp_path / "last.ckpt"
    shutil.copy(run / "checkpoints" / "last.ckpt", checkpoint)
    tamper(checkpoint, lambda saved: callback_state(saved, callback).update(state))
    proc = train(tmp_path, f"ckpt_path={checkpoint}", *TWO_EPOCHS[:1], "trainer.max_epochs=3", expect_ok=False)
    assert error_line(proc).startswith(f"error: ckpt_path={checkpoint}: {said}")


def test_a_checkpoint_saved_before_layout_places_resumes_its_generators_in_one_process(run, tmp_path):
    checkpoint = tmp_path / "last.ckpt"
    shutil.copy(run / "checkpoints" / "last.ckpt", checkpoint)
    tamper(checkpoint, lambda saved: callback_state(saved, "RandomState").pop("places"))
    proc = train(tmp_path, f"ckpt_path={checkpoint}", *TWO_EPOCHS[:1], "trainer.max_epochs=3", "verbose=true")
    assert "random generators" not in proc.stdout


@pytest.mark.parametrize(
    "config,said",
    [({"model": 5}, "model or strategy.name is malformed"), ({"strategy": None}, "model or strategy.name is")],
)
def test_a_malformed_config_beside_a_checkpoint_is_one_line(run, config, said, tmp_path):
    theirs = copy_of(run, tmp_path)
    saved = OmegaConf.load(theirs / "config.yaml")
    OmegaConf.save(OmegaConf.merge(saved, config) if "model" in config else {**saved, **config}, theirs / "config.yaml")
    checkpoint = theirs / "checkpoints" / "last.ckpt"
    proc = train(tmp_path, f"ckpt_path={checkpoint}", expect_ok=False)
    assert error_line(proc).startswith(f"error: the config beside ckpt_path={theirs / 'config.yaml'}: its {said}")


def record_changed(run, tmp_path, change):
    path = tmp_path / "model.pt"
    shutil.copy(run / "checkpoints" / "model.pt", path)
    tamper(path, lambda saved: change(saved["inference"]))
    return path


@pytest.mark.parametrize(
    "change,said",
    [
        (lambda r: r.update(mean=[float("nan")]), "its inference record is malformed (mean, std and value_range are"),
        (lambda r: r.update(std=[0.0]), "its inference record is malformed (mean, std and value_range are"),
        (lambda r: r.update(image_shape=[1, 2**20, 2**20]), "its inference record is malformed (image_shape is no"),
        (lambda r: r.update(classes=["0", "1"]), "its inference record names 2 classes, its net gives 10 logits"),
        (lambda r: r.update(classes=[f"c{i}\x1b" for i in range(10)]), "(classes are not names of plain text)"),
        (lambda r: r["model"]["net"].update(in_shape="abc"), "its inference record's model does not take its"),
        (lambda r: r["model"]["net"].update(in_shape=[1, 2**20, 2**20]), "its weights do not fit the model it names"),
        (lambda r: r["model"]["net"].update(num_classes=-1), "its inference record's model does not take its"),
        (lambda r: r.pop("std"), "its run's DataModule recorded no std"),
    ],
)
def test_a_record_value_that_means_nothing_is_refused_in_one_line_before_a_prediction(run, change, said, tmp_path):
    path = record_changed(run, tmp_path, change)
    proc = predict(tmp_path, f"ckpt_path={path}", f"inputs={run / 'config.yaml'}", expect_ok=False)
    assert said in error_line(proc) and error_line(proc).startswith(f"error: ckpt_path={path}")


def test_class_names_reach_the_predictions_as_text_never_a_formula(run, digit_files, tmp_path):
    formula = '=HYPERLINK("http://example.com","click")'
    path = record_changed(run, tmp_path, lambda r: r.update(classes=[formula, *r["classes"][1:]]))
    proc = predict(tmp_path, f"ckpt_path={path}", f"inputs={digit_files}")
    (out,) = (tmp_path / "logs" / "predict" / "runs").glob("*/predictions.csv")
    with open(out, newline="") as f:
        cells = [cell for row in csv.reader(f) for cell in row]
    assert f"'{formula}" in cells and not any(cell.startswith("=") for cell in cells), proc.stdout


@pytest.mark.parametrize("prefix", ["=", "+", "-", "@", "\t", "\r"])
def test_every_csv_the_starter_writes_shows_a_cell_that_would_start_a_formula_as_text(prefix, tmp_path):
    # predictions.csv (a record's class names, the input paths) and a sweep's summary.csv (overrides, the metric's
    # name, job directories): whatever text a file or a user gave, a spreadsheet opening them runs nothing
    from starter.loggers.sweep_summary import write_summary
    from starter.predict import write_predictions

    formula = f'{prefix}HYPERLINK("http://example.com","click")'
    classes = [formula, *"abcdef"]  # more than 5: the top-5 column too
    write_predictions(tmp_path / "predictions.csv", [(0, [0, 1, 2, 3, 4], [0.5] * 5)], [formula], classes)
    row = {"job": 0, "overrides": formula, "value": -0.5, "best": True, "run_dir": formula}
    write_summary(tmp_path / "summary.csv", [row], monitor=formula)
    for written in ("predictions.csv", "summary.csv"):
        with open(tmp_path / written, newline="") as f:
            cells = [cell for line in csv.reader(f) for cell in line if "HYPERLINK" in cell]
        assert len(cells) == 3 and all(cell.startswith(f"'{prefix}") for cell in cells), (written, cells)


def test_a_train_false_test_of_weights_whose_head_does_not_fit_is_refused(run, tmp_path):
    proc = train(tmp_path, "train=false", f"init_from={run / 'checkpoints' / 'model.pt'}", "data.num_classes=5",
                 expect_ok=False)  # fmt: skip
    said = "its head (net.5) has 10 outputs, this model 5 classes; train=false tests the weights given"
    assert said in error_line(proc)  # a random head's accuracy is no test of the weights


# a sweep directory handed over


def sweep_config(tmp_path, *overrides):
    sweep = f"hydra.sweep.dir={tmp_path / 'sweep'}"
    return compose_config(["hparams_search=optuna", sweep, *overrides], tmp_path / "run", keep_hydra=True)


def test_a_sweep_summary_takes_values_from_job_files_never_resolving_them(tmp_path, capsys, monkeypatch):
    from starter.loggers.sweep_summary import SweepSummary

    monkeypatch.setenv("SECRET", "the-users-secret")
    cfg = sweep_config(tmp_path)
    for job, value in enumerate([0.5, 0.7]):
        folder = tmp_path / "sweep" / str(job)
        (folder / ".hydra").mkdir(parents=True)
        OmegaConf.save({"monitor": "${oc.env:SECRET}", "monitor_mode": "max"}, folder / "config.yaml")
        OmegaConf.save(["seed=${oc.env:SECRET}", f"seed={job}"], folder / ".hydra" / "overrides.yaml")
        (folder / "metrics.json").write_text(json.dumps({"val/acc": value, "${oc.env:SECRET}": 1}))
    SweepSummary().on_multirun_end(cfg)
    shown = capsys.readouterr().out + (tmp_path / "sweep" / "summary.csv").read_text()
    assert "the-users-secret" not in shown and "sweep of 2 job(s) by val/acc, the highest marked *" in shown
    assert "* job 1" in shown


def test_a_sweep_directory_whose_journal_is_a_symlink_is_refused_before_a_job(tmp_path):
    from hydra_plugins.optuna_journal_sweeper.sweeper import check_journal

    sweep, target = tmp_path / "sweep", tmp_path / "elsewhere.journal"
    sweep.mkdir()
    (sweep / "optuna.journal").symlink_to(target)
    proc = train(tmp_path, "-m", "hparams_search=optuna", f"hydra.sweep.dir={sweep}", expect_ok=False)
    assert error_line(proc) == (
        f"error: {sweep / 'optuna.journal'} is a symlink; a run or sweep directory to continue holds none: give"
        " another one"
    )
    assert not target.exists() and not [p for p in sweep.iterdir() if p.name != "optuna.journal"]
    with pytest.raises(SystemExit):  # the sweeper's own check, for a journal given as storage
        check_journal(sweep / "optuna.journal")


def test_a_journal_lock_that_leads_outside_its_sweep_is_refused_and_a_live_ones_is_left_to_optuna(tmp_path):
    sweep, target = tmp_path / "sweep", tmp_path / "elsewhere.journal"
    sweep.mkdir()
    (sweep / "optuna.journal.lock").symlink_to(target)  # not the lock Optuna makes: it leads outside
    proc = train(tmp_path, "-m", "hparams_search=optuna", f"hydra.sweep.dir={sweep}", expect_ok=False)
    assert error_line(proc).startswith(f"error: {sweep / 'optuna.journal.lock'} is a symlink;")
    from optuna.storages.journal import JournalFileSymlinkLock

    from starter.run_directory import check_real_tree

    (sweep / "optuna.journal.lock").unlink()
    (sweep / "optuna.journal").write_text("")  # just written: a live sweep's lock
    JournalFileSymlinkLock(str(sweep / "optuna.journal")).acquire()
    check_real_tree(sweep)
    assert (sweep / "optuna.journal.lock").is_symlink()


def test_a_journal_whose_study_goes_the_other_way_is_refused_in_one_line(tmp_path):
    import optuna

    from hydra_plugins.optuna_journal_sweeper.sweeper import open_storage

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    optuna.create_study(study_name="sweep", storage=open_storage(f"journal:{sweep / 'optuna.journal'}"),
                        direction="minimize")  # fmt: skip
    proc = train(tmp_path, "-m", "hparams_search=optuna", f"hydra.sweep.dir={sweep}", expect_ok=False)
    assert error_line(proc).startswith(
        f"error: {sweep / 'optuna.journal'}: its study is to minimize, this sweep's direction is to maximize;"
    )


def test_a_searched_string_reaches_the_job_as_the_text_searched_and_a_plus_key_is_added(tmp_path):
    from hydra_plugins.optuna_journal_sweeper.sweeper import hydra_value, search_space
    from starter.main import save_resolved

    searched, _ = search_space({}, ["+extra=choice('${oc.env:HOME}',b)"])
    assert list(searched) == ["+extra"]
    override = f"+extra={hydra_value('${oc.env:HOME}')}"  # what the sweeper hands the job
    cfg = compose_config([override], tmp_path / "run")
    assert cfg.extra == "${oc.env:HOME}"
    saved = OmegaConf.load(save_resolved(cfg, tmp_path / "config.yaml"))
    assert saved.extra == "${oc.env:HOME}"  # the workers read the text, not this machine's HOME


# full examples: begin
def test_a_record_asking_for_torchvisions_weights_builds_without_them(tmp_path, monkeypatch):
    import torch.hub
    from test_trained_model import weights_file

    from starter import load_module

    asked = []
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", lambda url, *a, **k: asked.append(url))
    path = weights_file(tmp_path, "resnet18")
    tamper(path, lambda saved: saved["inference"]["model"]["net"].update(weights="IMAGENET1K_V1"))
    load_module(path)
    assert asked == []


# full examples: end
def test_checkpoint_every_n_steps_below_one_is_refused(tmp_path):
    proc = train(tmp_path, "checkpoint_every_n_steps=0", expect_ok=False)
    assert "checkpoint_every_n_steps" in error_line(proc)


def test_every_path_a_file_names_is_used_only_inside_the_folder_given(tmp_path):
    from starter.untrusted import inside

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "link").symlink_to(tmp_path)
    assert inside("best.ckpt", folder, "x") == str(folder / "best.ckpt")
    assert inside(str(folder / "a" / ".." / "best.ckpt"), folder, "x") == str(folder / "best.ckpt")
    for outside in ("../x", str(tmp_path / "x"), "link/x", ".", ""):
        assert inside(outside, folder, "x") == ""
    assert os.path.isdir(tmp_path)
