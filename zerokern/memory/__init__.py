"""Model-state bytes: the formulas of DESIGN §4-§5 (`formula`), their per-rank split on a mesh
(`mesh`), and the optimizer's own `memory_report()` (`report`), which `zerokern estimate`
(zerokern.accounting) predicts byte for byte."""
