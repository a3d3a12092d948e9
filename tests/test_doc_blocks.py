"""Every Python code block of the README and of ``docs/`` runs as a reader would run it.

A reader copies a block and runs it; so does this test, one test per block, named
``page:line``. The rules, for whoever writes a page:

* A ```` ```python ```` block runs in this process, in a fresh temporary working
  directory, after the blocks above it on the same page (a page's blocks share one
  namespace; every test replays them from the page's first block, so any block also runs
  alone, ``-k``).
* A reader copies one block, not a page: a block stands alone (it imports and defines every
  name it uses), unless its first line is a comment that starts with ``# continues`` and
  says which block it continues (the reader sees that line too).
* A block whose first line is a comment with ``torchrun --nproc-per-node N`` (say
  ``# torchrun --nproc-per-node 2 sync.py``) is a whole script: it runs on ``N`` processes
  launched with ``python -m torch.distributed.run --nproc-per-node N`` on 127.0.0.1
  (``init_process_group("gloo")`` in the block), and every process must exit with 0.
* A block whose first line is ``# not run: <reason>`` is not run; it is reported as
  skipped with its reason. The reader sees that line too: such a block is a sketch whose
  inputs the page cannot provide (a DeepSpeed checkpoint directory, say); the reason names
  the test that covers its path.
* Shell blocks (``bash``) are install and run commands, not run here: ``.ci/run`` runs the
  install and the test command in a fresh virtual environment, ``tests/test_demo.py`` the
  demo command and ``tests/test_docs.py`` the documentation build.

Tool: the blocks are found with markdown-it-py, the CommonMark parser that MyST renders the
site with (so a block is exactly what a reader sees, on GitHub and on the site), and run by
this module. Sybil, pytest-codeblocks, pytest-examples and mktestdocs were the alternatives:
their markers for "skip" or "continue" are HTML comments that a reader never sees, and none
launches a block on several processes; the rules above fit in this file and keep every
marker in the block itself. A broken block fails ``python -m pytest``, hence ``.ci/run``
(``tests/test_docs.py`` checks that on a temporary broken page).
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from _gloo_pool import free_port

ROOT = Path(__file__).resolve().parents[1]
#: The pages whose blocks run: the README and every Markdown page of the documentation site.
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
LANGUAGES = {"python", "py", "python3"}
TORCHRUN = re.compile(r"^#.*\btorchrun --nproc-per-node (\d+)\b")
NOT_RUN = re.compile(r"^# not run: (\S.*)$")
CONTINUES = re.compile(r"^# continues\b")


@dataclass(frozen=True)
class Block:
    """One fenced Python block: its page, the page line of its first code line, and its code."""

    page: Path
    line: int
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.split("\n", 1)[0].strip()

    @property
    def processes(self) -> int | None:
        """The number of processes of a torchrun block, ``None`` for a block that runs in this process."""
        match = TORCHRUN.match(self.first_line)
        return int(match.group(1)) if match else None

    @property
    def not_run(self) -> str | None:
        """The reason given by a ``# not run: <reason>`` first line, else ``None``."""
        match = NOT_RUN.match(self.first_line)
        return match.group(1) if match else None

    @property
    def continues(self) -> bool:
        """Whether the first line says that the block continues another one (``# continues ...``)."""
        return CONTINUES.match(self.first_line) is not None

    def source(self) -> str:
        """The code padded with blank lines, so that tracebacks give the line numbers of the page."""
        return "\n" * (self.line - 1) + self.code


def blocks_of(page: Path) -> list[Block]:
    """Return the Python blocks of a Markdown page, in page order (MyST ``{code-block} python`` too)."""
    from markdown_it import MarkdownIt

    blocks = []
    for token in MarkdownIt("commonmark").parse(page.read_text(encoding="utf-8")):
        words = token.info.split()
        if token.type != "fence" or not words or token.map is None:
            continue
        directive = words[0] in ("{code-block}", "{code}", "{sourcecode}")
        language = words[1] if directive and len(words) > 1 else words[0]
        if language in LANGUAGES:
            blocks.append(Block(page, token.map[0] + 2, token.content))  # map[0]: the fence line, 0-based
    return blocks


BLOCKS = [block for page in PAGES for block in blocks_of(page)]
#: Blocks on several processes start subprocesses: ``slow``, as the other launches of the suite.
PARAMS = [
    pytest.param(block, id=block.where, marks=[pytest.mark.slow] if block.processes else [])
    for block in BLOCKS
]


def _run_in_process(block: Block) -> None:
    import torch

    namespace: dict[str, object] = {"__name__": "__main__"}
    for earlier in blocks_of(block.page):
        if earlier.processes is not None or earlier.not_run is not None:
            continue  # scripts of their own, or not run
        torch.manual_seed(0)
        code = compile(earlier.source(), str(earlier.page), "exec")
        if earlier == block:
            exec(code, namespace)
            return
        try:
            exec(code, namespace)
        except Exception as error:
            pytest.fail(f"{block.where}: the block above it at {earlier.where} failed: {error!r}")


def _run_on_processes(block: Block, processes: int, workdir: Path) -> None:
    script = workdir / f"{block.page.stem}.py"  # tracebacks name the page (line numbers are the page's)
    script.write_text(block.source(), encoding="utf-8")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), script.name,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(
            f"{block.where}: the block failed on {processes} processes (exit {done.returncode}); run it with "
            f"torchrun --nproc-per-node {processes}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )


@pytest.mark.parametrize("block", PARAMS)
def test_code_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block runs without an error (in this process or on torchrun's processes), unless marked not run."""
    reason = block.not_run
    if reason is not None:
        pytest.skip(f"{block.where}: not run: {reason}")
    processes = block.processes
    if processes is not None:
        _run_on_processes(block, processes, tmp_path)
        return
    monkeypatch.chdir(tmp_path)
    _run_in_process(block)


def free_names(code: str) -> list[str]:
    """Return the names that ``code`` reads but neither imports, defines nor gets from builtins."""
    tree = ast.parse(code)
    defined: set[str] = {"__name__", "__file__"}
    read: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            read.append(node.id)
        elif isinstance(node, ast.Name):
            defined.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    return sorted({name for name in read if name not in defined and not hasattr(builtins, name)})


#: The blocks that run in this process: a reader runs these one at a time.
IN_PROCESS = [block for block in BLOCKS if block.processes is None and block.not_run is None]


@pytest.mark.parametrize("block", IN_PROCESS, ids=[block.where for block in IN_PROCESS])
def test_code_block_stands_alone_or_says_what_it_continues(block: Block) -> None:
    """A block uses only names it imports or defines, unless its first line is ``# continues ...``."""
    if block.continues:
        return
    missing = free_names(block.code)
    assert not missing, (
        f"{block.where}: the block uses {', '.join(missing)} without defining or importing them, so it fails "
        "when a reader copies it alone; add the imports and definitions it needs, or make its first line "
        "'# continues the block above: ...' saying what it takes from there"
    )


def test_free_names_finds_names_from_other_blocks() -> None:
    """The stand-alone check sees a name defined elsewhere, and none for a self-contained block."""
    assert free_names("model = nn.Linear(2, 2)\nprint(x)") == ["nn", "x"]
    assert free_names("import torch\nfrom torch import nn\n\ndef f(a):\n    return nn.Linear(a, a)\n") == []
