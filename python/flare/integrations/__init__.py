"""Integrations of flare into other frameworks; each submodule imports its framework lazily."""
