"""What differs between the transformers versions raysd supports (pyproject's floor, which CI
tests too, up to the newest).

From transformers 5.2x a model's, a decoder layer's and an attention module's `forward` take the
KV cache as `cache`; `past_key_values` still works there but warns that it goes in 5.40. Older
versions take only `past_key_values`. raysd passes whichever the module's own signature names.
"""

from __future__ import annotations

import functools
import inspect


def cache_keyword(module) -> str:
    """"cache" or "past_key_values": the keyword `module.forward` takes its KV cache by."""
    return _cache_keyword(type(module))


@functools.cache
def _cache_keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
