"""`python -m llmserve.kernels [--all-levels] [--shipped]`: load (building where needed)
the native CPU kernels now, as an install step, instead of at first use: the level this CPU
runs best (what `auto` loads), and with `--all-levels` every level it executes (what
`LLMSERVE_CPU_ISA` selects, and what the tests check one against another). Each line says
where the library came from: the package's own (a wheel's), the cache, or built now. Built
libraries are cached (`~/.cache/llmserve/kernels`, keyed by sources, flags and compiler),
so a later build is a no-op. `--shipped` fails unless every one came with the package (an
installed wheel's check)."""

import argparse
import sys
import time

from llmserve import kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmserve.kernels", description=__doc__)
    parser.add_argument("--all-levels", action="store_true",
                        help="also every lower instruction-set level this CPU executes")
    parser.add_argument("--shipped", action="store_true",
                        help="fail unless each library is the package's own (prebuilt)")
    args = parser.parse_args(argv)
    builds = [(kernels.auto_level(), True)]
    if args.all_levels:
        builds += [(level, False) for level in kernels.supported_levels()]
    failed = 0
    for level, extensions in builds:
        start = time.perf_counter()
        lib = kernels.library(level, extensions)
        name = kernels.level_of(lib) if lib is not None else level
        origin = kernels.origin_of(lib) if lib is not None else ""
        status = f"ready, {origin}" if lib is not None else "FAILED (see the warning above)"
        print(f"llmserve kernels {name}: {status} ({time.perf_counter() - start:.1f} s)")
        failed += lib is None or args.shipped and not origin.startswith("prebuilt")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
