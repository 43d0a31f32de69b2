"""Random-weight Qwen2 checkpoints of a known shape, built locally (no download).

Tests serve a tiny one on vLLM and on transformers and compare their verdicts; `scripts/gpu-check.sh`
builds the real Qwen2.5-1.5B and -7B shapes on a GPU machine that cannot download, to measure what a
verify costs there. Cost depends on the shapes, not on the weights' values.

A freshly initialised model is nearly uniform over its vocabulary (every logit within a few tenths),
which makes argmax a coin toss between near-equal logits and leaves no meaningful top-K. Scaling the
output head (`head_scale`) gives peaked rows like a trained model's: with the tiny shape, the top token
holds about half the mass and the top 20 about 97%.
"""

from __future__ import annotations

from pathlib import Path

SHAPES: dict[str, dict] = {
    # the tests' model: head_dim 32 (vLLM's CPU attention has no kernel for 16)
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    # Qwen2.5-1.5B(-Instruct/-Coder) and Qwen2.5-7B, from their published config.json
    "1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    "7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        rope_theta=1e6,
    ),
}


def random_qwen2(
    shape: str = "tiny",
    *,
    seed: int = 0,
    head_scale: float = 20.0,
    dtype: str = "float32",
    device: str = "cpu",
    **config,
):
    """A transformers Qwen2ForCausalLM of `shape` with seeded random weights (see the module docstring);
    `config` overrides the shape's fields (`vocab_size=len(tokenizer)` for a model that goes with a tokenizer)."""
    import torch  # heavy: the hf extra
    from transformers import Qwen2Config, Qwen2ForCausalLM  # heavy: the hf extra

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    params = {**SHAPES[shape], **config}
    rope = params.pop("rope_theta", None)
    cfg = Qwen2Config(**params)
    if rope is not None:  # transformers 5 keeps rope settings in rope_parameters
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": rope}
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    if head_scale != 1.0 and not cfg.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    return model


def save_random_qwen2(
    out_dir: str | Path,
    shape: str = "tiny",
    *,
    seed: int = 0,
    head_scale: float = 20.0,
    dtype: str = "float32",
    **config,
) -> Path:
    """Build `random_qwen2(...)` and write it as a Hugging Face directory (config + safetensors, no
    tokenizer: token i is just id i on every engine)."""
    out = Path(out_dir)
    random_qwen2(shape, seed=seed, head_scale=head_scale, dtype=dtype, **config).save_pretrained(str(out))
    return out
