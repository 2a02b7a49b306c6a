"""``partialfl data convert``: a federation written as an on-disk client store."""

from __future__ import annotations


def _cmd_data_convert(args) -> int:
    import json

    from partialfl.build import convert_data
    from partialfl.data.store import open_store

    options = {}
    for kv in args.option or []:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise ValueError(f"--option needs KEY=VALUE, got {kv!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    try:
        path = convert_data(args.format, args.input, args.out, images=args.images,
                            max_clients=args.max_clients, options=options,
                            overwrite=args.overwrite, progress=not args.no_progress)
    except FileExistsError:
        if args.overwrite:  # not a store: the writer's own message says so
            raise
        raise FileExistsError(f"{args.out} exists; pass --overwrite to replace it") from None
    print(f"wrote {open_store(path)!r}")
    return 0


def add_commands(sub) -> None:
    from partialfl.registry import names

    d = sub.add_parser("data", help="data utilities (on-disk client stores)")
    dsub = d.add_subparsers(dest="data_command", required=True)
    s = dsub.add_parser("convert", help="write a federation as an on-disk client store")
    s.add_argument("format", choices=names("data-format"))
    s.add_argument("input", help="the loader's file or folder (see partialfl.data.convert)")
    s.add_argument("out", help="the store folder to create")
    s.add_argument("--images", help="image folder (gldv2)")
    s.add_argument("--max-clients", type=int, help="keep at most this many clients")
    s.add_argument("--option", action="append", metavar="KEY=VALUE",
                   help="a loader keyword argument, e.g. --option seq_len=20 (repeatable)")
    s.add_argument("--overwrite", action="store_true",
                   help="replace an existing client store (never another folder)")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=_cmd_data_convert)
