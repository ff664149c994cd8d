"""This repository as a copier template: a generated project has its own package everywhere, runs its README's
commands and quick tests without the template's package, and `copier update` brings a later template change;
with `examples=minimal` it has none of the larger examples."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("copier", reason="copier is in the dev extra")
pytestmark = pytest.mark.slow
IGNORED = shutil.ignore_patterns(".git", ".venv", "logs", "outputs", "multirun", "*.egg-info", "__pycache__",
                                 ".pytest_cache", ".ruff_cache", ".whl", ".gpu")  # fmt: skip
# The template's own package is installed in this environment: any import of it must fail in the project.
EXAMPLES = ["full", "minimal"]
WITHOUT_STARTER = "import runpy, sys; sys.modules['starter'] = None; sys.argv = sys.argv[1:]; "


def git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)  # fmt: skip


def copier(cwd, *args):
    proc = subprocess.run([sys.executable, "-m", "copier", *args], cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


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
    """{examples: generated project}: one project of each example set, package `mynet`, every other default."""
    made = {}
    for examples in EXAMPLES:
        made[examples] = tmp_path_factory.mktemp(examples) / "mynet-project"
        copier(made[examples].parent, "copy", "--trust", "--vcs-ref", "HEAD", "--defaults", "-d", "package_name=mynet",
               "-d", f"examples={examples}", str(template), str(made[examples]))  # fmt: skip
    return made


def in_projects(projects: dict, code: str, *args) -> dict:
    """{examples: finished process} of `python -c code args` in every project at once, the template's package
    blocked."""
    procs = {}
    for examples, project in projects.items():
        env = dict(os.environ, PYTHONPATH=str(project / "src"))
        procs[examples] = subprocess.Popen([sys.executable, "-c", WITHOUT_STARTER + code, *args], cwd=project, env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    done = {}
    for examples, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        done[examples] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.fixture(scope="module")
def quick_runs(projects) -> dict:
    """{examples: (train run, test run)}: `python train.py debug=fdr`, then the whole test suite collected (every
    test module imported: a left-out example still imported fails there) and the config and lint tests run."""
    trains = in_projects(projects, "runpy.run_path('train.py', run_name='__main__')", "train.py", "debug=fdr")
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
def test_the_generated_project_is_named_after_its_package_everywhere(projects, examples):
    project = projects[examples]
    assert (project / "src" / "mynet" / "run.py").is_file() and not (project / "src" / "starter").exists()
    assert 'name = "mynet"' in (project / "pyproject.toml").read_text()
    assert (project / "README.md").read_text().startswith("# mynet: a Lightning + Hydra project\n")
    assert "_target_: mynet.models.classifier.Classifier" in (project / "conf/model/base/classifier.yaml").read_text()
    assert files_mentioning(project, ["starter", "full examples"]) == []  # nor the template's markers
    assert not (project / ".copier").exists() and not (project / "copier.yml").exists()


@pytest.mark.parametrize("examples", EXAMPLES)
def test_the_minimal_project_has_none_of_the_larger_examples_and_the_full_one_has_them_all(projects, examples):
    project = projects[examples]
    larger = ["src/mynet/data/imagenet.py", "src/mynet/models/nets/torchvision.py", "conf/data/imagenet.yaml",
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
    assert ("mynet", "0.1.0") in ours and ("torch", "2.14.1") in ours
    assert ours - {("mynet", "0.1.0")} <= template  # no version moved; minimal only dropped packages
    assert any(name == "submitit" for name, _ in ours) == (examples == "full")


@pytest.mark.parametrize("examples", EXAMPLES)
def test_the_generated_project_trains_and_passes_its_quick_tests_without_the_template_package(quick_runs, examples):
    run, tests = quick_runs[examples]
    assert run.returncode == 0, run.stderr[-3000:]
    assert "run directory: logs/train/runs/" in run.stdout
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert " error" not in tests.stdout and " passed" in tests.stdout


def test_copier_update_brings_a_later_template_change_into_the_renamed_package(template, projects, tmp_path):
    project = tmp_path / "project"  # the minimal one: the examples it left out must stay out
    shutil.copytree(projects["minimal"], project, ignore=shutil.ignore_patterns("logs"))
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "generated")
    with open(template / "src" / "starter" / "__init__.py", "a") as f:
        f.write("TEMPLATE_CHANGE = 1\n")
    git(template, "commit", "-qam", "a later template change")
    copier(project, "update", "--trust", "--defaults", "--vcs-ref", "HEAD")
    assert "TEMPLATE_CHANGE = 1" in (project / "src" / "mynet" / "__init__.py").read_text()
    assert not (project / "src" / "starter").exists() and not (project / "src" / "mynet" / "starter").exists()
    assert (
        not (project / "src" / "mynet" / "data" / "imagenet.py").exists()
        and not (project / "conf" / "launcher").exists()
    )
    assert "full examples" not in (project / "README.md").read_text()
