"""What a user can ask of the optimizer: the precisions, stages, offloads and masters, every
argument's check (args.py: before anything is changed) and the arguments' text the optimizers'
docstrings share (doc.py). Low in the layers: stages, layouts and accounting check the same
options with the same code."""
