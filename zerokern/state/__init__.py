"""state: see the README code map."""
