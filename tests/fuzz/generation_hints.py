"""Plausible values for ``warmserve.v1.Generation`` requests to a tiny model with a word-level
tokenizer (token ``i`` is the word ``w{i}``), mixed into the fuzz so that some requests reach
the engine and generate (test helper for ``tests/fuzz``)."""

from __future__ import annotations

from hypothesis import strategies as st

#: Words of the tiny vocabulary, an unknown word and special-token markup.
WORDS = st.lists(st.sampled_from(("w1", "w2", "w17", "w95", "zzz", "<|im_end|>", "w3")), max_size=12).map(" ".join)

GENERATION_HINTS = {
    "warmserve.v1.GenerateRequest.text": WORDS,
    "warmserve.v1.ChatMessage.role": st.sampled_from(("user", "system", "assistant", "tool", "")),
    "warmserve.v1.ChatMessage.content": WORDS,
    "warmserve.v1.TokenIds.ids": st.integers(-2, 130),
    "warmserve.v1.SamplingParams.max_tokens": st.integers(-1, 70),
    "warmserve.v1.SamplingParams.default_max_tokens": st.integers(-1, 70),
    "warmserve.v1.SamplingParams.temperature": st.sampled_from((0.0, 0.7, 1.5, -0.1)),
    "warmserve.v1.SamplingParams.top_k": st.integers(-1, 200),
    "warmserve.v1.SamplingParams.top_p": st.sampled_from((0.0, 0.5, 1.0, 1.01, -0.5)),
    "warmserve.v1.SamplingParams.stop": st.sampled_from(("w2", "", "w", " ")),
    "warmserve.v1.SamplingParams.stop_token_ids": st.integers(-1, 130),
    "warmserve.v1.SamplingParams.logprobs": st.integers(-1, 25),
    "warmserve.v1.SamplingParams.presence_penalty": st.sampled_from((0.0, 1.5, -2.0, 2.5, float("nan"))),
    "warmserve.v1.SamplingParams.frequency_penalty": st.sampled_from((0.0, -1.0, 2.0, -2.5)),
    "warmserve.v1.SamplingParams.repetition_penalty": st.sampled_from((1.0, 1.3, 0.0, 2.5)),
    "warmserve.v1.SamplingParams.LogitBiasEntry.key": st.integers(-1, 130),
    "warmserve.v1.SamplingParams.LogitBiasEntry.value": st.sampled_from((100.0, -100.0, 1.5, 100.5)),
    "warmserve.v1.SamplingParams.min_tokens": st.integers(0, 70),
    "warmserve.v1.SamplingParams.n": st.integers(0, 6),  # 5, 6: above the fuzz runner's max_num_seqs
    "warmserve.v1.GenerateRequest.routing": st.integers(-1, 4),
    # structured output and tools: valid, invalid and expensive forms (the fuzz runner's word-level
    # tokenizer makes every constraint INVALID_ARGUMENT, which must still be all that happens)
    "warmserve.v1.StructuredOutput.regex": st.sampled_from(("w[0-9]", "(", "a{1000}{1000}", "", "(a|a)*b")),
    "warmserve.v1.StructuredOutput.json_schema": st.sampled_from(('{"type": "object"}', '{"type": "nope"}', "[", "",
                                                                  '{"$ref": "#"}')),
    "warmserve.v1.StructuredOutput.grammar": st.sampled_from(('start: "w1"', "root ::= ", "", 'root ::= "w1"')),
    "warmserve.v1.ChoiceList.choices": st.sampled_from(("w1", "", "w2 w3")),
    "warmserve.v1.ToolCall.arguments": st.sampled_from(('{"a": 1}', "{", "[]", "", "<|im_end|>")),
    "warmserve.v1.Tool.parameters": st.sampled_from(('{"type": "object"}', "[1]", "{", "")),
    "warmserve.v1.Tool.name": st.sampled_from(("f", "", "<|im_start|>")),
}
