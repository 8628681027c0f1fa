"""Parameter counts and training FLOPs per token, from the config alone (used for MFU).

FLOPs per token for training follow PaLM (appendix B) and nanoGPT's `estimate_mfu`:

    6 * N_matmul + 12 * L * H * E * T

- 6 = 2 FLOPs per multiply-add x 3 (forward, and backward for inputs and for weights);
- N_matmul counts the parameters each token multiplies: every non-embedding parameter, plus
  the output layer V x D even when it is tied to the embedding (the lookup is free, the output
  matmul is not; for small models it is most of the work);
- 12 L H E T is the attention score and value matmuls (QK^T and AV, 2 x 2 FLOPs each per
  key, x 3 for training) at context T.

For BERT trained with the gathered MLM head, the head (transform + decoder + bias) runs on a
fraction of the tokens only: pass `mlm_fraction` (0.15 for the standard recipe). The pooler and
NSP head run once per sequence and are counted per token as 1/T of their size.
"""

from __future__ import annotations

from models.config import BertConfig, GPTConfig

__all__ = ["flops_per_token", "param_count"]


def _gpt_params(c: GPTConfig) -> dict[str, int]:
    E = c.head_dim
    attn = c.d_model * (c.n_heads + 2 * c.n_kv_heads) * E + c.n_heads * E * c.d_model
    mlp = 3 * c.d_model * c.d_ff
    body = c.n_layers * (attn + mlp + 2 * c.d_model) + c.d_model  # + RMSNorm gains
    return {
        "embedding": c.vocab_size * c.d_model,
        "body": body,
        "output": 0 if c.tie_embeddings else c.vocab_size * c.d_model,
    }


def _bert_params(c: BertConfig) -> dict[str, int]:
    D, F, V = c.d_model, c.d_ff, c.vocab_size
    layer = (4 * D * D + 4 * D) + (2 * D * F + F + D) + 2 * 2 * D  # attn, ffn, 2 LayerNorms
    return {
        "embedding": (V + c.max_seq_len + c.type_vocab_size) * D,
        "body": 2 * D + c.n_layers * layer,  # + embedding LayerNorm
        "pooler_nsp": (D * D + D) + (2 * D + 2),
        "mlm_head": (D * D + D) + 2 * D + V,  # transform dense, LayerNorm, output bias
    }


def param_count(config: BertConfig | GPTConfig, *, embeddings: bool = True) -> int:
    """Trainable parameters of the pre-training model (`BertForPreTraining` / `GPT`).

    Tied weights count once. With `embeddings=False`, the lookup tables (token, and for BERT
    position and token type) are left out; an untied GPT output layer stays in.
    """
    parts = _gpt_params(config) if isinstance(config, GPTConfig) else _bert_params(config)
    return sum(v for k, v in parts.items() if embeddings or k != "embedding")


def flops_per_token(
    config: BertConfig | GPTConfig, seq_len: int | None = None, *, mlm_fraction: float = 1.0
) -> float:
    """Training FLOPs (forward + backward) per input token.

    Args:
        config: model config.
        seq_len: context T (defaults to `config.max_seq_len`).
        mlm_fraction: BERT only: share of tokens the MLM head runs on (1.0 for the full-sequence
            path, ~0.15 for the gathered training path).

    Returns:
        FLOPs per token; multiply by tokens/s and divide by the device peak for MFU.
    """
    T = seq_len or config.max_seq_len
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * T
    if isinstance(config, GPTConfig):
        p = _gpt_params(config)
        n_matmul = p["body"] + p["output"] + (p["embedding"] if config.tie_embeddings else 0)
        return 6 * n_matmul + attention
    p = _bert_params(config)
    decoder = config.vocab_size * config.d_model  # tied to the word embedding
    n_matmul = p["body"] + p["pooler_nsp"] / T + mlm_fraction * (p["mlm_head"] + decoder)
    return 6 * n_matmul + attention
