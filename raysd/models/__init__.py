"""Model loading and the batched KV cache runner (torch + transformers; no Ray)."""
