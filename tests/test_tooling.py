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


def test_the_github_workflow_runs_lint_and_tests_on_push_with_the_pip_cache():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "test.yml").read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert "push" in triggers and "pull_request" in triggers
    steps = workflow["jobs"]["test"]["steps"]
    setup = next(s for s in steps if s.get("uses", "").startswith("actions/setup-python"))
    assert setup["with"]["cache"] == "pip"
    assert [s["run"] for s in steps if "run" in s] == ["make lint", "make test"]


def test_pre_commit_runs_ruff_check_and_format():
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    assert [h["entry"] for h in hooks] == ["ruff check --fix", "ruff format"]
