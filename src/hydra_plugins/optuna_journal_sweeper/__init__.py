"""`hparams_search=optuna`: a Hydra sweeper on current Optuna, found where Hydra finds plugins (`hydra_plugins`)."""
