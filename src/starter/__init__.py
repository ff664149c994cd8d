"""Lightning + Hydra starter: one train.py for every parallel mode. Entry point: `starter.main.main`; a trained module
back: `starter.load_module(run_dir)` (starter/trained.py)."""


def __getattr__(name: str):
    if name == "load_module":  # imported when asked for: `import starter.preflight` loads neither torch nor Lightning
        from starter.trained import load_module

        return load_module
    raise AttributeError(f"module 'starter' has no attribute {name!r}")
