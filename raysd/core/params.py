"""How a request samples (`SamplingParams`): checked without torch, so a process that only
coordinates (a job's replica, raysd.actors.coordinator) or checks a job (raysd.jobs.config)
imports none. raysd.core.sampling turns it into tensors and samples.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20
LOGPROBS_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Defaults follow Hugging Face `generate`."""

    temperature: float = 0.0  # 0 means greedy: exact argmax, no randomness consumed
    top_k: int = 0  # 0 disables; otherwise keep the k largest logits (ties kept)
    top_p: float = 1.0  # 1.0 disables; otherwise nucleus sampling as in HF TopPLogitsWarper
    seed: int = 0  # in [0, 2^63): keys the request's counter-based draws (raysd.core.draws)
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    ignore_eos: bool = False
    # Stop strings: generation ends at the first occurrence of one in the decoded output (the
    # engine needs the target's tokenizer); the text is cut before it unless include_stop_str_in_output.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # Log-probabilities of the generated tokens under the target, from the verify pass: "raw" the
    # log-softmax of the target's logits (vLLM's default), "processed" of the distribution sampled
    # (temperature, top-k, top-p applied); top_logprobs > 0 also gives the N most likely tokens'.
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_mode: str = "raw"

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and self.temperature == self.temperature):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.top_logprobs:
            object.__setattr__(self, "logprobs", True)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
