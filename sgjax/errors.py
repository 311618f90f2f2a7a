"""Errors that carry what went wrong as data: the field it is about (the engine's name for it) and its kind.

Callers branch on `kind` and `field`, never on message text: the HTTP server maps a client error to a 400 naming its
API field (renamed and prefixed per route), a shutdown to a 503, anything else to a 500.
"""

from __future__ import annotations

CLIENT, SHUTDOWN, INTERNAL = "client", "shutdown", "internal"


class SgjaxError(Exception):
    kind = INTERNAL

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    @property
    def reason(self) -> str:
        """The message without its field in front ("must be >= 0, got -1.0" of "temperature must be >= 0, got
        -1.0"), or the whole message when the field is part of a sentence."""
        msg, f = str(self), self.field
        if f and msg.startswith(f + ": "):
            return msg[len(f) + 2 :]
        if f and msg.startswith(f + " must "):
            return msg[len(f) + 1 :]
        return msg


class RequestError(SgjaxError, ValueError):
    """The request is wrong (a 400): `field` names what, in the engine's terms ("prompt" is the prompt itself)."""

    kind = CLIENT


class EngineError(SgjaxError, RuntimeError):
    """The engine cannot serve the request: it is shut down (kind SHUTDOWN, a 503) or a step failed (INTERNAL)."""

    def __init__(self, message: str, kind: str = SHUTDOWN):
        super().__init__(message)
        self.kind = kind


# An abort's finish reason carries an HTTP-style status, as SGLang's FINISH_ABORT does: what failed the request.
ABORT_STATUS = {CLIENT: 400, SHUTDOWN: 503, INTERNAL: 500}
