"""Each message that ``docs/troubleshooting.md`` quotes is one the code can print.

A user searches the page for the start of the message they got, so the quoted starts must
be the real ones. Each quoted message (a paragraph that is one code span,
``ExceptionClass: message start``) must be the start of a string that the package source
can build, f-string and ``str.format`` fields matching any text; the page's section on PyTorch's own messages
is checked against ``torch/nn/modules/module.py``, ``torch/optim/optimizer.py`` and ``torch/_tensor.py``
instead.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "troubleshooting.md"
QUOTE = re.compile(r"^(`+) ?(\w+(?:Error|Warning)): (.+?) ?\1$")
HOLE = object()  # an f-string field: any text


def _templates(paths: list[Path]) -> list[list[object]]:
    """Every string expression of ``paths``: literal parts as ``str``, f-string fields as ``HOLE``."""
    templates = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                # a str.format template ("... for {}:") has fields too
                pieces = re.split(r"\{[^{}]*\}", node.value)
                templates.append([part for piece in pieces for part in (HOLE, piece)][1:])
            elif isinstance(node, ast.JoinedStr):
                parts: list[object] = []
                for value in node.values:
                    is_text = isinstance(value, ast.Constant) and isinstance(value.value, str)
                    parts.append(value.value if is_text else HOLE)
                templates.append(parts)
    return templates


@cache
def _package_templates() -> list[list[object]]:
    return _templates(sorted((ROOT / "flatten_parametrize").rglob("*.py")))


@cache
def _torch_templates() -> list[list[object]]:
    torch_dir = Path(torch.__file__).parent
    return _templates(
        [
            torch_dir / "nn" / "modules" / "module.py",
            torch_dir / "optim" / "optimizer.py",
            torch_dir / "_tensor.py",
        ]
    )


def _starts(template: list[object], text: str) -> bool:
    """Whether ``text`` is the start of a string that ``template`` builds, ending in its literal text."""
    if not text:
        return True
    if not template:
        return False
    head, rest = template[0], template[1:]
    if head is HOLE:  # a field takes some text, and the quote goes on in the literal text after it
        return any(_starts(rest, text[cut:]) for cut in range(len(text)))
    assert isinstance(head, str)
    if text.startswith(head):
        return _starts(rest, text[len(head) :])
    return head.startswith(text)


def _quotes() -> list[tuple[str, str, str]]:
    """``(section, exception class, message start)`` of every quoted message of the page."""
    quotes, section = [], ""
    for line in PAGE.read_text().splitlines():
        if line.startswith(("## ", "### ")):
            section = line.lstrip("#").strip()
        match = QUOTE.match(line.strip())
        if match:
            quotes.append((section, match.group(2), match.group(3)))
    return quotes


def test_the_page_quotes_messages_of_every_kind() -> None:
    """The page quotes errors and warnings of the library (registration, loading, optimizers, ...)."""
    quotes = _quotes()
    assert len(quotes) >= 15, quotes
    kinds = {kind for _, kind, _ in quotes}
    assert {"RuntimeError", "ValueError", "TypeError", "UserWarning"} <= kinds, kinds


def test_every_quoted_message_start_is_one_the_code_prints() -> None:
    """Each quoted start is one the package can print (PyTorch's: torch's module.py or optimizer.py)."""
    missing = []
    for section, kind, text in _quotes():
        templates = _torch_templates() if "PyTorch" in section else _package_templates()
        if not any(_starts(template, text) for template in templates):
            missing.append(f"{kind}: {text}")
    assert not missing, "quoted on docs/troubleshooting.md but printed by no code:\n" + "\n".join(missing)


def test_the_check_refuses_a_message_the_code_does_not_print() -> None:
    """A made-up or misspelt message start fails the check (so the test above can fail)."""
    assert any(_starts(t, "cannot register flat storage: 'blocks.0' already") for t in _package_templates())
    assert not any(
        _starts(t, "cannot register flat storage: blocks.0 is taken") for t in _package_templates()
    )
