"""``mobizo adapters list|download``: your trained adapters; download unpacks a PEFT adapter directory, or with
``--merged`` the server's merge of it into its base (``adapters merge``, on this machine:
``shared.commands.adapters``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from server.commands import add_connection_args, client_from_args, print_json, print_table
from shared.backends import MERGE_DTYPES
from shared.errors import ExitCode, UsageError

MERGE_WAIT_S = 3600.0  # a merge waits behind every job's compile on the server, then loads its base


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    listing = sub.add_parser("list", help="your adapters, newest first", description="your adapters, newest first")
    listing.set_defaults(_run=run, _parser=listing, action="list")
    listing.add_argument("--model", help="only this model's adapters")
    listing.add_argument("--task", help="only this task's adapters")
    listing.add_argument("--json", action="store_true", help="print the full objects as JSON")
    add_connection_args(listing)
    text = "download an adapter as a PEFT directory"
    download = sub.add_parser("download", help=text, description=text)
    download.set_defaults(_run=run, _parser=download, action="download")
    download.add_argument("adapter_id", type=int)
    download.add_argument("--out", type=Path, required=True, help="directory to create (adapter_config.json, ...)")
    download.add_argument("--zip", action="store_true", help="write the archive to --out as a .zip file instead")
    download.add_argument(
        "--merged",
        action="store_true",
        help="the base model with the adapter folded in, a plain Hugging Face model folder (built by the server)",
    )
    download.add_argument("--dtype", choices=MERGE_DTYPES, default=MERGE_DTYPES[0], help="--merged: its weights' dtype")
    download.add_argument(
        "--wait-s",
        type=float,
        default=MERGE_WAIT_S,
        help="--merged: how long to wait while the server builds the merge (it answers 503 until it is built)",
    )
    add_connection_args(download)


def _unpack(archive: Path, out: Path) -> None:
    """Extract through ``shared.files.atomic_dir``, so ``out`` appears complete or not at all."""
    import zipfile

    from shared.errors import MobizoError
    from shared.files import atomic_dir

    if out.exists():
        raise MobizoError(f"{out} exists; choose another --out")
    with zipfile.ZipFile(archive) as zf, atomic_dir(out) as tmp:
        for name in zf.namelist():
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise MobizoError(f"archive member {name!r} escapes the directory")
        zf.extractall(tmp)


def _building(event) -> None:
    """Say why a merged download waits (stderr: stdout is the folder's path)."""
    print(f"the server is building the merged model; asking again in {event.delay:.0f} s", file=sys.stderr)


def run(args: argparse.Namespace) -> ExitCode:
    client = client_from_args(args)
    if args.action == "list":
        adapters = client.get("/v1/adapters", model=args.model, task=args.task)
        if args.json:
            print_json(adapters)
        else:
            columns = ["id", "model", "task", "version", "job_id", "cohort_id", "parent_adapter_id", "created_at"]
            print_table(adapters["data"], columns)
        return ExitCode.OK
    if args.dtype != MERGE_DTYPES[0] and not args.merged:
        raise UsageError("dtype", "applies to --merged downloads")
    if not args.wait_s > 0:
        raise UsageError("wait-s", f"must be positive (got {args.wait_s:g})")
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    path = f"/v1/adapters/{args.adapter_id}/" + (f"merged?dtype={args.dtype}" if args.merged else "download")
    wait = {"wait_s": args.wait_s, "on_wait": _building} if args.merged else {}
    if args.zip:
        client.download(path, out, **wait)
    else:
        archive = client.download(path, out.parent / f".{out.name}.zip", **wait)
        try:
            _unpack(archive, out)
        finally:
            archive.unlink(missing_ok=True)
    print(out)
    return ExitCode.OK
