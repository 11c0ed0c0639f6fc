"""Text around a decoder: the tokenizer and chat-template codec
(:mod:`.codec`) and the streaming detokenizer with stop strings
(:mod:`.streaming`).

Needs the ``models`` extra (``tokenizers``, ``jinja2``). Nothing here knows
of the cache or the engine.
"""
