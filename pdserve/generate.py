"""``pdserve generate``: stream a completion from a router over gRPC (a minimal client)."""

from __future__ import annotations

import argparse
import os
import sys


def run(args: argparse.Namespace) -> int:
    import grpc

    from pdserve import grpcutil
    from pdserve.auth import bearer
    from pdserve.enums import FINISH_REASON
    from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        req = router_pb2.GenerateRequest(
            model=args.model,
            messages=[router_pb2.ChatMessage(role=router_pb2.CHAT_ROLE_USER, content=args.prompt)],
            sampling=sampling,
        )
    else:
        req = router_pb2.GenerateRequest(model=args.model, prompt=args.prompt, sampling=sampling)
    with grpcutil.sync_channel(args.router, public=True) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        try:
            for msg in stub.GenerateStream(
                req, timeout=args.timeout, metadata=bearer(args.api_key)
            ):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    print(f"[{FINISH_REASON.name(msg.finish_reason)}]", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"\npdserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print()
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="stream a completion from a running router over gRPC",
        description="Sends one GenerateStream request to a router and prints tokens as they arrive.",
    )
    p.add_argument("prompt", help="prompt text")
    p.add_argument(
        "--router", default="127.0.0.1:50060", help="router gRPC address (default: %(default)s)"
    )
    p.add_argument("--model", default="", help="model name (default: the cluster's only model)")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)"
    )
    p.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    p.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY", ""),
        help="the router's API key (default: $PDSERVE_API_KEY)",
    )
    p.set_defaults(func=run)
