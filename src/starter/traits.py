"""What a strategy can do, declared once in its config (`traits:` in conf/strategy/<name>.yaml) and read by the
checks before launch (preflight.py), the process layout (topology.py) and the run: a new strategy is its class
and its YAML, and no other file names it. Imports nothing heavy: the checks run before torch is loaded.

A capability is True (supported), or False or a string saying why not (refused, with that reason, in one line).
"""

from dataclasses import dataclass, fields

from starter.errors import UserError

Support = bool | str


@dataclass(frozen=True)
class Traits:
    launcher: str | None = None  # who starts one process per device: "subprocess" (starter.launch), "spawn" (the
    # strategy itself); None: the run is this one process
    one_process: str | None = None  # what a run of one process trains with instead (ddp: auto, nothing to reduce)
    devices_per_process: str = "one"  # or "all": one process drives every device it is given (dp; needs CUDA)
    pipeline: bool = False  # cuts the net (an nn.Sequential) into stages run by a schedule over micro-batches
    scales_fp16: Support = True  # precision=16-mixed: a loss scaler that works with its gradients
    clips_gradients: Support = True  # trainer.gradient_clip_val: clipped by the norm of the whole model's gradient
    compiles: Support = True  # compile=true
    whole_weights: bool = True  # every process holds every weight (what weight averaging needs)
    syncs_batchnorm: bool = False  # sync_batchnorm=true: BatchNorm statistics over the global batch (GPUs)
    channels_last_weights: bool = True  # conv weights may be stored NHWC (FSDP2 shards contiguous ones only)

    @classmethod
    def of(cls, strategy_cfg) -> "Traits":
        declared = dict(strategy_cfg.get("traits") or {})
        known = [f.name for f in fields(cls)]
        if unknown := sorted(declared.keys() - set(known)):
            names = ", ".join(known)
            raise UserError(f"strategy={strategy_cfg.name} declares unknown traits {unknown}; known: {names}")
        return cls(**declared)

    @property
    def multi_process(self) -> bool:
        return self.launcher is not None


def why_not(support: Support) -> str | None:
    """None where `support` says supported; else the reason it gives ("" when it gives none)."""
    if support is True:
        return None
    return support if isinstance(support, str) else ""
