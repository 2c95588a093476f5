"""``gockpt``: inspect, verify and convert checkpoints from the command line.

::

    gockpt inspect PATH [--tensors] [--json]
    gockpt verify PATH
    gockpt convert SRC DST --to lightning|hf|dcp|gockpt [--prefix P] [--max-shard-size 5GB]

``PATH``, ``SRC`` and ``DST`` are local paths or fsspec URLs (``s3://bucket/run/step-200``);
``--storage-options '{"key": ...}'`` passes fsspec options. A directory of checkpoints stands
for the newest complete one in it (its ``latest`` pointer, else the highest captured step of
the latest run). Exit status: 0 on success, 1 when a checkpoint is
missing, incomplete, corrupt or cannot be converted (the message names the file), 2 for a
usage error. Also ``python -m gockpt``. See ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import pickle
import re
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

from . import __version__, storage
from .audit import describe_checkpoint, verify_checkpoint
from .format import CheckpointCorruptError

__all__ = ["main"]

_EXTRAS = {"lightning": "lightning", "lightning_gockpt": "lightning", "huggingface_hub": "hf",
           "s3fs": "s3", "accelerate": "accelerate"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gockpt`` command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)  # a usage error (options included) exits 2 here
    if getattr(args, "prefix", "") and args.to != "hf":
        parser.error("--prefix applies to --to hf only")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.run(args, args.storage_options))
    except (FileNotFoundError, CheckpointCorruptError, ValueError, TypeError, OSError,
            pickle.UnpicklingError) as e:
        if args.verbose:
            raise
        print(f"gockpt: error: {e}", file=sys.stderr)
        if isinstance(e, pickle.UnpicklingError) or "weights_only" in str(e):
            print("gockpt: the file holds objects beyond tensors and containers; pass "
                  "--allow-pickle if you trust it", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        extra = _EXTRAS.get((e.name or "").partition(".")[0])
        hint = f" (pip install 'gockpt[{extra}]')" if extra else ""
        print(f"gockpt: error: {e}{hint}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-options", metavar="JSON", type=_json_object, default={},
                        help="fsspec options for URLs, as a JSON object")
    common.add_argument("-v", "--verbose", action="store_true",
                        help="log progress details and show tracebacks")
    # The common options belong to each command (argparse would let a command's defaults
    # overwrite values given before it).
    parser = argparse.ArgumentParser(
        prog="gockpt", description="Inspect, verify and convert GoCkpt checkpoints.")
    parser.add_argument("--version", action="version", version=f"gockpt {__version__}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", parents=[common], help="what a checkpoint holds",
                       description="Steps, mode, K, sizes, tensors, replay backend, completeness "
                                   "(from the manifest; no other file is read).")
    p.add_argument("path", help="checkpoint directory (or a directory of checkpoints)")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=_inspect)

    p = sub.add_parser("verify", parents=[common], help="check sizes and checksums",
                       description="Check every file's size, xxh3-64 checksum and header "
                                   "against the manifest, then load the checkpoint. Exits 1 "
                                   "naming each bad file.")
    p.add_argument("path", help="checkpoint directory (or a directory of checkpoints)")
    p.set_defaults(run=_verify)

    p = sub.add_parser("convert", parents=[common], help="convert to or from GoCkpt",
                       description="SRC: a GoCkpt checkpoint, a Lightning .ckpt file or an "
                                   "Accelerate save_state folder.")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=("lightning", "hf", "dcp", "gockpt"),
                   help="lightning: one .ckpt file; hf: model.safetensors (+ index when "
                        "sharded); dcp: a torch.distributed.checkpoint directory; gockpt: a "
                        "GoCkpt checkpoint directory")
    p.add_argument("--prefix", default="",
                   help="hf: keep the model keys starting with PREFIX, without it (e.g. 'model.')")
    p.add_argument("--max-shard-size", default="5GB", type=_size_arg,
                   help="hf and gockpt: bytes per file, e.g. 5GB, 500MB or 1048576 (default 5GB)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="unpickle arbitrary objects in SRC (only for files you trust)")
    p.set_defaults(run=_convert)
    return parser


def _resolve(path: str, options: dict) -> str:
    """``path``, or for a directory of checkpoints the newest complete one in it (a directory
    with a manifest is a checkpoint, complete or damaged: never one of checkpoints)."""
    if storage.is_complete(path, options) or storage.has_manifest(path, options):
        return path
    fs, local = storage.url_to_fs(path, options)
    newest = storage.latest_checkpoint(path, options) if fs.isdir(local) else None
    if newest is None:
        return path
    print(f"gockpt: {path}: using {newest}, the newest complete checkpoint in it", file=sys.stderr)
    return newest


def _inspect(args: argparse.Namespace, options: dict) -> int:
    info = describe_checkpoint(_resolve(args.path, options), options)
    if args.json:
        if not args.tensors:
            info.pop("tensors")
        print(json.dumps(info, indent=2, sort_keys=True, default=str))
        return 0
    print(_describe(info))
    if args.tensors:
        width = max((len(k) for k in info["tensors"]), default=0)
        for key, t in sorted(info["tensors"].items()):
            print(f"  {key:<{width}}  {t['dtype']:<5} {str(tuple(t['shape'])):<18} "
                  f"{_size(t['bytes']):>10}  {t['file']}")
    return 0


def _describe(info: dict) -> str:
    # Informational fields of the manifest that no loader reads: shown as unknown when malformed.
    replay = info["replay"] if isinstance(info["replay"], dict) else {}
    if replay.get("backend"):
        exact = "bit-exact" if replay.get("exact") else f"max abs error {replay.get('max_abs_error')}"
        backend = f"{replay['backend']} ({exact} against the live optimizer)"
    else:
        backend = "none (the state was copied at one step)"
    created = info["created_unix_s"]
    try:
        when = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):  # not a number, or out of range
        when = "unknown"
    dtypes = Counter(t["dtype"] for t in info["tensors"].values())
    num_shards = len({t["file"] for t in info["tensors"].values()})
    sharded = info["meta"].get("sharded")
    if sharded is not None:
        what = "shares of a replicated (DDP) state" if sharded.get("replicated") else "local shards"
        layout = (f"sharded: {len(sharded.get('parts', []))} parts, {what} (gockpt.dcp.load_full, "
                  "load_sharded; Lightning: GoCkptIO)")
    elif info["part"]:
        layout = "one rank's part of a sharded checkpoint (inspect the folder above it)"
    elif info["meta"].get("writer"):
        layout = f"written by {info['meta']['writer']} (read it with its own loader)"
    else:
        layout = "gockpt (gockpt.load_checkpoint, Engine.restore)"
    rows = [
        ("checkpoint", info["path"]),
        ("complete", "yes (manifest.json written last is present)"),
        ("format", f"gockpt, version {info['format_version']}"),
        ("requested_step", info["requested_step"]),
        ("captured_step", info["captured_step"]),
        ("mode", f"{info['mode']} (K={info['num_overlap_steps']})"),
        ("replay", backend),
        ("created", when),
        ("layout", layout),
        ("files", f"{len(info['files'])}: {num_shards} holding tensors, {info['extra_file']}"
                  f"{', ' + str(len(info['files']) - num_shards - 1) + ' more' if len(info['files']) > num_shards + 1 else ''}, "
                  f"{_size(info['total_bytes'])} with the manifest"),
        ("tensors", f"{len(info['tensors'])} ({_size(info['tensor_bytes'])}; "
                    + ", ".join(f"{n} {d}" for d, n in sorted(dtypes.items()))
                    + (f"; {len(info['aliases'])} tied alias(es)" if info["aliases"] else "") + ")"),
    ]
    return "\n".join(f"{name:<15} {value}" for name, value in rows)


def _named_by_latest(path: str, options: dict) -> str | None:
    """The checkpoint ``path``'s ``latest`` pointer names where it has a manifest (complete or
    damaged); None where ``path`` is a checkpoint, or has no valid pointer."""
    from ._pointer import read_pointer
    from .fsutil import join_user

    if storage.has_manifest(path, options):
        return None
    fs, local = storage.url_to_fs(path, options)
    pointer = read_pointer(fs, local, strict=False) if fs.isdir(local) else None
    if pointer is None:
        return None
    named = join_user(path, pointer["name"])  # spelled as latest_checkpoint spells it
    return named if storage.has_manifest(named, options) else None


def _verify(args: argparse.Namespace, options: dict) -> int:
    from tqdm import tqdm

    named = _named_by_latest(args.path, options)
    if named is not None and not storage.is_complete(named, options):
        # The newest checkpoint is damaged: that is what a verify of the folder must report,
        # not pass over it for an older one.
        print(f"gockpt: {args.path}: its 'latest' names {named}, which is not complete; "
              "verifying it", file=sys.stderr)
        path = named
    else:
        path = _resolve(args.path, options)
    info = describe_checkpoint(path, options)
    with tqdm(total=info["total_bytes"], unit="B", unit_scale=True, desc="verify", disable=None,
              file=sys.stderr) as bar:
        problems = verify_checkpoint(path, options, progress=bar.update)
    for problem in problems:
        print(f"FAILED {problem}")
    if problems:
        print(f"gockpt: {path}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    how = ("it is in a framework's own layout, for its loader" if info["framework_files"]
           else "it loads")
    if info["part"]:  # its files are sound, but it is not a checkpoint to resume from alone
        how += "; it is one rank's part of a sharded checkpoint: verify the folder above it"
    print(f"OK {path}: {len(info['files'])} files, {_size(info['total_bytes'])}, "
          f"sizes, checksums and headers match the manifest; {how}")
    return 0


def _convert(args: argparse.Namespace, options: dict) -> int:
    from . import convert

    source = convert.open_source(args.src, storage_options=options, allow_pickle=args.allow_pickle)
    for note in source.notes:
        print(f"gockpt: note: {note}", file=sys.stderr)
    if args.to == convert.LIGHTNING:
        # Lightning's own writer, from its adapter through the registry: this package imports
        # no adapter, and a missing Lightning is reported only when --to lightning needs it.
        lightning = convert.get_framework(convert.LIGHTNING,
                                          needed_for=f"{source.path}: --to {args.to}")
        size = lightning.to_file(source, args.dst, storage_options=options)
        what = f"one Lightning .ckpt file, {_size(size)}"
    elif args.to == "hf":
        from tqdm import tqdm

        total = sum(t.numel() * t.element_size() for k, t in source.model_state_dict.items()
                    if k.startswith(args.prefix))
        with tqdm(total=total, unit="B", unit_scale=True, desc="hf", disable=None,
                  file=sys.stderr) as bar:
            files = convert.to_hf(source, args.dst, prefix=args.prefix,
                                  max_shard_size=args.max_shard_size,
                                  storage_options=options, progress=bar.update)
        what = f"{len(files)} file(s): {', '.join(files)}"
    elif args.to == "dcp":
        convert.to_dcp(source, args.dst, storage_options=options)
        what = "a torch.distributed.checkpoint directory"
    else:
        convert.to_gockpt(source, args.dst, storage_options=options,
                          max_shard_bytes=args.max_shard_size)
        what = "a GoCkpt checkpoint"
    print(f"wrote {args.dst}: {what}, from {source.path} ({source.kind}, step {source.step})")
    return 0


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000 (the units of Hugging Face's ``max_shard_size``, plus KiB...)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", text.lower())
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r} is not a size such as 5GB, 500MB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def _size_arg(text: str) -> int:
    try:
        return _parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--max-shard-size ")) from None


def _json_object(text: str) -> dict:
    if not text.strip():  # an empty "$OPTS" in a script: no options
        return {}
    try:
        options = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, such as '{\"anon\": true}'")
    return options


def _size(n: Any) -> str:
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"
