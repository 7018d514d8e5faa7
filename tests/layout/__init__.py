"""Tests of zerokern.layout (multi-rank ones on gloo CPU ranks: tests/support/harness.py)."""
