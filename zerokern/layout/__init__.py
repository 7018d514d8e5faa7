"""layout: see the README code map."""
