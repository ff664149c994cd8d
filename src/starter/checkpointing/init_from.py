"""`init_from=PATH`: a fresh run from trained weights only (a checkpoint or model.pt of this starter, or a plain state
dict of the net: torchvision's, one's own). A head trained for another class count stays initialised, said in one line;
any other mismatch is refused."""

import logging
from pathlib import Path

import torch

from starter.checkpointing.resume import weights_mismatch
from starter.errors import UserError
from starter.models.head import head_name
from starter.untrusted import declared_models, model_config, reading

log = logging.getLogger(__name__)


def load_initial_weights(model: torch.nn.Module, path: Path, config_dirs: list, training: bool = True) -> None:
    """`config_dirs`: the config folders whose model configs say what a record may ask for; a checkpoint's inference
    record asking for anything else is refused, as predict.py refuses it, though only its weights are read here.
    A head of another class count starts fresh where the run trains; a test of the weights given (`training` false)
    refuses it (it would test a random head)."""
    with reading(path, "init_from"):
        saved = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(saved, dict) and "inference" in saved:
        model_config(saved["inference"], declared_models(config_dirs), f"init_from={path}")
    state = saved.get("state_dict", saved) if isinstance(saved, dict) else {}
    own = model.state_dict()
    net = getattr(model, "net", None)
    if net is not None and not any(k.startswith("net.") for k in state):  # a plain net's state dict
        state = {f"net.{k}": v for k, v in state.items()}
    if net is not None:
        head = f"net.{head_name(net)}"
        other = [
            k for k in (f"{head}.weight", f"{head}.bias") if k in state and k in own and state[k].shape != own[k].shape
        ]
        if other and not training:
            outputs = f"its head ({head}) has {len(state[other[0]])} outputs, this model {len(own[other[0]])} classes"
            raise UserError(
                f"init_from={path}: {outputs}; train=false tests the weights given: give data of its classes"
            )
        if other:
            log.info(
                "init_from=%s: its head (%s) has %d outputs, this model %d classes: the head starts freshly"
                " initialised",
                path,
                head,
                len(state[other[0]]),
                len(own[other[0]]),
            )
            state |= {k: own[k] for k in other}
    if mismatch := weights_mismatch(own, state):
        raise UserError(f"init_from={path} holds weights of another model ({mismatch}); use weights of this net")
    model.load_state_dict(state)
