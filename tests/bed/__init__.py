"""The engine's test bed: a task, nets and data sets of the tests' own, so that the engine's tests (tests/*.py) run
whatever a project does with its own package and its examples (deleted, renamed, changed; other defaults). Its
options, in conf/ (`model=bed_mlp`, `bed_cnn`, `bed_vit`; `data=bed_digits`, `bed_images`), are on the config search
path of every run a test makes (tests/conftest.py), and are its default model and data. The classes follow the
template's small examples (src/mynet): what the engine does with those, it does with these."""
