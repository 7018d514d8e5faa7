"""accounting: see the README code map."""
