"""The ZeRO engine end to end: parity with DDP + torch AdamW, precision, overflow, semantics."""
