"""Proposers draft tokens; verification takes any drafts. The protocol is in ``base.py`` (``Proposer``), the
model drafters' shared interface in ``model_drafter.py``, and ``factory.py`` builds one from a SpeculativeConfig."""
