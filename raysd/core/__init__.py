"""Pure core of raysd: sampling, rejection sampling, statistics and theory.

Nothing here imports Ray, touches files or knows about models. Tensor dimensions
use one vocabulary throughout:

    B  rows in a batch (one row per request)
    K  draft positions per step (the speculation length)
    V  vocabulary size (the target model's logits width)

Glossary (after vLLM's rejection sampler):
    accepted   draft tokens that passed the rejection test and are kept
    recovered  the token sampled at the first rejected position, from the
               residual norm(max(0, target_probs - draft_probs))
    bonus      the token sampled from target_probs after all drafts are accepted
"""
