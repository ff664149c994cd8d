"""Run by copier in a freshly generated project (copier.yml's task): `starter` becomes the chosen package name.

    python .copier/make_project.py PACKAGE_NAME "PROJECT TITLE"

Moves src/starter to src/PACKAGE_NAME, rewrites every text file (imports, config targets, pyproject, prose), sets
the README's title, and removes itself. The template's repository is never touched.
"""

import re
import shutil
import sys
from pathlib import Path

TEMPLATE_PACKAGE = "starter"


def main(package: str, title: str) -> None:
    root = Path.cwd()
    template_package, package_dir = root / "src" / TEMPLATE_PACKAGE, root / "src" / package
    for source in sorted(p for p in template_package.rglob("*") if p.is_file()):  # `copier update` renders the
        target = package_dir / source.relative_to(template_package)  # template's files over an existing package
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(source, target)
    shutil.rmtree(template_package)
    for path in root.rglob("*"):
        if not path.is_file() or ".git" in path.parts or path.name == ".copier-answers.yml":
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # images
            continue
        renamed = re.sub(TEMPLATE_PACKAGE, package, text, flags=re.IGNORECASE)
        if path == root / "README.md":
            renamed = re.sub(r"\A# .*", f"# {title}", renamed)
        if renamed != text:
            path.write_text(renamed)
    shutil.rmtree(root / ".copier")


if __name__ == "__main__":
    main(*sys.argv[1:3])
