"""The single-process speculative decoding engine (no Ray)."""
