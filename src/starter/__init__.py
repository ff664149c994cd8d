"""Lightning + Hydra starter: one train.py for every parallel mode. Entry point: `starter.main.main`."""
