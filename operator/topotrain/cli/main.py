"""`topotrain` command line: crd, plan, run, version."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from topotrain import __version__


def _crd(args: argparse.Namespace) -> int:
    from topotrain.api.crd import CRD_FILENAME, render_crd
    from topotrain.api.job_template import TEMPLATE_CRD_FILENAME, render_template_crd

    if args.output == "-":
        sys.stdout.write(render_crd() + "---\n" + render_template_crd())
        return 0
    target = Path(args.output)
    if not target.is_dir():  # one file: the TrainingJob CRD
        return _write(args, target, render_crd())
    return max(_write(args, target / CRD_FILENAME, render_crd()),
               _write(args, target / TEMPLATE_CRD_FILENAME, render_template_crd()))


def _write(args: argparse.Namespace, target: Path, text: str) -> int:
    if args.check:
        current = target.read_text() if target.exists() else ""
        if current != text:
            print(f"{target} is out of date: run `topotrain crd -o {args.output}`", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="topotrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"topotrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    crd = sub.add_parser("crd", help="generate the TrainingJob and TrainingJobTemplate CRDs")
    crd.add_argument("-o", "--output", default="-", help="file or directory ('-': stdout)")
    crd.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    crd.set_defaults(func=_crd)

    try:
        from topotrain.cli.plan import add_plan_parser
    except ImportError:  # pragma: no cover - only while the planner is being written
        pass
    else:
        add_plan_parser(sub)

    try:
        from topotrain.controller.main import add_run_parser
    except ImportError:  # pragma: no cover
        pass
    else:
        add_run_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
