"""``dracpu run``'s flags, spelled as Go's ``flag`` package takes them (upstream's binary), built
from the settings table.

``-name`` or ``--name``, ``=value`` or a separate value, a boolean alone means true
(:func:`go_style_flags` turns the single-dash long form into argparse's). No flag has a default:
an absent flag is absent from the namespace, so only flags given explicitly override the config
file (upstream's ``driverconfig.FromFlags`` does the same with ``flag.Visit``). The parser notes
the spellings given, in order (:data:`GIVEN_FLAGS`), for the deprecation notices.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType

from dracpu.config.settings import SETTINGS, Setting
from dracpu.config.values import go_bool

__all__ = ["DEPRECATED_FLAGS", "GIVEN_FLAGS", "add_run_arguments", "go_style_flags"]

# Where the parser notes the flags given, in order and as spelled.
GIVEN_FLAGS = "given_flags"

# The flags upstream deprecated, each with the config-file key that replaces it.
DEPRECATED_FLAGS: Mapping[str, str] = MappingProxyType(
    {flag: str(s.key) for s in SETTINGS for flag in s.deprecated}
)


class _StoreAction(argparse.Action):
    """``--flag value`` / ``--flag=value``; notes the spelling used. Subclasses convert the
    value (:meth:`value`)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        if option_string is not None:
            given: list[str] = namespace.__dict__.setdefault(GIVEN_FLAGS, [])
            given.append(option_string)
        setattr(namespace, self.dest, self.value(namespace, values))

    def value(self, namespace: argparse.Namespace, values: str | Sequence[object] | None) -> object:
        return values


class _GoBoolAction(_StoreAction):
    """A Go-style boolean flag: ``--flag`` is true, ``--flag=false`` / ``--flag=true`` as given."""

    def value(self, namespace: argparse.Namespace, values: str | Sequence[object] | None) -> object:
        if values is None:
            return True
        try:
            return go_bool(str(values))
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from exc


class _VerbosityAction(_StoreAction):
    """klog's ``-v=N`` / ``--v=N`` / ``-v N``, and also ``-v``, ``-vv``, ... counting up."""

    def value(self, namespace: argparse.Namespace, values: str | Sequence[object] | None) -> object:
        current: int = getattr(namespace, self.dest, 0)
        if values is None:
            return current + 1
        if isinstance(values, str) and values and set(values) == {"v"}:  # -vv arrives as "v"
            return current + 1 + len(values)
        if isinstance(values, str) and values.isascii() and values.isdigit():
            return int(values)
        raise argparse.ArgumentError(self, f"invalid verbosity {values!r}: use a number >= 0")


_ACTIONS: Mapping[str, type[_StoreAction]] = MappingProxyType(
    {"value": _StoreAction, "bool": _GoBoolAction, "count": _VerbosityAction}
)


def _add(parser: argparse.ArgumentParser, s: Setting) -> None:
    optional = {"nargs": "?"} if s.takes != "value" else {}
    parser.add_argument(
        *s.flags,
        dest=s.name,
        action=_ACTIONS[s.takes],
        default=argparse.SUPPRESS,
        metavar=s.metavar,
        help=s.help_text().replace("%", "%%"),  # argparse formats help with %
        **optional,  # type: ignore[arg-type]
    )


def add_run_arguments(parser: argparse.ArgumentParser) -> frozenset[str]:
    """Add ``--config`` and every setting's flags to ``parser``; none has a default (see the
    module docstring). Returns the long option strings (``--name``), for
    :func:`go_style_flags`."""
    parser.add_argument(
        "--config",
        action=_StoreAction,
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="YAML config file (upstream's keys and ours, docs/upstream-compatibility.md); "
        "empty: none",
    )
    for s in SETTINGS:
        if s.flags:
            _add(parser, s)
    return frozenset(
        option
        for action in parser._actions  # the public API has no list of the options added
        for option in action.option_strings
        if option.startswith("--")
    )


def go_style_flags(argv: Sequence[str], long_flags: Collection[str]) -> list[str]:
    """``argv`` with Go's single-dash long flags (``-kubeconfig x``, ``-v=4``,
    ``-vmodule=a=2``) written with two dashes, as argparse takes them.

    Only a word whose name (before any ``=``) is one of ``long_flags`` without its dashes is
    rewritten; everything after ``--`` is left alone, like any other word.
    """
    out: list[str] = []
    rest = iter(argv)
    for word in rest:
        if word == "--":
            out.append(word)
            out.extend(rest)
            break
        if word.startswith("-") and not word.startswith("--"):
            name = word[1:].partition("=")[0]
            if f"--{name}" in long_flags:
                word = "-" + word
        out.append(word)
    return out
