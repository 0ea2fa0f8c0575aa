"""The built-in ``demo`` model: a tiny Llama with seeded random weights and a
byte-level BPE tokenizer trained offline on a built-in text, written once as a
normal Hugging Face checkpoint directory under the user's cache.

Same files on every machine: numpy's PCG64 stream is platform-independent and
BPE training on a fixed corpus is deterministic. Weights are scaled so greedy
decoding has large top-1/top-2 logit gaps (stable under float32 noise).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from jaxserve.config import cache_root

DEMO_VERSION = "v3"
DEMO_VOCAB = 512
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": DEMO_VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}

# ChatML with Hermes-style tools: tool definitions in the system turn, calls as
# <tool_call>{json}</tool_call>, results as "tool" turns.
CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{% endif %}"
    "{{ 'You may call tools. Tools: ' + (tools | tojson) + '\\n' }}"
    "{{ 'Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message.get('content') %}{{ message['content'] }}{% endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set args = call['function']['arguments'] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- args if args is string else args | tojson }}{{ '}</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The engine decodes a request, hits an API call, waits, gets tokens back and continues.
While it waits, its KV cache stays on the accelerator, is dropped and recomputed later,
or is copied to host memory and back. A calculator returns 42; a search returns a page.
Hello, world! How are you today? I am fine, thank you. What is 2 + 3 * (4 - 1)?
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Tools: {"name": "calculator", "arguments": {"expression": "12 * 7"}} returns 84.
def add(a, b):\n    return a + b\nprint(add(1, 2))\n
Once upon a time there was a small model that served many requests at once.
user: hi\nassistant: hello! system: you are a helpful assistant.
0123456789 + - * / ( ) = . , ; : ? ! ' " [ ] { } < > _ # @ % & | ~
"""


def demo_dir() -> Path:
    """The demo checkpoint directory, written on first use (atomically)."""
    root = cache_root()
    path = root / f"demo-{DEMO_VERSION}"
    if (path / "model.safetensors").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".demo-"))
    try:
        write_demo_checkpoint(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_tokenizer():
    """Byte-level BPE with ``DEMO_VOCAB`` entries, trained on ``CORPUS``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from jaxserve.hf_import import quiet_transformers

    PreTrainedTokenizerFast = quiet_transformers().PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=DEMO_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[1], additional_special_tokens=SPECIAL_TOKENS[2:], chat_template=CHAT_TEMPLATE)


def demo_weights(config: dict, vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random weights in Hugging Face naming; embeddings and head scaled up
    so logits are far apart."""
    rng = np.random.Generator(np.random.PCG64(seed))
    h, i = config["hidden_size"], config["intermediate_size"]
    nh, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def mat(rows, cols, scale):
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(vocab_size, h, 1.0),
         "model.norm.weight": np.ones(h, np.float32),
         "lm_head.weight": mat(vocab_size, h, 4.0 / np.sqrt(h))}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "self_attn.q_proj.weight"] = mat(nh * d, h, 1.0 / np.sqrt(h))
        w[p + "self_attn.k_proj.weight"] = mat(nkv * d, h, 1.0 / np.sqrt(h))
        w[p + "self_attn.v_proj.weight"] = mat(nkv * d, h, 1.0 / np.sqrt(h))
        w[p + "self_attn.o_proj.weight"] = mat(h, nh * d, 0.5 / np.sqrt(nh * d))
        w[p + "mlp.gate_proj.weight"] = mat(i, h, 1.0 / np.sqrt(h))
        w[p + "mlp.up_proj.weight"] = mat(i, h, 1.0 / np.sqrt(h))
        w[p + "mlp.down_proj.weight"] = mat(h, i, 0.5 / np.sqrt(i))
    return w


def write_demo_checkpoint(path: Path) -> None:
    from safetensors.numpy import save_file

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(path)
    config = dict(DEMO_CONFIG)
    config["vocab_size"] = len(tokenizer)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(demo_weights(config, config["vocab_size"]), str(path / "model.safetensors"))
