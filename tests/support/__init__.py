"""Shared test helpers: the spawn harness, the test models, the test rule."""
