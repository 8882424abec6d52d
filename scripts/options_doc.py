"""Write docs/options.md from the description under each FuserConfig field and each pattern option's field.

    python scripts/options_doc.py            # rewrite docs/options.md
    python scripts/options_doc.py --check    # exit 1, saying so, when docs/options.md is out of date

The text comes from :func:`fuser.config.options_reference`; tests/test_options_doc.py runs the same comparison.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPTIONS_MD = ROOT / "docs" / "options.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if docs/options.md differs")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))  # this checkout's fuser, whichever one is installed
    from fuser.config import options_reference

    text = options_reference(markdown=True)
    if args.check:
        if OPTIONS_MD.exists() and OPTIONS_MD.read_text(encoding="utf-8") == text:
            return 0
        print(f"{OPTIONS_MD} is out of date: run python scripts/options_doc.py", file=sys.stderr)
        return 1
    OPTIONS_MD.write_text(text, encoding="utf-8")
    print(f"wrote {OPTIONS_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
