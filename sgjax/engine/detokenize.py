"""Incremental detokenization and stop strings: how streamed text stays exact.

The engine streams a request's text as its tokens arrive, so it needs, per step, just the new text, at O(1) cost
per token, and the pieces must add up to exactly `tokenizer.decode(all_ids)`. A byte-level BPE token can end in the
middle of a UTF-8 character (emoji, CJK, accents take 2-4 bytes), so decoding tokens one at a time would emit U+FFFD
replacement characters and lose text. `IncrementalDecoder` decodes a small window of recent tokens instead and
holds back a trailing U+FFFD run until the character completes.

Stop strings can span several tokens, so `StopMatcher` holds back any tail that might still become a stop string
and releases it once it cannot; the text a client sees never contains (a prefix of) a stop string that later
completes, whatever the chunking.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Streams the text of a growing list of output token ids.

    The prefix_offset/read_offset scheme (as in SGLang and vLLM): `ids[prefix:read]` is the window of tokens
    already emitted that gives the new tokens their context; the new text is decode(ids[prefix:]) minus
    decode(ids[prefix:read]).
    When the new text ends cleanly both offsets move forward (prefix to read, read to the end), so every decode
    covers only a few tokens: O(1) per token. When it ends with U+FFFD (the decoder's marker for a UTF-8 sequence that
    is incomplete so far), the offsets stay, the text before the trailing U+FFFD run is emitted (it can no longer
    change) and the run is held back until later tokens complete it. Only ids that really are invalid UTF-8 keep a
    window growing, and only for as long as the text keeps ending in U+FFFD.

    The concatenation of all pushed chunks plus flush() equals tokenizer.decode(all_ids, skip_special_tokens=...):
    for byte-level decoders a clean end means no pending bytes, so decoding on from there equals the tail of the full
    decode, and the lossy UTF-8 decoder never revises anything but its final U+FFFD.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read]: context window, its text already emitted
        self._read = 0  # ids[_read:]: tokens whose text is (partly) held back
        self._prefix_text = ""  # decode(ids[_prefix:_read])
        self._held_emitted = 0  # characters of decode(ids[_read:]) emitted already (before a U+FFFD run)
        self._chunks: list[str] = []

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _pending(self) -> str:
        """The text of ids[_read:] not emitted yet."""
        full = self._decode(self.ids[self._prefix :])
        return full[len(self._prefix_text) + self._held_emitted :]

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Append token ids; return the newly stable text (possibly empty)."""
        if isinstance(token_ids, numbers.Integral):
            self.ids.append(token_ids)
        else:
            self.ids.extend(int(t) for t in token_ids)
        if self._read == len(self.ids):
            return ""
        new = self._pending()
        if new and not new.endswith(REPLACEMENT):
            self._prefix_text = self._decode(self.ids[self._read :])
            self._prefix, self._read, self._held_emitted = self._read, len(self.ids), 0
        else:  # empty or incomplete: emit what is before the trailing U+FFFD run, keep the offsets
            new = new.rstrip(REPLACEMENT)
            self._held_emitted += len(new)
        if new:
            self._chunks.append(new)
        return new

    def flush(self) -> str:
        """Whatever is held back (it ends in U+FFFD only if the ids really are broken); the stream is then clean."""
        if self._read == len(self.ids):
            return ""
        new = self._pending()
        self._prefix_text = self._decode(self.ids[self._read :])
        self._prefix, self._read, self._held_emitted = self._read, len(self.ids), 0
        if new:
            self._chunks.append(new)
        return new

    @property
    def text(self) -> str:
        """All text emitted so far (pushes and flushes)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""


REGEX_WINDOW = 2048  # characters of output a stop regex can match within


class StopMatcher:
    """Finds stop strings in streamed text, also when a stop string spans several tokens/chunks.

    feed(new_text) -> (safe_text, matched). safe_text can be emitted now: it excludes any tail that could still be
    the beginning of a stop string (held back). When a stop string completes, safe_text ends right before it (or
    includes it when no_stop_trim), anything after it is dropped, and matched is the stop string; the matcher is then
    done and feeds return ("", None). When several stops occur, the one that completes first in the text wins (the
    longest of those completing at the same character), so the result does not depend on how the text was chunked.
    finish() returns the held-back text, for when generation ends for another reason.
    """

    def __init__(self, stops: Sequence[str], no_stop_trim: bool = False, stop_regex: Sequence[str] = ()):
        if isinstance(stops, str):
            stops = (stops,)
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self.regexes = tuple(re.compile(p) for p in dict.fromkeys(stop_regex))
        self.no_stop_trim = no_stop_trim
        self.matched: str | None = None
        self.done = False
        self._buf = ""  # held-back text; never contains a complete stop string
        self._tail = ""  # the last REGEX_WINDOW characters fed, where stop regexes are searched

    def feed(self, new_text: str) -> tuple[str, str | None]:
        if self.done:
            return "", None
        if self.regexes:
            # SGLang's stop_regex: a search in the output's tail after each token; the text is kept whole (no trim)
            self._tail = (self._tail + new_text)[-REGEX_WINDOW:]
            for rx in self.regexes:
                if rx.search(self._tail):
                    out, self._buf = self._buf + new_text, ""
                    self.matched, self.done = rx.pattern, True
                    return out, rx.pattern
        if not self.stops:
            return new_text, None
        buf = self._buf + new_text
        best = None  # (end, start, stop): the first to complete, then the longest
        for stop in self.stops:
            start = buf.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key < best:
                    best = key
        if best is not None:
            end, start, stop = best
            self.matched, self.done, self._buf = stop, True, ""
            return buf[: end if self.no_stop_trim else start], stop
        hold = self._held_len(buf)
        self._buf = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def _held_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def finish(self) -> str:
        """The held-back text (the stream ended without a match); the matcher is then done."""
        out, self._buf, self.done = self._buf, "", True
        return out
