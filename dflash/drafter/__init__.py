"""The DFlash drafter: model, objective, export, data."""
