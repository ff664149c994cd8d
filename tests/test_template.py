"""This repository as a copier template: a generated project has its own package everywhere, runs its README's
commands and quick tests without the template's package, and `copier update` brings a later template change."""

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
WITHOUT_STARTER = "import runpy, sys; sys.modules['starter'] = None; sys.argv = sys.argv[1:]; "


def git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)  # fmt: skip


def copier(cwd, *args):
    proc = subprocess.run([sys.executable, "-m", "copier", *args], cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(template repository, generated project): the working tree as a template at a commit, a project from it."""
    tmp = tmp_path_factory.mktemp("template")
    template, project = tmp / "template", tmp / "mynet-project"
    shutil.copytree(ROOT, template, ignore=IGNORED)
    git(template, "init", "-q")
    git(template, "add", "-A")
    git(template, "commit", "-qm", "template")
    copier(tmp, "copy", "--trust", "--vcs-ref", "HEAD", "--defaults", "-d", "package_name=mynet", str(template),
           str(project))  # fmt: skip
    return template, project


def in_project(project, code: str, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(project / "src"))
    return subprocess.run([sys.executable, "-c", WITHOUT_STARTER + code, *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_the_generated_project_is_named_after_its_package_everywhere(made):
    _, project = made
    assert (project / "src" / "mynet" / "run.py").is_file() and not (project / "src" / "starter").exists()
    assert 'name = "mynet"' in (project / "pyproject.toml").read_text()
    assert (project / "README.md").read_text().startswith("# mynet: a Lightning + Hydra project\n")
    assert "_target_: mynet.models.classifier.Classifier" in (project / "conf" / "model" / "mlp.yaml").read_text()
    left = []
    for path in project.rglob("*"):
        if path.is_file() and path.name != ".copier-answers.yml":  # its template path is wherever the template is
            text = path.read_bytes().decode(errors="ignore")
            left += [str(path.relative_to(project))] if "starter" in text.lower() else []
    assert left == []
    assert not (project / ".copier").exists() and not (project / "copier.yml").exists()


def test_the_generated_project_trains_and_passes_its_quick_tests_without_the_template_package(made):
    _, project = made
    run = in_project(project, "runpy.run_path('train.py', run_name='__main__')", "train.py", "debug=fdr")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "mynet.report" in run.stderr + run.stdout and list(project.glob("logs/train/runs/*/metrics.json"))
    tests = in_project(project, "import pytest; sys.exit(pytest.main(sys.argv))", "-q", "-p", "no:cacheprovider",
                       "-m", "not slow", "tests/test_config.py")  # fmt: skip
    assert tests.returncode == 0, tests.stdout[-3000:]


def test_copier_update_brings_a_later_template_change_into_the_renamed_package(made, tmp_path):
    template, made_project = made
    project = tmp_path / "project"
    shutil.copytree(made_project, project, ignore=shutil.ignore_patterns("logs"))
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "generated")
    with open(template / "src" / "starter" / "__init__.py", "a") as f:
        f.write("TEMPLATE_CHANGE = 1\n")
    git(template, "commit", "-qam", "a later template change")
    copier(project, "update", "--trust", "--defaults", "--vcs-ref", "HEAD")
    assert "TEMPLATE_CHANGE = 1" in (project / "src" / "mynet" / "__init__.py").read_text()
    assert not (project / "src" / "starter").exists() and not (project / "src" / "mynet" / "starter").exists()
