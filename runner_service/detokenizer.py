"""Incremental detokenization for streaming, with stop strings.

Byte-level BPE tokens may split a UTF-8 character, so text is produced the way vLLM's
``detokenize_incrementally`` does: decode ``ids[prefix:]`` and ``ids[prefix:read]``; the new
text is the difference, emitted only when it does not end in U+FFFD (an incomplete character).

Stop strings: after each token the new text is searched (from a window that can straddle the
previous text); on a match the output is cut just before the stop string. While streaming, the
last ``max(len(stop)) - 1`` characters are held back so a stop string split over tokens is never
sent; they are released by :meth:`IncrementalDetokenizer.flush`.
"""

from __future__ import annotations

from runner_service.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Accumulates one request's output text. ``tokenizer=None`` yields empty text (token-only use)."""

    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._sent = 0
        self.stopped = False

    def push(self, token_id: int) -> bool:
        """Add one generated token; returns True when a stop string completed (the text is then
        cut before it and later pushes are ignored)."""
        if self.stopped or self._tok is None:
            return False
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        new_text = self._tok.decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        before = len(self.text)
        self.text += new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        if self.stop:
            start = max(0, before - self._hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        return self.stopped

    def delta(self) -> str:
        """Text not yet sent, minus the hold-back tail while a stop string could still match."""
        end = len(self.text) if self.stopped else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent:end]
        self._sent = end
        return out

    def flush(self) -> str:
        """All text not yet sent (call once the request has finished). An incomplete character at
        the very end (``max_tokens`` cut a multi-byte character) is not emitted as U+FFFD: its
        bytes stay only in the token ids. (A model that ends on a genuine U+FFFD character loses
        it from the text too; the ids keep it.)"""
        if self._tok is not None and not self.stopped and self._read < len(self._ids):
            prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
            self.text += self._tok.decode(self._ids[self._prefix:])[len(prefix_text):].rstrip("\ufffd")
            self._prefix = self._read = len(self._ids)
        out = self.text[self._sent:]
        self._sent = len(self.text)
        return out
