"""ImageNet as downloaded (ILSVRC2012 archives) -> the ImageFolder tree `data=imagenet` reads, once:

    python -m starter.data.imagenet_archives /data/imagenet

The devkit gives the 1,000 classes and the validation labels; the train archive (a tar per class) goes to train/<wnid>/,
the val archive (or a flat val/) to val/<wnid>/, as torchvision.datasets.ImageNet lays it out, without its MD5 checks
(so small test archives work); synset_names.json maps ids to names.
"""

import json
import shutil
import sys
import tarfile
from pathlib import Path

from starter.errors import UserError

DEVKIT, TRAIN, VAL = "ILSVRC2012_devkit_t12.tar.gz", "ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar"
COMMAND = "python -m starter.data.imagenet_archives"


def needs_preparing(root: Path) -> str | None:
    """Why `root` is ImageNet that is not yet an ImageFolder tree (None if it is not, or is ready)."""
    if not (root / "train").is_dir() and (root / TRAIN).is_file():
        return f"{root} holds {TRAIN} but no train/ folder"
    val = root / "val"
    if val.is_dir() and any(p.suffix.upper() == ".JPEG" for p in val.iterdir()):
        return f"{val} holds images without class folders"
    if not val.is_dir() and (root / VAL).is_file():
        return f"{root} holds {VAL} but no val/ folder"
    return None


def read_devkit(root: Path) -> tuple[dict[str, str], list[str]]:
    """({wnid: class name} of the 1,000 leaf synsets, the wnid of each validation image in file-name order)."""
    import numpy as np
    from scipy.io import loadmat

    path = root / DEVKIT
    if not path.is_file():
        raise UserError(f"{path} is missing: the devkit holds the class list and the validation labels")
    with tarfile.open(path) as archive:
        members = {Path(m.name).name: m for m in archive.getmembers()}
        synsets = loadmat(archive.extractfile(members["meta.mat"]), squeeze_me=True)["synsets"]
        truth = archive.extractfile(members["ILSVRC2012_validation_ground_truth.txt"]).read().decode().split()
    leaves = [s for s in np.atleast_1d(synsets) if int(s["num_children"]) == 0]
    wnid_of = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in leaves}
    return {str(s["WNID"]): str(s["words"]) for s in leaves}, [wnid_of[int(i)] for i in truth]


def prepare(root: Path) -> None:
    names, val_wnids = read_devkit(root)
    if not (root / "train").is_dir():
        extract_train(root / TRAIN, root / "train")
    val = root / "val"
    if not val.is_dir():
        if not (root / VAL).is_file():
            raise UserError(f"{root / VAL} is missing (and there is no val/ folder)")
        with tarfile.open(root / VAL) as archive:
            archive.extractall(val, filter="data")
    sort_validation_images(val, val_wnids)
    (root / "synset_names.json").write_text(json.dumps(names, indent=0) + "\n")


def extract_train(archive_path: Path, train: Path) -> None:
    """The train archive holds one tar per class (n01440764.tar, ...): each into train/<wnid>/."""
    partial = train.with_name("train.partial")  # renamed when whole: an interrupted run starts over
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(archive_path) as archive:
        for member in archive:
            with tarfile.open(fileobj=archive.extractfile(member)) as class_archive:
                class_archive.extractall(partial / Path(member.name).stem, filter="data")
            print(f"train/{Path(member.name).stem}", flush=True)
    partial.rename(train)


def sort_validation_images(val: Path, wnids: list[str]) -> None:
    """Move val/*.JPEG, in file-name order, into val/<wnid>/ by the devkit's ground truth."""
    images = sorted(p for p in val.iterdir() if p.suffix.upper() == ".JPEG")
    if not images:
        return
    if len(images) != len(wnids):
        raise UserError(f"{val} holds {len(images)} images but the devkit labels {len(wnids)}")
    for image, wnid in zip(images, wnids):
        (val / wnid).mkdir(exist_ok=True)
        image.rename(val / wnid / image.name)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: {COMMAND} ROOT   (ROOT holds {DEVKIT}, {TRAIN}, {VAL})", file=sys.stderr)
        return 2
    try:
        prepare(Path(argv[0]))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"ready: data=imagenet data.root={argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
