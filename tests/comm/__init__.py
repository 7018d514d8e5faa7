"""Tests of zerokern.comm (multi-rank ones on gloo CPU ranks: tests/support/harness.py)."""
