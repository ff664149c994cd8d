"""Code written for Lightning, not for this starter, in the styles its users bring: a Lightning + Hydra template's
module and DataModule, a module with manual optimization and two optimizers on dict batches, a language model on an
IterableDataset. Brought in unchanged, named only by the config files in conf/ (`hydra.searchpath`)."""
