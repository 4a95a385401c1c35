"""`raysd study`: profile a model pair, measure acceptance and speedups, compare with the theory."""
