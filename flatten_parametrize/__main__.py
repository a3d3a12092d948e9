"""Command line of ``flatten_parametrize``: ``python -m flatten_parametrize demo [--steps N]``.

``demo`` trains a small transformer language model twice, with a flat storage
and without, prints both loss curves and the time per step, and exits with
status 1 if the two runs disagree.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``python -m flatten_parametrize``."""
    parser = argparse.ArgumentParser(
        prog="python -m flatten_parametrize",
        description="One contiguous flat storage for the parameters of any nn.Module.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    demo = commands.add_parser(
        "demo",
        help="train a small transformer LM flattened and plain, side by side",
        description="Train a small transformer language model with and without a flat storage "
        "(same initial weights, same data), print both losses and the time per step, and exit "
        "with status 1 if the losses disagree.",
    )
    demo.add_argument("--steps", type=_positive, default=40, help="training steps (default: 40)")
    demo.add_argument(
        "--threads", type=_positive, default=2, help="torch.set_num_threads for the run (default: 2)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from ._demo import main as demo_main

        return demo_main(args.steps, threads=args.threads)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse refuses unknown ones


if __name__ == "__main__":
    sys.exit(main())
