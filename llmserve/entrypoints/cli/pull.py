"""`llmserve pull` and `llmserve models`: the model catalog, fetched into the cache or
listed."""

import argparse
import sys

from llmserve.entrypoints.cli.command import Command
from llmserve.entrypoints.cli.output import format_bytes
from llmserve.loader.catalog import DEFAULT_MODEL


def cmd_pull(args: argparse.Namespace) -> int:
    if args.list:
        return cmd_models(args)
    from llmserve.loader.catalog import catalog_entry, fetch_model

    entry = catalog_entry(args.model)
    licence = entry.license + (f" ({entry.license_url})" if entry.license_url else "")
    print(f"{entry.name}: {entry.description}\nlicence: {licence}; by using the model you "
          "accept its terms", file=sys.stderr)
    print(fetch_model(args.model, progress=True))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from llmserve.loader.catalog import list_catalog

    rows = [("NAME", "CACHED", "SIZE", "LICENCE", "DESCRIPTION")]
    for row in list_catalog():
        size = format_bytes(row.size) if row.size is not None else "-"
        rows.append((row.name, "yes" if row.cached else "no", size, row.license,
                     row.description))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[4]]))
    return 0


def _pull_arguments(pull: argparse.ArgumentParser) -> None:
    pull.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="catalog name")
    pull.add_argument("--list", action="store_true", help="list the catalog instead")


PULL = Command("pull", help="fetch a catalog model into the cache",
               add_arguments=_pull_arguments, run=cmd_pull)
MODELS = Command("models", help="list the catalog models", add_arguments=lambda parser: None,
                 run=cmd_models)
