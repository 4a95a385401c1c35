"""One module per scenario (see bench.registry for what a module provides)."""
