"""`python -m llmserve.kernels [--all-levels]`: build the native CPU kernels now, as an
install step, instead of at first use: the level this CPU runs best (what `auto` loads),
and with `--all-levels` every level it executes (what `LLMSERVE_CPU_ISA` selects, and
what the tests check one against another). Built libraries are cached (`~/.cache/llmserve/
kernels`, keyed by source, flags and compiler), so a later build is a no-op."""

import argparse
import sys
import time

from llmserve import kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmserve.kernels", description=__doc__)
    parser.add_argument("--all-levels", action="store_true",
                        help="also every lower instruction-set level this CPU executes")
    args = parser.parse_args(argv)
    builds = [(kernels.auto_level(), True)]
    if args.all_levels:
        builds += [(level, False) for level in kernels.supported_levels()]
    failed = 0
    for level, extensions in builds:
        start = time.perf_counter()
        lib = kernels.library(level, extensions)
        name = kernels.level_of(lib) if lib is not None else level
        status = "ready" if lib is not None else "FAILED (see the warning above)"
        print(f"llmserve kernels {name}: {status} ({time.perf_counter() - start:.1f} s)")
        failed += lib is None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
