"""checkpoints/model.pt: the trained weights as one plain state dict, whatever the strategy, for inference.

model = hydra.utils.instantiate(OmegaConf.load("RUN_DIR/config.yaml").model)
model.load_state_dict(torch.load("RUN_DIR/checkpoints/model.pt"))
"""

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def save_full_weights(trainer, path: Path) -> None:
    """A collective where the strategy holds shards or stages (it gathers them on rank 0); state_dict() otherwise."""
    gather = getattr(trainer.strategy, "full_state_dict", None)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = gather() if gather else get_model_state_dict(trainer.lightning_module, options=options)
    if trainer.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
