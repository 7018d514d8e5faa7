"""The ZeRO engine's core: ZeroOptimizer (the stages' common step, built once
from a plan), its arguments and their checks, the loss scale, and what follows the
model (its moves, its frozen params, the ranks' first weights)."""
