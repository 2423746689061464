"""``mobizo adapters list|download``: your trained adapters; download unpacks a PEFT adapter directory, or with
``--merged`` the server's merge of it into its base (``adapters merge``, on this machine:
``shared.commands.adapters``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from server.commands import add_connection_args, client_from_args, print_json, print_table
from shared.backends import MERGE_DTYPES
from shared.errors import ExitCode, UsageError


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
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    path = f"/v1/adapters/{args.adapter_id}/" + (f"merged?dtype={args.dtype}" if args.merged else "download")
    if args.zip:
        client.download(path, out)
    else:
        archive = client.download(path, out.parent / f".{out.name}.zip")
        try:
            _unpack(archive, out)
        finally:
            archive.unlink(missing_ok=True)
    print(out)
    return ExitCode.OK
