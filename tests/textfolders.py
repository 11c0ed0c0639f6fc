"""Model folders for the text tests, built here: a real byte-level BPE tokenizer
trained on a little text, and seeded random decoders from ``testmodel``.

``optimum_folder`` writes what an optimum export holds, ``genai_folder`` what
the onnxruntime-genai builder writes (``genai_config.json``, a graph whose
past/present head size is symbolic, weights in external data).
"""

from __future__ import annotations

import json
import os

import onnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedkv_np.models.testmodel import DecoderConfig, build_model

VOCAB = 300
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2        # <|im_start|>, <|im_end|>
CONTEXT = 512
CONFIG = DecoderConfig(vocab_size=VOCAB)

CHATML = ("{% for message in messages %}"
          "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Hello world! How are you today? I am fine, thank you.",
    "日本語のテキストと中文文本。東京は日本の首都です。",
    "Emoji: 😀 🎉 🚀 ❤️ and café, naïve, Straße.",
    "def f(x):\n    return x * 2  # numbers 12345",
] * 10

_TOKENIZER: list = []


def tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer of ``VOCAB`` ids (specials 0-2, the 256 bytes,
    then merges), trained once."""
    if not _TOKENIZER:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(CORPUS, trainer)
        assert tok.get_vocab_size() == VOCAB
        assert [tok.token_to_id(s) for s in SPECIAL] == [0, BOS_ID, EOS_ID]
        _TOKENIZER.append(tok)
    return Tokenizer.from_str(_TOKENIZER[0].to_str())


def write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def write_tokenizer(folder: str, *, chat_template=CHATML, bos_token="<|im_start|>",
                    eos_token="<|im_end|>", **extra) -> None:
    tokenizer().save(os.path.join(folder, "tokenizer.json"))
    config = dict(bos_token=bos_token, eos_token=eos_token, add_bos_token=False, **extra)
    if chat_template is not None:
        config["chat_template"] = chat_template
    write_json(os.path.join(folder, "tokenizer_config.json"), config)


def hf_config(**overrides) -> dict:
    c = CONFIG
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama",
                  hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                  num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  vocab_size=c.vocab_size, max_position_embeddings=CONTEXT,
                  bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    config.update(overrides)
    return {k: v for k, v in config.items() if v is not None}


def optimum_folder(folder, *, family: str = "optimum", config: dict | None = None,
                   generation: dict | None = None, **tokenizer_kw) -> str:
    """An optimum-export folder; ``config`` entries override config.json's
    (None removes one)."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    onnx.save_model(build_model(CONFIG, family=family), os.path.join(folder, "model.onnx"))
    write_json(os.path.join(folder, "config.json"), hf_config(**(config or {})))
    write_json(os.path.join(folder, "generation_config.json"),
               generation if generation is not None else {"eos_token_id": [EOS_ID]})
    write_tokenizer(folder, **tokenizer_kw)
    return folder


def symbolic_kv_dims(model: onnx.ModelProto, heads: bool = False) -> onnx.ModelProto:
    """The model with past/present head size (and K/V heads, if asked)
    symbolic, as builder graphs declare them."""
    for arg in list(model.graph.input) + list(model.graph.output):
        if arg.name.startswith(("past_key_values.", "present.")):
            dims = arg.type.tensor_type.shape.dim
            dims[3].ClearField("dim_value")
            dims[3].dim_param = "kv_cache_dim"
            if heads:
                dims[1].ClearField("dim_value")
                dims[1].dim_param = "kv_heads"
    return model


def genai_config(**decoder_overrides) -> dict:
    c = CONFIG
    decoder = dict(filename="model.onnx", head_size=c.head_dim, hidden_size=c.hidden_size,
                   num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                   num_hidden_layers=c.num_layers)
    decoder.update(decoder_overrides)
    decoder = {k: v for k, v in decoder.items() if v is not None}
    return {"model": {"type": "llama", "context_length": CONTEXT, "bos_token_id": BOS_ID,
                      "eos_token_id": EOS_ID, "pad_token_id": EOS_ID,
                      "vocab_size": c.vocab_size, "decoder": decoder},
            "search": {"max_length": CONTEXT}}


def genai_folder(folder, *, heads_symbolic: bool = False, filename: str = "model.onnx",
                 **decoder_overrides) -> str:
    """An onnxruntime-genai folder: GroupQueryAttention graph with a symbolic
    head size, weights in ``<filename>.data``."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    model = symbolic_kv_dims(build_model(CONFIG, family="gqa"), heads=heads_symbolic)
    onnx.save_model(model, os.path.join(folder, filename), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=filename + ".data",
                    size_threshold=1024)
    write_json(os.path.join(folder, "genai_config.json"),
               genai_config(filename=filename, **decoder_overrides))
    write_tokenizer(folder)
    return folder
