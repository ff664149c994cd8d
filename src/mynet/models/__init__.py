"""The LightningModule (classifier.py) and plain-PyTorch nets (nets/). Neither knows the strategy running it."""
