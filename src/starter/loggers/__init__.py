"""Where metrics go: the CSV file every run keeps, MLflow, the loggers' lifecycle, the report a finished run leaves."""
