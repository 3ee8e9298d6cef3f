"""Training EAGLE-3 draft heads for a target (``specdec train-draft``; docs/eagle3.md, "Training a head")."""

from specdec.training.pipeline import TrainDraftConfig, train_draft

__all__ = ["TrainDraftConfig", "train_draft"]
