"""Toy models whose acceptance is i.i.d. by construction, to check the theory end to end.

A Llama whose embedding rows are all equal and whose attention and MLP write nothing
(o_proj and down_proj zero) has the same final hidden state whatever the context, so its
next-token distribution is one fixed vector. A target and a draft with two such vectors
target_probs and draft_probs accept every draft independently with probability
a = sum_x min(target_probs(x), draft_probs(x)) at
temperature 1 (Leviathan et al. 2023, Corollary 3.6): exactly the i.i.d. assumption
behind E = (1 - a^(K+1)) / (1 - a).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def fixed_distribution_llama(logits: torch.Tensor, hidden_size: int = 16, layers: int = 1) -> LlamaForCausalLM:
    """A Llama whose next-token logits are `logits` ([V]) after every context (up to rounding)."""
    V = logits.shape[0]
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(1.0)  # [V, H]: every token embeds to the same vector
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()  # attention adds nothing to the residual stream
            layer.mlp.down_proj.weight.zero_()  # neither does the MLP
        # The final RMSNorm maps the all-ones state to ~ones; column 0 carries the logits.
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, 0] = logits.float()
    return model.eval()


def next_token_probs(model: LlamaForCausalLM) -> torch.Tensor:
    """[V] the model's (context-free) next-token distribution at temperature 1."""
    with torch.no_grad():
        return torch.softmax(model(torch.tensor([[1, 2, 3]])).logits[0, -1].float(), dim=-1)
