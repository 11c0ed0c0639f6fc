"""The text files of a model folder imported from a GGUF file.

``tokenizer.json`` (built by :mod:`.tokenizer` from the file's vocabulary),
``config.json`` and ``generation_config.json`` (the geometry and end tokens
as transformers names them), ``tokenizer_config.json`` (special tokens and
the chat template) and ``genai_config.json`` (onnxruntime-genai's
description of the decoder's inputs and outputs), as
:func:`~pagedkv_np.models.gguf.importer.import_gguf` writes them.
"""

from __future__ import annotations

from typing import Any

from ..geometry import DecoderGeometry
from .reader import ARCHITECTURES, GGUFFile, GGUFFormatError
from .tokenizer import tokenizer_json

__all__ = ["text_files"]


def text_files(f: GGUFFile, arch: str, c: DecoderGeometry, family: str, tied: bool
                ) -> dict[str, Any]:
    tokens = f.get("tokenizer.ggml.tokens", kind=list)
    if tokens is None:
        raise GGUFFormatError(f"{f.path!r}: metadata tokenizer.ggml.tokens is missing")
    bos = f.get("tokenizer.ggml.bos_token_id")
    eos = f.get("tokenizer.ggml.eos_token_id")
    pad = f.get("tokenizer.ggml.padding_token_id", eos)
    for what, tid in (("bos", bos), ("eos", eos), ("padding", pad)):
        if tid is not None and not 0 <= tid < len(tokens):
            raise GGUFFormatError(f"{f.path!r}: tokenizer.ggml.{what}_token_id {tid} is "
                                  f"outside the {len(tokens)} tokens")
    if len(tokens) > c.vocab_size:
        raise GGUFFormatError(f"{f.path!r}: {len(tokens)} tokens but an embedding of "
                              f"{c.vocab_size} rows")
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", arch == "llama", kind=bool))
    add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False, kind=bool))
    tokenizer = tokenizer_json(
        model=f.get("tokenizer.ggml.model", "", kind=str),
        pre=f.get("tokenizer.ggml.pre", "gpt-2", kind=str), tokens=tokens,
        token_types=f.get("tokenizer.ggml.token_type", kind=list),
        merges=f.get("tokenizer.ggml.merges", [], kind=list), bos_token_id=bos,
        add_bos_token=add_bos, eos_token_id=eos, add_eos_token=add_eos,
        scores=f.get("tokenizer.ggml.scores", kind=list),
        unknown_token_id=f.get("tokenizer.ggml.unknown_token_id"),
        add_space_prefix=f.get("tokenizer.ggml.add_space_prefix", kind=bool))
    spec = ARCHITECTURES[arch]
    token = lambda tid: None if tid is None else tokens[tid]  # noqa: E731
    config = {
        "architectures": [spec.hf_class], "model_type": spec.model_type,
        "num_hidden_layers": c.num_layers,
        "hidden_size": c.hidden_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "silu" if c.activation == "silu" else "gelu_pytorch_tanh",
        "max_position_embeddings": c.max_positions, "vocab_size": c.vocab_size,
        "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_eps, "bos_token_id": bos,
        "eos_token_id": eos, "tie_word_embeddings": tied, "torch_dtype": "float32",
        "sliding_window": c.sliding_window or None,
        "layer_types": [("sliding" if c.window(i) else "full") + "_attention"
                        for i in range(c.num_layers)],
        "query_pre_attn_scalar": c.query_scale ** -2,
        "final_logit_softcapping": c.final_softcap or None,
        "rope_scaling": ({"rope_type": "linear", "factor": c.rope_scale}
                         if c.rope_scale != 1.0 else None)}
    if c.local_rope:
        config["rope_local_base_freq"] = c.rope_local_theta
    tok_config = {"add_bos_token": add_bos, "add_eos_token": add_eos, "bos_token": token(bos),
                  "eos_token": token(eos), "pad_token": token(pad),
                  "chat_template": f.get("tokenizer.chat_template", kind=str),
                  "model_max_length": c.max_positions, "clean_up_tokenization_spaces": False,
                  "tokenizer_class": "PreTrainedTokenizerFast"}
    decoder_io = {"input_ids": "input_ids", "attention_mask": "attention_mask",
                  "past_key_names": "past_key_values.%d.key",
                  "past_value_names": "past_key_values.%d.value"}
    if family == "optimum":
        decoder_io["position_ids"] = "position_ids"
    genai = {
        "model": {
            "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
            "context_length": c.max_positions, "vocab_size": c.vocab_size,
            "type": spec.genai_type,
            "decoder": {
                "filename": "model.onnx", "session_options": {"provider_options": []},
                "head_size": c.head_dim, "hidden_size": c.hidden_size,
                "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
                "num_hidden_layers": c.num_layers, "inputs": decoder_io,
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"}}},
        "search": {"do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": c.max_positions, "min_length": 0, "no_repeat_ngram_size": 0,
                   "num_beams": 1, "num_return_sequences": 1,
                   "past_present_share_buffer": family == "gqa", "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0}}
    return {"tokenizer.json": tokenizer, "config.json": config,
            "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos,
                                       "pad_token_id": pad},
            "tokenizer_config.json": tok_config, "genai_config.json": genai}
