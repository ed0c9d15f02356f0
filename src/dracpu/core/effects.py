"""Effects: the I/O the state owner performs after a command was applied (design §3).

``apply(state, command) -> (state, effects)`` is pure; the state owner executes the effects in
order. :class:`Reply` is special: its value goes back to the requester's one-shot reply stream.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Reply"]


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer the command's requester with ``value`` (a result object or a DracpuError)."""

    value: object
