"""What of a request's decoded text the client sees, whole or streamed.

The engine stops a request at the token whose text completes a stop string; the
answer's text ends before that string, as OpenAI's and SGLang's do. While a request
streams, text that may still become a stop string, and a trailing U+FFFD (a UTF-8
character whose bytes have not all arrived), are held back until the next token says
what they are. Torch-free, no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type only: this module stays torch-free
    from pdctl.serve.engine.request import FinishReason

REPLACEMENT = "\ufffd"


def stop_matched(finish: FinishReason | None) -> str | None:
    """The stop string that ended a request, if a stop string did."""
    if finish and finish["type"] == "stop" and isinstance(finish.get("matched"), str):
        return str(finish["matched"])
    return None


def visible_text(
    text: str, stops: list[str], finish: FinishReason | None, trim: bool = True
) -> str:
    """`text` as the client may see it now: cut before the matched stop string once
    finished; while running, without a tail that could still start a stop string."""
    if finish is not None:
        matched = stop_matched(finish)
        if trim and matched is not None and matched in text:
            return text[: text.index(matched)]
        return text
    # a stop string already whole: the request's finish is on its way
    end = min([text.index(stop) for stop in stops if stop in text] + [len(text)])
    while end and text[end - 1] == REPLACEMENT:
        end -= 1
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, end), held, -1):
            if text[end - size : end] == stop[:size]:
                held = size
                break
    return text[: end - held]


class TextStream:
    """The deltas of one streamed choice: each call gives what is new since the last."""

    def __init__(self, stops: list[str], trim: bool = True) -> None:
        self.stops, self.trim, self.sent = stops, trim, ""

    def delta(self, text: str, finish: FinishReason | None) -> str:
        shown = visible_text(text, self.stops, finish, self.trim)
        if not shown.startswith(self.sent):  # a held-back character decoded differently
            shown = self.sent
        new, self.sent = shown[len(self.sent) :], shown
        return new
