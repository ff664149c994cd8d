"""Checkpoints: atomic files, sharded directories behind an atomic link, what ckpt_path names, the model.pt export."""
