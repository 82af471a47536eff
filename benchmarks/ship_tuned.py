"""Ships tuned kernel choices: merges the entries of tuning caches (the `autotune-<gpu>-triton<version>.json` files
that a run writes to DROPIN_CACHE_DIR, e.g. a `dropin zoo` run's on a fresh GPU machine) into the file of the same
name in src/dropin/ops/tuned/, which every install reads first: shapes tuned there are not tuned again on first use
(a first output without the candidates' compiles and timing). A key already shipped keeps its choice unless
--replace. Prints what each cache adds.
    python benchmarks/ship_tuned.py CACHE.json [CACHE.json ...] [--replace]"""
import argparse
import json
import pathlib

SHIPPED = pathlib.Path(__file__).resolve().parent.parent / "src" / "dropin" / "ops" / "tuned"


def merge(shipped: dict, cache: dict, replace: bool) -> tuple[int, int]:
    """Adds cache's entries to shipped (in place): (added, replaced)."""
    added = replaced = 0
    for key, config in cache.items():
        if key not in shipped:
            added += 1
        elif shipped[key] != config and replace:
            replaced += 1
        else:
            continue
        shipped[key] = config
    return added, replaced


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("caches", nargs="+", type=pathlib.Path)
    parser.add_argument("--replace", action="store_true", help="a cache's choice replaces a shipped one")
    parser.add_argument("--shipped", type=pathlib.Path, default=SHIPPED, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for cache_path in args.caches:
        target = args.shipped / cache_path.name
        shipped = json.loads(target.read_text()) if target.exists() else {}
        added, replaced = merge(shipped, json.loads(cache_path.read_text()), args.replace)
        target.write_text(json.dumps(shipped, indent=0, sort_keys=True) + "\n")
        print(f"{target.name}: {added} added, {replaced} replaced, {len(shipped)} in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
