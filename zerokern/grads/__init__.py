"""grads: see the README code map."""
