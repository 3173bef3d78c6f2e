"""Make a tiny causal language model offline: random weights, a tokenizer built here, and a
chat template. For tests, benchmarks and the quick start; nothing is downloaded.

    trainyard make-tiny-model var/tiny-model
"""

from __future__ import annotations

import json
from pathlib import Path

# A small word-level vocabulary: enough to chat about arithmetic and the weather.
WORDS = [
    "yes",
    "no",
    "maybe",
    "hello",
    "hi",
    "the",
    "a",
    "is",
    "it",
    "what",
    "who",
    "how",
    "why",
    "when",
    "where",
    "answer",
    "question",
    "sum",
    "of",
    "and",
    "plus",
    "minus",
    "times",
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "sunny",
    "rainy",
    "cloudy",
    "windy",
    "warm",
    "cold",
    "weather",
    "today",
    "city",
    "search",
    "tool",
    "result",
    "ok",
    "thanks",
    "please",
    "say",
    "word",
    "you",
    "i",
    "we",
    "they",
    "good",
    "bad",
    "right",
    "wrong",
    "true",
    "false",
]
SPECIAL = [
    "<pad>",
    "<unk>",
    "<s>",
    "</s>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
]
PUNCTUATION = list(".,?!:;'\"()[]{}+-*/=0123456789")

# Each message is a role marker, its words, and an end marker; generation starts after the
# assistant marker and stops at <|end|> (the model's end-of-turn token). Tools offered are
# listed in a system turn first, and an assistant turn's tool calls follow its words, both
# in the Hermes/Qwen convention (`<tools>` and `<tool_call>` blocks of JSON), which
# `app.backends.tool_calls` parses back.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|> ' }}"
    "{% for tool in tools %}{{ '<tools> ' + (tool | tojson) + ' </tools> ' }}{% endfor %}"
    "{{ '<|end|> ' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set arguments = call['function']['arguments'] %}"
    "{{ ' <tool_call> {\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ (arguments if arguments is string else arguments | tojson) + '} </tool_call>' }}"
    "{% endfor %}"
    "{{ ' <|end|> ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)


def make_tiny_model(
    path: str | Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    initializer_range: float = 0.2,
    seed: int = 0,
) -> Path:
    """Write a tiny Llama-architecture model with random weights to `path`; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from app.backends.seeding import seeded

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIAL + PUNCTUATION + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="<|end|>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL[4:8],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["<|end|>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    with seeded(seed):
        model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    (path / "trainyard.json").write_text(json.dumps({"made_by": "trainyard make-tiny-model"}))
    return path
