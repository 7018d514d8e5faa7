"""Tests of zerokern.state (multi-rank ones on gloo CPU ranks: tests/support/harness.py)."""
