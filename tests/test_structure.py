"""The packages' shape holds: the engine (starter) never imports the project's package
(mynet), which it reaches only through config `_target_`s; no import cycles, between modules or between folders;
every import runs down the layers below; and what runs before launch (config errors, --help) imports neither torch
nor Lightning."""

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "src" / "starter"
ENTRY_POINTS = {"main", "predict", "export"}
ENTRY_POINTS.add("make_shards")  # full examples
# Bottom to top: a unit (a folder, or a module at the package root) imports only from lower layers or its own.
LAYERS = [
    {
        "errors",
        "declared",
        "atomic_write",
        "run_directory",
        "fork_server",
        "fork_server_exit",
        "run_store",
        "process_state",
        "job_token",
    },
    {
        "topology",
        "loggers",
        "checkpointing",
        "models",
        "callbacks",
        "config_choices",
        "config_schema",
        "untrusted",
        "run_failure",
        "host_address",
    },
    {"data", "launch"},
    {"strategies"},
    {"preflight", "run", "trained", "run_name"},
    ENTRY_POINTS,
]


def imports() -> dict[str, set[str]]:
    """{module: the starter modules it imports, at the top or inside a function}, by dotted name."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "starter":  # from starter import a_module
                found |= {f"starter.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("starter"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names if alias.name.startswith("starter")}
        graph[name] = found - {name}
    return graph


def test_the_engine_never_imports_the_projects_package():
    # the project's package is the user's, renamed by copier (.copier/make_project.py): the engine names it nowhere,
    # neither in an import nor in a string that would import it
    project = ROOT / "src" / "mynet"
    named = [str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py") if "mynet" in path.read_text().lower()]
    assert named == [] and (project / "__init__.py").is_file()
    engines = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} - {"data", "models"}
    assert engines and not any((project / name).exists() for name in engines)  # the engine's machinery is not there


def unit(module: str) -> str:
    """The folder (starter.strategies.fsdp -> strategies) or root module (starter.run -> run) a module is in."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_module_imports_itself_through_others():
    try:
        TopologicalSorter(imports()).prepare()
    except CycleError as err:
        raise AssertionError(f"import cycle: {' -> '.join(err.args[1])}") from None


def test_folders_and_root_modules_form_layers_that_import_only_downwards():
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    units = {unit(m) for m in imports()} - {"starter"}
    assert units == set(layer), f"units not in LAYERS: {units - set(layer)}; gone: {set(layer) - units}"
    upward = sorted(f"{m} -> {target}" for m, targets in imports().items() for target in targets
                    if unit(m) != "starter" and layer[unit(target)] > layer[unit(m)])  # fmt: skip
    assert not upward, upward
    folder_graph = {}
    for module, targets in imports().items():
        folder_graph.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    TopologicalSorter(folder_graph).prepare()  # raises CycleError if two folders import each other


def test_the_checks_before_launch_import_neither_torch_nor_lightning():
    probe = "import sys, starter.preflight, starter.main; print(sorted({'torch', 'lightning'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_run_of_one_process_imports_nothing_of_the_several_process_machinery(tmp_path):
    # train.py -> main -> run with the data, model, strategy and callbacks it uses: no launcher, worker, watchdog,
    # stall judge or fork server (those load only where several processes start)
    import json

    from conftest import PROBES, train

    out = tmp_path / "modules.json"
    train(tmp_path, "debug=fdr", "+callbacks.modules._target_=probes.RecordModules", f"+callbacks.modules.output={out}",
          env=PROBES)  # fmt: skip
    imported = json.loads(out.read_text())
    assert "starter.run" in imported and "bed.task" in imported
    machinery = [
        m
        for m in imported
        if m.split(".")[-1] in ("agent", "nodes", "oversight", "worker", "watchdog", "stall", "fork_server")
    ]
    assert machinery == []


def test_the_tests_and_their_children_import_the_checkout_under_test():
    # whatever copy of the package is installed (another checkout's, in editable mode): every process a test starts
    # runs this one's code (conftest.with_env), as this process does (pytest's pythonpath)
    import starter
    from conftest import with_env

    child = subprocess.run([sys.executable, "-c", "import starter; print(starter.__file__)"], env=with_env(),
                           cwd="/", capture_output=True, text=True, check=True)  # fmt: skip
    assert Path(starter.__file__).parent == Path(child.stdout.strip()).parent == PACKAGE
