"""A hypothesis strategy for the codec tests: a valid message with a few bytes changed."""

from __future__ import annotations

from hypothesis import strategies as st

__all__ = ["mutated"]


@st.composite
def _mutate(draw: st.DrawFn, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        letters = [i for i, byte in enumerate(data) if chr(byte).isalnum()]
        match draw(st.sampled_from(["text", "set", "insert", "cut"])):
            case "text" if letters:  # a string's content changes, the structure stays
                data[draw(st.sampled_from(letters))] = draw(st.sampled_from(b"xyz\xff\xc3"))
            case "set" if at < len(data):
                data[at] = draw(st.integers(0, 255))
            case "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=3))
            case _:
                del data[at : at + draw(st.integers(1, 4))]
    return bytes(data)


def mutated(seed: bytes) -> st.SearchStrategy[bytes]:
    """``seed`` with one to three edits: a letter of a string replaced (possibly by a byte that
    breaks UTF-8), a byte set, bytes inserted, bytes cut."""
    return _mutate(seed)
