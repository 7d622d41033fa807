"""A tiny random Qwen3 whose tokenizer has think tokens and whose chat template (our own) honours
``enable_thinking`` and ``reasoning_effort``: with thinking on, the prompt ends inside an open
``<think>`` (DeepSeek-R1's way), so the reply starts in its thinking; with it off, an empty think block
is closed in the prompt (Qwen3's way) and the reply is all answer."""

from __future__ import annotations

from pathlib import Path

from helpers import make_tiny_model, smollm2_tokenizer

TEMPLATE = (
    "{%- if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{%- endif %}"
)
VOCAB = 49160  # SmolLM2's 49152 and the two think tokens, rounded up


def make_reasoning_model(path: Path, seed: int = 0) -> Path:
    make_tiny_model(path, seed=seed, model_type="qwen3", head_dim=16, vocab_size=VOCAB)
    tok = smollm2_tokenizer().__class__.from_pretrained(path)
    from transformers import AddedToken

    # Not special, as in Qwen3's tokenizer: they stay in the decoded text.
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path
