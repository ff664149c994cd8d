"""`compile=true`: torch.compile the LightningModule's forward, in place (`nn.Module.compile`: parameter names and
checkpoints stay the plain module's), in every rank when Lightning sets the run up: after ddp_spawn started its
processes (a compiled module cannot be pickled) and before a strategy wraps or shards the module."""

import lightning as L


def compile_module(enabled: bool, options: dict | None = None) -> "CompileModule | None":
    """The callback for `compile` and `compile_options` (conf/callbacks/base/every_run.yaml); None when off."""
    return CompileModule(**(options or {})) if enabled else None


class CompileModule(L.Callback):
    def __init__(self, **options):
        """`options`: torch.compile's keyword arguments (`compile_options` in the config), e.g. mode, backend."""
        self.options = options
        self.compiled = False  # per process: fit then test in one process compiles once

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.compiled:
            pl_module.compile(**self.options)
            self.compiled = True
