"""Tests of zerokern.stage3 (multi-rank ones on gloo CPU ranks: tests/support/harness.py)."""
