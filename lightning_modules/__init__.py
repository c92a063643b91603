"""Lightning wiring of qerl: the DataModule and LightningModules used by `train.py` (LightningCLI)."""
