"""What a class declares, read off its source without importing it (the checks before launch import neither torch nor
Lightning): the literal value a class body, or a base class's, assigns to a name, e.g. `shards_itself = True`."""

import ast
import importlib.util
from pathlib import Path

from starter.errors import UserError


def declared(target: str, name: str, key: str = "_target_"):
    """The literal `name` of class `target` (`package.module.Class`), or of the nearest base that assigns it; None
    where no class in the chain does, or a base's source cannot be read (a compiled or built-in module). A module
    that cannot be found is a one-line error naming `key`."""
    module_name, _, class_name = target.rpartition(".")
    found = _source(module_name)
    if found is None:
        raise UserError(f"{key}={target}: no module {module_name or target} (is its package on PYTHONPATH?)")
    return _declared(module_name, class_name, name, *found, depth=0)


def _source(module_name: str) -> tuple[ast.Module, str | None] | None:
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return ast.parse(Path(spec.origin).read_text()), spec.parent


def _declared(module_name: str, class_name: str, name: str, tree: ast.Module, package: str | None, depth: int):
    imported = {}  # the module's top-level names for what it imports: local name -> dotted path
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = (
                importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                if node.level
                else node.module
            )
            imported |= {alias.asname or alias.name: f"{base}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:  # import a.b as c -> c: a.b; import a.b -> a: a
                top = alias.name.split(".")[0]
                imported[alias.asname or top] = alias.name if alias.asname else top
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name == class_name):
            continue
        for statement in node.body:
            targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", None)]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and statement.value is not None:
                return ast.literal_eval(statement.value)
        for base in node.bases:
            head, _, rest = ast.unparse(base).partition(".")
            dotted = imported.get(head, f"{module_name}.{head}") + (f".{rest}" if rest else "")
            base_module, _, base_class = dotted.rpartition(".")
            source = _source(base_module) if depth < 10 else None
            if (
                source is not None
                and (value := _declared(base_module, base_class, name, *source, depth + 1)) is not None
            ):
                return value
    return None
