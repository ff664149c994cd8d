"""This project's own code: the task (models/classifier.py), its nets (models/nets/) and data modules (data/). It
builds on the engine, `starter`, which it imports; the engine reaches it only through the configs' `_target_`s."""
