"""Baton's version: a module of its own, so that what records it (`baton.runtime.compat`)
needs nothing above it."""

__version__ = "0.1.0"
