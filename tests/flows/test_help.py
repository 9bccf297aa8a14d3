"""Every command's --help teaches: each flag says its default or that it is required."""

from __future__ import annotations

import argparse

import pytest

from flows.cli import build_parser


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(prefix: str, node: argparse.ArgumentParser) -> None:
        for action in node._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    found[f"{prefix} {name}".strip()] = child
                    walk(f"{prefix} {name}", child)

    walk("", parser)
    return found


@pytest.mark.parametrize("command", sorted(_commands()))
def test_help_names_defaults_and_required_flags(command: str) -> None:
    parser = _commands()[command]
    text = parser.format_help()
    assert "MISSING" not in text and "object at 0x" not in text, text
    for action in parser._actions:
        if action.required and action.option_strings:
            assert f"{action.option_strings[0]}" in text
            assert "(required)" in (action.help or ""), (command, action.option_strings)
