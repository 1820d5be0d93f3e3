"""The real-model prompts shared by the greedy-text tests (tests/runner/test_runner_real_model.py,
tests/families/test_llama_quantized_model.py)."""

TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 1, 2, 3, 5, 8,",
    "Photosynthesis is the process by which",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "user", "content": "Translate 'good morning' to French."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about cats."}],
]
#: Chats whose answers copy spans of the prompt (quoting, editing code): where prompt-lookup
#: drafts are right (tests/runner/test_runner_speculative_real_model.py, bench/decode.py).
COPY_CHATS = [
    [{"role": "user", "content": "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog "
                                 "near the quiet river bank every morning."}],
    [{"role": "user", "content": "Rename the variable x to total in this code:\n\ndef add(x, y):\n"
                                 "    x = x + y\n    return x\n"}],
    [{"role": "user", "content": "Fix the typo and repeat the list: apples, bananas, cherries, grapse, "
                                 "oranges, pears, plums."}],
]
