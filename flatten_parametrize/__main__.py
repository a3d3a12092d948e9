"""Command line of ``flatten_parametrize``: ``python -m flatten_parametrize demo [--steps N] [--threads N]``.

``demo`` trains a small transformer language model twice, with a flat storage
and without, prints both loss curves, the time per step and the measured gain,
and exits with status 1 if the two runs disagree. Without a command it prints
the help and exits with status 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._demo import THREADS
from ._demo import main as demo_main


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
    demo = commands.add_parser(
        "demo",
        help="train a small transformer LM flattened and plain, side by side, and print the gain",
        description="Train a small transformer language model with and without a flat storage "
        "(same initial weights, same data, in alternating rounds), print both losses, the median "
        "time per step and the gain, and exit with status 1 if the losses disagree.",
    )
    demo.add_argument("--steps", type=_positive, default=60, help="training steps (default: 60)")
    demo.add_argument(
        "--threads",
        type=_positive,
        default=THREADS,
        help=f"torch.set_num_threads for the run (default: {THREADS}: the model is small, and more "
        "threads compete with other work on a 2-core machine)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo":
        return demo_main(args.steps, threads=args.threads)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse refuses unknown ones


if __name__ == "__main__":
    sys.exit(main())
