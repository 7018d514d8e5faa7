"""Tests of zerokern.rules (multi-rank ones on gloo CPU ranks: tests/support/harness.py)."""
