"""`deploy/bundle build|check`: the offline bundle's commands (see rlserve.bundle)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy/bundle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download (and trim) the wheels for a target Python and platform")
    b.add_argument("--out", type=Path, default=Path("build/bundle"), help="the bundle folder (replaced)")
    b.add_argument("--python", default="3.12", help="target Python version, e.g. 3.12")
    b.add_argument("--platform", action="append", help="pip platform tags (repeatable); default: every "
                                                        "manylinux x86_64 tag up to glibc 2.35")
    b.add_argument("--image", type=Path, help="the target's packages (`pip list --format=freeze`, or names)")
    b.add_argument("--keep", action="append", default=[], help="bundle this project even if the image has it")
    b.add_argument("--download-dir", type=Path, help="keep pip's downloads here and reuse them (default: none)")
    b.add_argument("--no-trim", action="store_true", help="keep Ray whole")
    b.add_argument("--no-gpu", action="store_true", help="without requirements/bundle-gpu.txt (megatron-core)")
    sub.add_parser("check", help="import everything the services need, here")
    args = parser.parse_args(argv)
    if args.command == "check":
        from rlserve.bundle.check import check

        return check()
    from rlserve.bundle.build import DEFAULT_KEEP, X86_64_TAGS, build, canonical

    manifest = build(args.out, args.python, tuple(args.platform or X86_64_TAGS), args.image,
                     tuple(DEFAULT_KEEP) + tuple(canonical(k) for k in args.keep), not args.no_trim, not args.no_gpu,
                     args.download_dir)
    print(json.dumps({"wheels": len(manifest["wheels"]), "left_out": len(manifest["left_out"]),
                      "MiB": round(manifest["bytes"] / 2**20, 1), "seconds": manifest["seconds"]}))
    print(f"bundle: {args.out} ({manifest['bytes'] / 2**20:.1f} MiB); install on the node with "
          f"{args.out}/install.sh, then `deploy/bundle check`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
