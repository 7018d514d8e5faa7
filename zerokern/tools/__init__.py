"""Helpers that are not the optimizer: the demo GPT, spawning ranks, tables and
argument types for the CLI."""
