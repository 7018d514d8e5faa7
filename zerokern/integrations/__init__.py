"""Hooks into other training frameworks: `zerokern.integrations.accelerate` (an Accelerator
that trains with ZeroAdamW) and `zerokern.integrations.transformers` (a Trainer that does)."""
