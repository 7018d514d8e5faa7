"""Multi-rank tests of zerokern.ZeroAdamW stages 0-2 (gloo ranks on CPU, see harness.py)."""
