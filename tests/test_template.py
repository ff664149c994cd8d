"""This repository as a copier template: a generated project holds its own package (the task, nets and data, renamed
after it) beside the engine (`starter`, as it is), runs its README's commands, quick tests and every mode of its set
with its own copy of the engine; `copier update` brings an engine change without touching the user's files, and
moves a project generated with the engine inside its package to the two packages, keeping the user's edits; with
`examples=minimal` it has none of the larger examples."""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import time
from io import BytesIO

import pytest

from conftest import ROOT

pytest.importorskip("copier", reason="copier is in the dev extra")
pytestmark = pytest.mark.slow
IGNORED = shutil.ignore_patterns(".git", ".venv", "logs", "outputs", "multirun", "*.egg-info", "__pycache__",
                                 ".pytest_cache", ".ruff_cache", ".whl", ".gpu")  # fmt: skip
EXAMPLES = ["full", "minimal"]
PACKAGE = "ourvision"  # the project's package: the template's `mynet` renamed
# The template's own packages are installed in this environment: the project imports its own engine, and the
# template's project package not at all.
OWN_ENGINE = (
    "import os, runpy, sys; sys.modules['mynet'] = None; import starter;"
    " assert starter.__file__.startswith(os.getcwd()), starter.__file__; sys.argv = sys.argv[1:]; "
)


def git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)  # fmt: skip


def copier(cwd, *args) -> str:
    """What copier (and the task it runs) said."""
    proc = subprocess.run([sys.executable, "-m", "copier", *args], cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """The working tree as a template repository at a commit."""
    template = tmp_path_factory.mktemp("template") / "template"
    shutil.copytree(ROOT, template, ignore=IGNORED)
    git(template, "init", "-q")
    git(template, "add", "-A")
    git(template, "commit", "-qm", "template")
    return template


@pytest.fixture(scope="module")
def projects(template, tmp_path_factory) -> dict:
    """{examples: generated project}: one project of each example set, package PACKAGE, every other default."""
    return {examples: generate(template, tmp_path_factory.mktemp(examples), examples) for examples in EXAMPLES}


def generate(template, folder, examples: str, ref: str = "HEAD", package: str = PACKAGE):
    project = folder / f"{package}-project"
    copier(folder, "copy", "--trust", "--vcs-ref", ref, "--defaults", "-d", f"package_name={package}",
           "-d", f"examples={examples}", str(template), str(project))  # fmt: skip
    return project


def in_projects(projects: dict, code: str, *args) -> dict:
    """{examples: finished process} of `python -c code args` in every project at once, the template's package
    blocked."""
    procs = {}
    for examples, project in projects.items():
        env = dict(os.environ, PYTHONPATH=str(project / "src"))
        procs[examples] = subprocess.Popen([sys.executable, "-c", OWN_ENGINE + code, *args], cwd=project, env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    done = {}
    for examples, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        done[examples] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.fixture(scope="module")
def quick_runs(projects) -> dict:
    """{examples: (train run, test run)}: `python train.py debug=fdr` in every multi-process mode the minimal set has
    (one process for the full one), then the whole test suite collected (every test module imported: a left-out
    example still imported fails there) and the config and lint tests run."""
    modes = ["-m", "debug=fdr", "strategy=ddp,ddp_spawn,fsdp,tp,pp", "devices=2", "accelerator=cpu"]
    trains = in_projects(projects, "runpy.run_path('train.py', run_name='__main__')", "train.py", "debug=fdr")
    trains["minimal"] = in_projects({"minimal": projects["minimal"]}, "runpy.run_path('train.py', run_name='__main__')",
                                    "train.py", *modes)["minimal"]  # fmt: skip
    tests = in_projects(projects, "import pytest; sys.exit(pytest.main(sys.argv))", "-q", "-p", "no:cacheprovider",
                        "-m", "not slow", "-k", "test_config.py or test_tooling.py", "tests")  # fmt: skip
    return {examples: (trains[examples], tests[examples]) for examples in EXAMPLES}


def files_mentioning(project, words) -> list[str]:
    found = []
    for path in project.rglob("*"):
        if path.is_file() and path.name != ".copier-answers.yml":  # its template path is wherever the template is
            text = path.read_bytes().decode(errors="ignore").lower()
            found += [f"{path.relative_to(project)}: {w}" for w in words if w in text]
    return found


@pytest.mark.parametrize("examples", EXAMPLES)
def test_the_generated_project_holds_its_package_beside_the_engine_as_it_is(projects, examples):
    project = projects[examples]
    assert (project / "src" / PACKAGE / "models" / "classifier.py").is_file()
    assert not (project / "src" / "mynet").exists()
    engine = [p.relative_to(project / "src") for p in (project / "src" / "starter").rglob("*.py")]
    differ = [str(p) for p in engine if (ROOT / "src" / p).read_bytes() != (project / "src" / p).read_bytes()]
    assert engine and differ == [], differ  # byte for byte: a smaller set leaves out whole files of it, no lines
    assert f'name = "{PACKAGE}"' in (project / "pyproject.toml").read_text()
    assert (project / "README.md").read_text().startswith(f"# {PACKAGE}: a Lightning + Hydra project\n")
    target = f"_target_: {PACKAGE}.models.classifier.Classifier"
    assert target in (project / "conf/model/base/classifier.yaml").read_text()
    assert files_mentioning(project, ["mynet", "full examples"]) == []  # nor the template's markers
    assert not (project / ".copier").exists() and not (project / "copier.yml").exists()
    if examples == "minimal":  # what its user owns, and reads to adapt it
        lines = sum(len(p.read_text().splitlines()) for p in (project / "src" / PACKAGE).rglob("*.py"))
        assert lines <= 1000, lines


def test_a_project_generated_with_the_default_name_keeps_the_package_whole(template, tmp_path):
    # copier's default package name is the template's own: nothing to move, every file of it still there, named as is
    project = generate(template, tmp_path, "full", package="mynet")
    ours = sorted(str(p.relative_to(ROOT / "src" / "mynet")) for p in (ROOT / "src" / "mynet").rglob("*.py"))
    theirs = sorted(str(p.relative_to(project / "src" / "mynet")) for p in (project / "src" / "mynet").rglob("*.py"))
    assert ours and theirs == ours
    assert "_target_: mynet.models.classifier.Classifier" in (project / "conf/model/base/classifier.yaml").read_text()
    assert 'name = "mynet"' in (project / "pyproject.toml").read_text() and not (project / ".copier").exists()


@pytest.mark.parametrize("examples", EXAMPLES)
def test_the_minimal_project_has_none_of_the_larger_examples_and_the_full_one_has_them_all(projects, examples):
    project = projects[examples]
    larger = ["src/starter/data/imagenet.py", f"src/{PACKAGE}/models/nets/torchvision.py", "conf/data/imagenet.yaml",
              "conf/model/resnet50.yaml", "conf/model/vit_s16.yaml", "conf/experiment/imagenet_resnet50.yaml",
              "conf/launcher/slurm.yaml", "tests/test_image_folder.py", "benchmarks/gpu_scaling.py"]  # fmt: skip
    assert [(project / p).exists() for p in larger] == [examples == "full"] * len(larger)
    names = ["data=imagenet", "imagenet_archives", "resnet18", "resnet50", "vit_s16", "launcher=", "submitit",
             "gpu_scaling", "strategy_matrix", "make_shards", "data=shards", "litdata"]  # fmt: skip
    if examples == "minimal":
        assert files_mentioning(project, names) == []
        assert (project / "conf" / "model" / "vit.yaml").is_file() and (
            project / "conf" / "strategy" / "tp.yaml"
        ).is_file()
    else:
        manual = "".join(p.read_text() for p in [project / "README.md", *sorted((project / "docs").glob("*.md"))])
        assert [name for name in names if name not in manual] == []


@pytest.mark.parametrize("examples", EXAMPLES)
def test_the_generated_project_locks_its_own_dependencies_at_the_template_versions(projects, examples):
    import tomllib

    project = projects[examples]
    check = subprocess.run([sys.executable, "-m", "uv", "lock", "--check", "--offline"], cwd=project,
                           capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr[-2000:]  # the lock matches the project's pyproject.toml

    def versions(lock_file):
        return {(p["name"], p.get("version")) for p in tomllib.loads(lock_file.read_text())["package"]}

    ours, template = versions(project / "uv.lock"), versions(ROOT / "uv.lock")
    assert (PACKAGE, "0.1.0") in ours and ("torch", "2.14.1") in ours
    assert ours - {(PACKAGE, "0.1.0")} <= template  # no version moved; minimal only dropped packages
    assert any(name == "submitit" for name, _ in ours) == (examples == "full")


@pytest.mark.parametrize("examples", EXAMPLES)
def test_the_generated_project_trains_and_passes_its_quick_tests_without_the_template_package(quick_runs, examples):
    run, tests = quick_runs[examples]
    assert run.returncode == 0, run.stderr[-3000:]
    if examples == "minimal":  # each mode's job ended with its table
        assert run.stdout.count("run directory: ") == 5, run.stdout[-3000:]
    else:
        assert "run directory: logs/train/runs/" in run.stdout
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert " error" not in tests.stdout and " passed" in tests.stdout


# A user's own data and net, made the defaults: what a project that replaced every example trains.
USERS_OWN = {
    "data/noise.py": """import torch

from starter.data.base import ShardedDataModule


class Noise(ShardedDataModule):
    def setup(self, stage=None):
        if self.train_set is None:
            g = torch.Generator().manual_seed(self.seed)
            sets = [torch.utils.data.TensorDataset(torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=g),
                                                   torch.randint(0, 3, (n,), generator=g)) for n in (96, 32, 32)]
            self.train_set, self.val_set, self.test_set = sets
""",
    "models/nets/linear.py": """from torch import nn


class Linear(nn.Sequential):
    def __init__(self, num_classes: int):
        super().__init__(nn.Flatten(), nn.Linear(64, num_classes))
""",
}
EXAMPLE_FILES = ["data/digits.py", "data/mnist.py", "data/synthetic.py", "data/in_memory.py", "models/nets/mlp.py",
                 "models/nets/cnn.py", "models/nets/vit.py"]  # fmt: skip
EXAMPLE_CONFIGS = ["model/mlp.yaml", "model/cnn.yaml", "model/vit.yaml", "model/timm.yaml", "data/digits.yaml",
                   "data/mnist.yaml", "data/synthetic.yaml", "experiment/mnist_cnn.yaml"]  # fmt: skip


def test_a_project_that_replaced_every_example_runs_the_engines_tests_on_their_own_bed(projects, tmp_path):
    project = tmp_path / "project"
    shutil.copytree(projects["minimal"], project, ignore=shutil.ignore_patterns("logs"))
    package, conf = project / "src" / PACKAGE, project / "conf"
    for name in EXAMPLE_FILES:
        (package / name).unlink()
    for name in EXAMPLE_CONFIGS:
        (conf / name).unlink()
    shutil.rmtree(project / "tests" / "examples")  # the examples' tests go with them
    for name, text in USERS_OWN.items():
        (package / name).write_text(text)
    (conf / "data" / "noise.yaml").write_text(f"_target_: {PACKAGE}.data.noise.Noise\nbatch_size: 32\nseed: ${{seed}}\n"
                                              "num_workers: 0\nimage_shape: [1, 8, 8]\nnum_classes: 3\n")  # fmt: skip
    (conf / "model" / "linear.yaml").write_text("defaults:\n  - base/classifier@_here_\n  - _self_\n\nnet:\n"
                                                f"  _target_: {PACKAGE}.models.nets.linear.Linear\n"
                                                "  num_classes: ${data.num_classes}\n")  # fmt: skip
    train_yaml = conf / "train.yaml"
    train_yaml.write_text(train_yaml.read_text().replace("  - data: digits\n", "  - data: noise\n")
                          .replace("  - model: mlp\n", "  - model: linear\n"))  # fmt: skip
    done = in_projects({"own": project}, "runpy.run_path('train.py', run_name='__main__')", "train.py", "debug=fdr")
    assert done["own"].returncode == 0, done["own"].stderr[-3000:]
    # every test module still imports (collected: none left out), and the engine's tests run on their bed: the data
    # tests, and a short training of the bed's MLP on its digits, tested and evaluated again from best.ckpt
    collected = in_projects({"own": project}, "import pytest; sys.exit(pytest.main(sys.argv))", "-q",
                            "--collect-only", "-p", "no:cacheprovider", "tests")["own"]  # fmt: skip
    assert collected.returncode == 0 and " error" not in collected.stdout, collected.stdout[-3000:]
    trained = "tests/test_recipe.py::test_ema_weights_are_the_ones_validated_tested_and_exported"
    tests = in_projects({"own": project}, "import pytest; sys.exit(pytest.main(sys.argv))", "-q", "-p",
                        "no:cacheprovider", "-m", "not slow", "tests/test_data.py", trained)["own"]  # fmt: skip
    assert tests.returncode == 0 and " passed" in tests.stdout, tests.stdout[-3000:]


def committed(folder) -> None:
    git(folder, "init", "-q")
    git(folder, "add", "-A")
    git(folder, "commit", "-qm", "generated")


def contents(folder, *parts: str) -> dict:
    """{path: sha256} of every file under `folder`'s `parts`."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for part in parts
            for p in sorted((folder / part).rglob("*")) if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip


def test_copier_update_brings_an_engine_change_and_touches_nothing_of_the_users(template, projects, tmp_path):
    project = tmp_path / "project"  # the minimal one: the examples it left out must stay out
    shutil.copytree(projects["minimal"], project, ignore=shutil.ignore_patterns("logs"))
    # the user's own net (a CamelCase class, names that hold the template's package name), an edit of theirs in a
    # file of the template's, and files git ignores: a run's and the data's
    nets = project / "src" / PACKAGE / "models" / "nets"
    (nets / "mine.py").write_text("class MyNet:  # mynet_utils, MYNET, and mynet itself: the user's words\n    pass\n")
    mlp = (nets / "mlp.py").read_text()
    (nets / "mlp.py").write_text(mlp + "\n\nclass MyNetMLP(MLP):  # mynet's, MyNet's\n    pass\n")
    ignored = {"logs/train/runs/x/config.yaml": f"_target_: {PACKAGE}.models.nets.mine.MyNet  # mynet\n",
               "data/notes.txt": "mynet, MyNet\n"}  # fmt: skip
    for name, text in ignored.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    dropped = project / "docs" / "performance.md"  # a page the user added to, which the template then drops
    dropped.write_text(dropped.read_text() + "our own figures\n")
    committed(project)
    users = ("src/" + PACKAGE, "conf/model", "conf/data", "conf/experiment", "tests")
    before = contents(project, *users)
    with open(template / "src" / "starter" / "__init__.py", "a") as f:
        f.write("TEMPLATE_CHANGE = 1\n")
    git(template, "rm", "-q", "docs/performance.md")
    git(template, "commit", "-qam", "a later change of the engine")
    started = time.monotonic()
    said = copier(project, "update", "--trust", "--defaults", "--vcs-ref", "HEAD")
    print(f"copier update of an engine change: {time.monotonic() - started:.1f} s")  # docs/template.md's figure
    assert "the template no longer has docs/performance.md; your edited copy is kept as docs/performance.md.yours" in (
        said
    )
    assert dropped.with_suffix(".md.yours").read_text().endswith("our own figures\n") and not dropped.exists()
    assert "TEMPLATE_CHANGE = 1" in (project / "src" / "starter" / "__init__.py").read_text()
    assert contents(project, *users) == before  # no file of the user's changed, none added
    assert {name: (project / name).read_text() for name in ignored} == ignored  # what git ignores, untouched
    status = subprocess.run(["git", "status", "--porcelain"], cwd=project, capture_output=True, text=True).stdout
    changed = sorted(line.split()[-1] for line in status.splitlines())
    assert changed == [".copier-answers.yml", "docs/performance.md", "docs/performance.md.yours",
                       "src/starter/__init__.py"], status  # fmt: skip
    assert not (project / "src" / "starter" / "data" / "imagenet.py").exists()  # minimal stays minimal
    assert not (project / "conf" / "launcher").exists()


def test_an_update_reads_the_last_version_from_the_answers_as_copier_wrote_them_quoted_or_not():
    # copier writes YAML: a short hash of digits only is quoted, which once lost the dropped files' edits (1 in 27)
    spec = importlib.util.spec_from_file_location("make_project", ROOT / ".copier" / "make_project.py")
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    assert task.last_commit(b"_commit: '7408061'\n_src_path: /t\n") == "7408061"
    assert task.last_commit(b"_commit: 5f1e07f\n") == "5f1e07f"
    assert task.last_commit(b"_commit: v1.2.0-3-g5f1e07f\n") == "v1.2.0-3-g5f1e07f"
    assert task.last_commit(b"_src_path: /t\n") is None and task.last_commit(b"") is None
    assert task.last_commit(b"_commit: --upload-pack=x\n") is None  # a ref, never an option to git


def old_layout_commit() -> str | None:
    """The last commit of this repository whose project held the engine inside its package (before src/mynet)."""
    added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "src/mynet/models/classifier.py"],
                           cwd=ROOT, capture_output=True, text=True).stdout.split()  # fmt: skip
    return f"{added[-1]}^" if added else None


def test_a_project_generated_with_the_engine_in_its_package_updates_to_the_two_keeping_the_users_edits(tmp_path):
    old = old_layout_commit()
    if old is None:
        pytest.skip("this checkout has no history of the layout before the two packages (a shallow clone)")
    template = tmp_path / "template"  # its history: the old layout, then this working tree
    archive = subprocess.run(["git", "archive", old], cwd=ROOT, capture_output=True, check=True).stdout
    tarfile.open(fileobj=BytesIO(archive)).extractall(template, filter="data")
    git(template, "init", "-q")
    git(template, "add", "-A")
    git(template, "commit", "-qm", "the old layout")
    project = generate(template, tmp_path, "minimal")
    assert (project / "src" / PACKAGE / "launch" / "watchdog.py").is_file()  # the engine inside the user's package
    classifier = project / "src" / PACKAGE / "models" / "classifier.py"
    classifier.write_text(classifier.read_text() + "\nUSERS_OWN = 1  # the user's edit\n")
    progress = project / "src" / PACKAGE / "callbacks" / "progress.py"  # an engine file, in the old layout the user's
    progress.write_text(progress.read_text() + "\nUSERS_ENGINE_EDIT = 1\n")
    mlp = project / "conf" / "model" / "mlp.yaml"
    mlp.write_text(mlp.read_text().replace("width: 256", "width: 128"))
    committed(project)
    shutil.rmtree(template / "src")
    shutil.copytree(ROOT, template, ignore=IGNORED, dirs_exist_ok=True)
    git(template, "add", "-A")
    git(template, "commit", "-qm", "two packages")
    said = copier(project, "update", "--trust", "--defaults", "--vcs-ref", "HEAD")
    assert "USERS_OWN = 1" in classifier.read_text() and "width: 128" in mlp.read_text()  # the user's edits, kept
    # copier deletes the old engine files, edited or not: the task carried the edit to where the engine is now
    assert "USERS_ENGINE_EDIT = 1" in (project / "src" / "starter" / "callbacks" / "progress.py").read_text()
    assert (f"your edit of src/{PACKAGE}/callbacks/progress.py is carried to src/starter/callbacks/progress.py, where"
            " the engine has it now: merged cleanly") in said  # fmt: skip
    assert not (project / "src" / PACKAGE / "launch").exists() and (project / "src" / "starter" / "run.py").is_file()
    assert files_mentioning(project, ["<<<<<<<", ">>>>>>>"]) == [] and not list(project.rglob("*.rej"))
    run = in_projects({"updated": project}, "runpy.run_path('train.py', run_name='__main__')", "train.py",
                      "debug=fdr")["updated"]  # fmt: skip
    assert run.returncode == 0 and "width: 128" in next(project.glob("logs/train/runs/*/config.yaml")).read_text(), (
        run.stderr[-3000:]
    )
