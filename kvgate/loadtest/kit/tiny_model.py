"""A tiny Llama model directory vLLM serves offline with random weights (`--load-format dummy`), generated here the
same every run: a byte-level BPE tokenizer trained on the standard library's sources, a Llama-3-style chat
template and a two-layer config. It serves vLLM and any kvgate component that must tokenize as vLLM does.

Run: python -m kvgate.loadtest.kit.tiny_model DIR"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 4096
MAX_MODEL_LEN = 4096
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
_SPECIAL = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama-3-style: the template emits BOS itself (vLLM tokenizes chat prompts without special tokens).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools: {{ tools | tojson }}<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _corpus() -> list[str]:
    """The standard library's top-level sources in name order: English prose and code, already on every machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [path.read_text(encoding="utf-8", errors="replace") for path in sorted(stdlib.glob("*.py"))]


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    return tokenizer.to_str()


def _model_config(vocab_size: int, bos_id: int, eos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": MAX_MODEL_LEN, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": bos_id, "eos_token_id": eos_id,
    }  # fmt: skip


def write_tiny_model(directory: Path) -> Path:
    """Write the model directory (config, tokenizer, chat template) into `directory` once; the same bytes every run."""
    if (directory / "generation_config.json").exists():  # written last
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_text = _tokenizer_json()
    vocab = json.loads(tokenizer_text)["model"]["vocab"]  # special tokens included
    specials = {token["content"]: token["id"] for token in json.loads(tokenizer_text)["added_tokens"]}
    files = {
        "tokenizer.json": tokenizer_text,
        "tokenizer_config.json": json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
            "model_max_length": MAX_MODEL_LEN, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        }, indent=1),
        "special_tokens_map.json": json.dumps({"bos_token": BOS, "eos_token": EOS}, indent=1),
        "config.json": json.dumps(_model_config(len(vocab), specials[BOS], specials[EOS]), indent=1),
        "generation_config.json": json.dumps({"bos_token_id": specials[BOS], "eos_token_id": specials[EOS]}),
    }  # fmt: skip
    for name, text in files.items():
        (directory / name).write_text(text)
    return directory


if __name__ == "__main__":
    print(write_tiny_model(Path(sys.argv[1])))
