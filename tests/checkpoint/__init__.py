"""Tests of zerokern.checkpoint (multi-rank ones on gloo CPU ranks: tests/support/harness.py)."""
