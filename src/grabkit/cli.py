"""The ``grabkit`` command line (also ``python -m grabkit``).

Subcommands:

* ``demo``: GraB orderings against random reshuffling on scikit-learn's digits (see
  ``grabkit.demo``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["build_parser", "main"]

# defaults, repeated from grabkit.demo.DemoOptions so --help works without the demo extras
_DEMO_DEFAULTS = {
    "epochs": 8,
    "seeds": 3,
    "orderings": "rr,mean,pair",
    "models": "logreg,mlp",
    "batch_size": 16,
    "lr": 0.1,
    "out": "grabkit-demo.png",
}
_DEMO_ORDERING_HELP = (
    "rr (random reshuffling), so (shuffle once), swr (with replacement), fixed, mean (vanilla "
    "GraB), pair, recursive, recursive-pair, batch, ema, norm, flipflop"
)


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grabkit",
        description=(
            "grabkit: gradient statistics that decide example order (GraB), batch grouping, "
            "when to step, and the gradient noise scale."
        ),
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="GraB orderings vs random reshuffling on scikit-learn's digits (about a minute)",
        description=(
            "Train logistic regression and a small MLP on scikit-learn's bundled digits with "
            "random reshuffling and GraB orderings, for several epochs and seeds. Prints a "
            "per-epoch table (train loss, test accuracy, herding bound, seconds; means over the "
            'seeds) and writes a PNG of the curves. Needs: pip install "grabkit[demo]".'
        ),
    )
    d = _DEMO_DEFAULTS
    default = " (default: %(default)s)"
    demo.add_argument("--epochs", type=int, default=d["epochs"], help="epochs per run" + default)
    demo.add_argument(
        "--seeds",
        type=int,
        default=d["seeds"],
        help="number of seeds (0, 1, ...) per ordering; lines and table are means" + default,
    )
    demo.add_argument(
        "--orderings",
        default=d["orderings"],
        help=f"comma-separated orderings to compare, from: {_DEMO_ORDERING_HELP}" + default,
    )
    demo.add_argument(
        "--models",
        default=d["models"],
        help="comma-separated models, from: logreg (logistic regression), mlp" + default,
    )
    demo.add_argument(
        "--batch-size", type=int, default=d["batch_size"], help="minibatch size" + default
    )
    demo.add_argument("--lr", type=float, default=d["lr"], help="SGD learning rate" + default)
    demo.add_argument("--out", default=d["out"], help="where to write the PNG plot" + default)
    demo.add_argument(
        "--no-progress", action="store_true", help="hide the progress bar (shown on stderr)"
    )
    demo.set_defaults(command_parser=demo)  # option errors print the demo's own usage
    return parser


def _run_demo(demo_parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from grabkit.demo import DemoOptions, MissingDemoDependency, run_demo

    try:
        options = DemoOptions(
            epochs=args.epochs,
            seeds=args.seeds,
            orderings=_comma_list(args.orderings),
            models=_comma_list(args.models),
            batch_size=args.batch_size,
            lr=args.lr,
            out=Path(args.out),
            progress=not args.no_progress,
        )
    except ValueError as error:
        demo_parser.error(str(error))
    try:
        run_demo(options)
    except MissingDemoDependency as error:
        print(f"grabkit: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the subcommand; returns the exit code."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command_parser = getattr(args, "command_parser", parser)
    if unknown:  # named against the subcommand's own usage, not the top-level one
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "demo":
        return _run_demo(command_parser, args)
    parser.print_help()
    return 0
