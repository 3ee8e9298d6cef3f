"""Command line: ``specdec generate``, ``specdec serve``, ``specdec demo``, ``specdec convert``,
``specdec train-draft`` (specdec/training/command.py) and ``specdec draft-vocab`` (specdec/training/vocab_command.py)
(also ``python -m specdec``).

The sampling options of ``generate`` take their defaults from the fields of :class:`specdec.SamplingParams`
(and ``--num-speculative-tokens`` from :class:`specdec.SpeculativeConfig`), so the CLI and the Python API
always agree. Arguments are validated before any model is loaded: a bad value fails at once with
``error: ...`` and exit code 2; Ctrl-C exits with 130 and no traceback.

The parser is parser.py; the commands behind it are commands.py (``train-draft`` and ``draft-vocab`` live with
the training code).
"""

from __future__ import annotations

import argparse
import sys

from specdec.cli import commands
from specdec.cli.parser import build_parser, sampling_defaults, sampling_params, speculative_config
from specdec.training import command as train_command
from specdec.training import vocab_command

__all__ = ["main", "build_parser", "sampling_defaults", "sampling_params", "speculative_config"]

EXIT_USAGE = 2  # bad arguments or input files (argparse's own code)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad arguments or input, 130 interrupted)."""
    args: argparse.Namespace = build_parser().parse_args(argv)
    run = {"generate": commands.generate, "serve": commands.serve, "demo": commands.demo, "convert": commands.convert,
           "train-draft": train_command.run, "draft-vocab": vocab_command.run}
    try:
        return run[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED

