"""zerokern's tests: one folder per sub-package (docs/code-map.md, Tests, CI and these docs)."""
