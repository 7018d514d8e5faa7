"""Tests of zerokern.grads (multi-rank ones on gloo CPU ranks: tests/support/harness.py)."""
