"""The optimizers users build: ZeroAdamW, ZeroLion, ZeroMuon (and the
rules they pick); each a ZeroOptimizer with its rule."""
