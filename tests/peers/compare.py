"""Compare two junit XML files of ``scripts/peer_tests.sh`` runs (e.g. stock vs gockpt).

    python tests/peers/compare.py /tmp/peers/lightning-stock.xml /tmp/peers/lightning-gockpt.xml \
        [--injected /tmp/peers/lightning-gockpt.injected] [--ids]

Prints the outcome counts of both runs and every test that passed in the first and failed or
errored in the second, with the first line of its failure message and whether GoCkpt was
injected in it (``*``: the test built a Trainer/Accelerator with GoCkpt). ``--ids`` prints only
those test ids, one per line (to re-run them: pass them to ``scripts/peer_tests.sh``).
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def cases(path: str) -> dict[str, tuple[str, str, str]]:
    """``{test id: (outcome, first line of message, full failure text)}``.

    outcome: passed/failed/error/skipped; a call failure wins over a teardown error.
    """
    out: dict[str, tuple[str, str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        parts = classname.split(".")
        # junit classname "tests.tests_pytorch.checkpointing.test_x[.TestClass]" -> file + class
        mod_end = max((i for i, p in enumerate(parts) if p.startswith("test")), default=0)
        file_part = "/".join(parts[: mod_end + 1]) + ".py"
        test_id = "::".join([file_part, *parts[mod_end + 1:], name])
        outcome, message, text = "passed", "", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                lines = (el.get("message") or el.text or "").strip().splitlines()
                message, text = (lines[0] if lines else ""), (el.text or "")
                if outcome != "skipped":
                    break
        prev = out.get(test_id)
        if prev is None or prev[0] in ("passed", "skipped"):
            out[test_id] = (outcome, message, text)
    return out


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, first line of message)}``."""
    return {t: (o, m) for t, (o, m, _) in cases(path).items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--injected")
    parser.add_argument("--ids", action="store_true")
    args = parser.parse_args()
    a, b = outcomes(args.before), outcomes(args.after)
    injected = set()
    if args.injected:
        with open(args.injected, encoding="utf-8") as f:
            injected = {line.split("\t")[0] for line in f if line.strip()}
    regressions = sorted(t for t, (o, _) in b.items() if o in ("failed", "error") and a.get(t, ("",))[0] == "passed")
    if args.ids:
        print("\n".join(regressions))
        return
    for label, run in ((args.before, a), (args.after, b)):
        counts = collections.Counter(o for o, _ in run.values())
        print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"passed in the first, failed/error in the second: {len(regressions)}")
    for t in regressions:
        mark = "*" if t in injected else " "
        print(f"{mark} {t}\n      {b[t][1][:300]}")
    only_b = sorted(set(b) - set(a))
    if only_b:
        print(f"only in the second run: {len(only_b)}")


if __name__ == "__main__":
    main()
