"""Drafters propose tokens; the verifier takes any drafts. See drafters/base.py for the protocol."""
