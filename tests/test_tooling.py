"""The tooling a project made from this starter inherits: its lint passes here, its CI workflow and pre-commit
hooks are valid and run what the README says."""

import subprocess
import sys

import yaml

from conftest import ROOT


def test_the_code_base_passes_its_own_lint_and_format_check():
    for command in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_the_github_workflow_runs_lint_and_tests_on_push_with_uv_s_cache_keyed_on_the_lock():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "test.yml").read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert "push" in triggers and "pull_request" in triggers
    steps = workflow["jobs"]["test"]["steps"]
    cache = next(s for s in steps if s.get("uses", "").startswith("actions/cache"))
    assert cache["with"]["path"] == "~/.cache/uv" and "hashFiles('uv.lock')" in cache["with"]["key"]
    assert [s["run"] for s in steps if "run" in s] == ["make lint", "make test"]


def test_make_install_installs_exactly_the_lock_and_refuses_one_that_no_longer_matches_pyproject(tmp_path):
    import shutil

    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copy(ROOT / "uv.lock", tmp_path)
    uv = [sys.executable, "-m", "uv", "lock", "--check", "--offline"]
    assert subprocess.run(uv, cwd=tmp_path, capture_output=True).returncode == 0  # as committed: in step
    assert "$(UV) sync --quiet --locked" in (ROOT / "Makefile").read_text()  # what `make install` runs
    pyproject = (tmp_path / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(pyproject.replace('"pillow>=10",', '"pillow>=10", "six>=1.16",'))
    stale = subprocess.run(uv[:-1], cwd=tmp_path, capture_output=True, text=True)  # resolving needs the index
    assert stale.returncode != 0 and "needs to be updated" in stale.stderr, stale.stderr  # changed, not re-locked


def test_pre_commit_runs_ruff_check_and_format():
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    assert [h["entry"] for h in hooks] == ["ruff check --fix", "ruff format"]
