"""Hydra config options that ship with the examples: `hydra.searchpath` names this package."""
