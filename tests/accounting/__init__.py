"""Tests of zerokern.accounting (multi-rank ones on gloo CPU ranks: tests/support/harness.py)."""
