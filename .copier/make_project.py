"""Run by copier in a freshly generated project (copier.yml's task): the project's package, `mynet` in the template,
becomes the chosen name, and with `minimal` the larger examples go. The engine, `starter`, is never renamed: an
update of the template replaces its files as they are.

    python .copier/make_project.py PACKAGE_NAME "PROJECT TITLE" full|minimal [TEMPLATE]

Moves src/mynet to src/PACKAGE_NAME, rewrites every text file of the template's (TEMPLATE: copier's checkout of it)
that names it as a whole word (imports, config targets, prose; never a file of the user's or one git ignores), names
the distribution in pyproject.toml after it, sets the README's title, removes itself, and brings uv.lock in line with
the project's pyproject.toml. The template's repository is never touched.

What belongs to the larger examples only: the paths in LARGER_EXAMPLES, each line ending in a `# full examples`
(or `<!-- full examples -->`) marker, and the lines between `# full examples: begin` and `# full examples: end`
(or the same in `<!-- -->`). `minimal` deletes them; `full` keeps them and deletes only the markers.
"""

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

TEMPLATE_PACKAGE = "mynet"  # the project's package in the template; the engine, src/starter, keeps its name
LARGER_EXAMPLES = [  # ImageNet-style data, shards, the ResNets, the SLURM launchers, the recipe, the benchmarks of them
    "src/starter/data/imagenet.py",
    "src/starter/data/imagenet_archives.py",
    "src/starter/data/shards.py",
    "src/starter/data/shard_records.py",
    "src/starter/data/shard_set.py",
    "src/starter/data/object_store.py",
    "src/starter/data/device_decode.py",
    "src/starter/make_shards.py",
    "make_shards.py",
    "conf/data/shards.yaml",
    "conf/make_shards.yaml",
    "src/mynet/models/nets/torchvision.py",
    "conf/data/imagenet.yaml",
    "conf/model/resnet18.yaml",
    "conf/model/resnet50.yaml",
    "conf/model/vit_s16.yaml",
    "conf/experiment/imagenet_resnet50.yaml",
    "conf/experiment/imagenet_resnet50_recipe.yaml",
    "conf/experiment/fast_resnet50.yaml",
    "conf/experiment/fast_vit_s16.yaml",
    "conf/launcher",
    "tests/test_image_folder.py",
    "tests/test_shards.py",
    "tests/examples/test_fsdp_resnet.py",
    "tests/examples/test_example_recipe.py",
    "tests/test_launchers.py",
    "tests/test_benchmarks.py",
    "benchmarks/data_paths.py",
    "benchmarks/strategy_matrix.py",
    "benchmarks/gpu_scaling.py",
    "benchmarks/gpu_matrix.py",
    "benchmarks/hand_loop.py",
    "benchmarks/gpu_session.py",
    "benchmarks/gpu_session.sh",
    "benchmarks/step_profile.py",
    "benchmarks/folder_epoch.py",
    "benchmarks/predict_speed.py",
    "benchmarks/results",  # the template's measurements: `make bench` writes the project's own
    "benchmarks/RESULTS.md",
]
MARK = r"(?:# full examples|<!-- full examples -->)"
MARKED_LINE = re.compile(rf"^(.*?)[ \t]*{MARK}[ \t]*\n", re.MULTILINE)
MARKED_BLOCK = re.compile(
    r"^[ \t]*(?:# full examples: begin|<!-- full examples: begin -->)[ \t]*\n(.*?)"
    r"^[ \t]*(?:# full examples: end|<!-- full examples: end -->)[ \t]*\n",
    re.MULTILINE | re.DOTALL,
)


def keep_examples(text: str, full: bool) -> str:
    """The text with the larger examples' marked lines kept (markers gone) or removed."""
    text = MARKED_BLOCK.sub(r"\1" if full else "", text)
    return MARKED_LINE.sub(r"\1\n" if full else "", text)


def template_files(template: Path | None, package: str) -> set[Path] | None:
    """The project's paths of the files the template holds (its package's under the project's name): the only files
    this task reads or writes. A user's own files, and what git ignores (logs/, data/), are never opened, at copy or
    at update (copier runs this task in the project again). None where the template is not given (every file)."""
    if template is None:
        return None
    held = set()
    for path in template.rglob("*"):
        relative = path.relative_to(template)
        if path.is_file() and ".git" not in relative.parts:
            parts = relative.parts
            if parts[:2] == ("src", TEMPLATE_PACKAGE):
                parts = ("src", package, *parts[2:])
            held.add(Path(*parts))
    return held


def main(package: str, title: str, examples: str = "full", template: str | None = None) -> None:
    root = Path.cwd()
    held = template_files(Path(template) if template else None, package)
    if examples == "minimal":
        for relative in LARGER_EXAMPLES:
            path = root / relative
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    template_package, package_dir = root / "src" / TEMPLATE_PACKAGE, root / "src" / package
    if package != TEMPLATE_PACKAGE:
        for source in sorted(p for p in template_package.rglob("*") if p.is_file()):  # `copier update` renders the
            target = package_dir / source.relative_to(template_package)  # template's files over an existing package
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(source, target)
        shutil.rmtree(template_package)
    for path in sorted(root / p for p in held) if held is not None else root.rglob("*"):
        skipped = path.name == ".copier-answers.yml" or {".git", ".copier"} & set(path.relative_to(root).parts)
        if not path.is_file() or path.is_symlink() or skipped:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # images
            continue
        # the package's name as a whole word, as written (a user's `MyNet` or `mynet_utils` is theirs)
        renamed = re.sub(rf"\b{TEMPLATE_PACKAGE}\b", package, keep_examples(text, examples == "full"))
        if path == root / "pyproject.toml":  # the distribution: the project's, holding both packages
            renamed = re.sub(r'^name = ".*"$', f'name = "{package}"', renamed, count=1, flags=re.MULTILINE)
        if path == root / "README.md":
            renamed = re.sub(r"\A# .*", f"# {title}", renamed)
        if renamed != text:
            path.write_text(renamed)
    if held is not None:
        carry_edits_of_dropped_files(root, Path(template), package, held, examples == "full")
    shutil.rmtree(root / ".copier")
    relock(root)


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True)


def carry_edits_of_dropped_files(root: Path, template: Path, package: str, held: set[Path], full: bool) -> None:
    """At `copier update`: copier deletes every file the project's last template version had and this one lacks,
    edited or not, without a word. Each such file the user edited (its committed text is not what that version made
    of it) is merged into its new place where the engine now has it (src/<package>/X -> src/starter/X, the move to
    two packages; conflicts left as git's markers), or else kept beside as X.yours; said in a line each."""
    top = git(root, "rev-parse", "--show-toplevel").stdout.decode().strip()
    answers = git(root, "show", "HEAD:./.copier-answers.yml")  # relative to the project, wherever its repository is
    old = last_commit(answers.stdout) if answers.returncode == 0 else None
    if old is None:
        return  # a copy (or copier's scratch copy of an update), not the project being updated
    if Path(top).resolve() != root.resolve():
        print("copier update: this project is a folder of a larger repository; edits to files the template has dropped"
              " are not carried: `git diff HEAD` shows what the update deleted")  # fmt: skip
        return
    if git(template, "cat-file", "-e", f"{old}^{{commit}}").returncode != 0:
        print(f"copier update: the template's checkout lacks {old} (this project's last version): edits to files the"
              " template has dropped since are not carried; `git diff HEAD` shows what the update deleted")  # fmt: skip
        return
    task = git(template, "show", f"{old}:.copier/make_project.py").stdout.decode()
    named = re.search(r'^TEMPLATE_PACKAGE = "(\w+)"', task, re.MULTILINE)
    old_package = named.group(1) if named else TEMPLATE_PACKAGE
    anywhere = "re.IGNORECASE" in task  # the first tasks renamed it anywhere in a word, in any case

    def made(text: str) -> str:  # what the task of that version made of a template file
        text = keep_examples(text, full)
        if anywhere:
            return re.sub(old_package, package, text, flags=re.IGNORECASE)
        return re.sub(rf"\b{old_package}\b", package, text)

    ours = set(git(root, "ls-tree", "-r", "-z", "--name-only", "HEAD").stdout.decode().split("\0"))
    for name in git(template, "ls-tree", "-r", "-z", "--name-only", old).stdout.decode().split("\0"):
        parts = Path(name).parts
        inside = parts[:2] == ("src", old_package)
        path = Path("src", package, *parts[2:]) if inside else Path(name)
        if not name or str(path) not in ours or path in held:
            continue
        yours = git(root, "show", f"HEAD:{path}").stdout
        try:
            before = made(git(template, "show", f"{old}:{name}").stdout.decode())
            if yours.decode() == before:
                continue  # not edited: copier's deletion loses nothing
        except UnicodeDecodeError:
            continue  # images: the template's own
        engine = Path("src", "starter", *parts[2:])
        if inside and (root / engine).is_file():
            conflicts = merge_into(root / engine, yours, before)
            said = f"{conflicts} conflict(s) to settle there (<<<<<<< your {path})" if conflicts else "merged cleanly"
            print(f"copier update: your edit of {path} is carried to {engine}, where the engine has it now: {said}")
        else:
            (root / f"{path}.yours").write_bytes(yours)
            print(f"copier update: the template no longer has {path}; your edited copy is kept as {path}.yours")


def last_commit(answers: bytes) -> str | None:
    """The template commit a project's committed .copier-answers.yml names, as copier wrote it: YAML, so a short hash
    of digits only is quoted (`_commit: '7408061'`)."""
    import yaml  # copier's own dependency: this runs in copier's Python

    answers = yaml.safe_load(answers)
    commit = answers.get("_commit") if isinstance(answers, dict) else None
    return commit if isinstance(commit, str) and re.fullmatch(r"\w[\w.+-]*", commit) else None  # a ref, never an option


def merge_into(target: Path, yours: bytes, before: str) -> int:
    """The user's edit of `before` (the template's text it started from) merged into `target` (the template's text
    now), in place; how many conflicts git's markers leave there."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        mine, base = Path(scratch, "yours"), Path(scratch, "before")
        mine.write_bytes(yours)
        base.write_text(before)
        labels = ["-L", f"your {target.name}", "-L", "the template before", "-L", "the engine now"]
        merged = subprocess.run(["git", "merge-file", "-p", *labels, str(mine), str(base), str(target)],
                                capture_output=True)  # fmt: skip
    if merged.returncode > 127:  # git's error (its negative exit), not a count of conflicts
        raise RuntimeError(merged.stderr.decode())
    target.write_bytes(merged.stdout)
    return merged.returncode


def relock(root: Path) -> None:
    """uv.lock for the project's own pyproject.toml (its package's name; minimal drops the larger examples'
    packages): `uv lock` over the renamed lock keeps every version the template tested and changes only what the
    project's dependencies do."""
    if importlib.util.find_spec("uv"):
        command = [sys.executable, "-m", "uv", "lock", "--quiet"]
    elif shutil.which("uv"):
        command = ["uv", "lock", "--quiet"]
    else:
        print("uv is not installed here: run `make lock` in the project before `make install`", file=sys.stderr)
        return
    subprocess.run(command, cwd=root, check=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
