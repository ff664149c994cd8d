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
    shutil.move(root / "src" / TEMPLATE_PACKAGE, root / "src" / package)
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
