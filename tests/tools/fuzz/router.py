"""The router's surfaces: its OpenAI HTTP routes (:class:`RouterHttp`) and its gRPC
RouterService (:class:`RouterGrpc`)."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from pdserve.v1 import common_pb2, router_pb2

from .cases import Case
from .grpc_surface import Bases, GrpcSurface
from .http import JSON, RAW_BODIES, corrupt_json, http_call
from .invariants import (
    Dead,
    Violation,
    check_http,
)
from .strategies import (
    pick,
)

#: A hostile ``x-request-id`` header value: any printable ASCII, up to 160 characters.
REQUEST_ID = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=160)


class RouterHttp:
    """The router's OpenAI HTTP API."""

    name = "router-http"
    ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

    def __init__(self, address: str, model: str) -> None:
        from pdserve.services.router.openai_fields import ACCEPTED, REFUSED

        self.address = address
        self.model = model
        common = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p"}
        common |= {"top_k", "seed", "stop", "stream", "stream_options", "n", "ignore_eos"}
        common |= {"request_id", "cache_salt", "unknown_field", *REFUSED, *ACCEPTED}
        common |= {"logprobs", "top_logprobs", "presence_penalty", "frequency_penalty"}
        common |= {"repetition_penalty", "logit_bias", "stop_token_ids", "echo"}
        common |= {"response_format", "truncate_prompt_tokens", "add_special_tokens"}
        prompt = {"model": model, "prompt": "hello fuzz", "max_tokens": 2}
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        self.bodies = {
            "/v1/completions": ([prompt, {**prompt, "prompt": [1, 2, 3], "stream": True}], common),
            "/v1/chat/completions": (
                [chat, {**chat, "stream": True}],
                common
                | {"messages", "messages[0].role", "messages[0].content"}
                | {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"},
            ),
        }

    def cases(self) -> st.SearchStrategy[Case]:
        json_head = {"content-type": "application/json"}
        corrupted = [
            st.sampled_from(bases)
            .flatmap(lambda b, keys=keys: corrupt_json(b, keys))
            .map(lambda bp, r=route: Case(f"POST {r}", bp[0], bp[1], json_head))
            for route, (bases, keys) in self.bodies.items()
        ]
        posts = st.sampled_from(sorted(self.bodies))
        hostile = st.tuples(posts, JSON).map(lambda t: Case(f"POST {t[0]}", t[1], None, json_head))
        garbage = st.tuples(posts, pick(RAW_BODIES) | st.binary(max_size=64)).map(
            lambda t: Case(f"POST {t[0]}", t[1].replace(b'"M"', json.dumps(self.model).encode()))
        )
        header = st.tuples(posts, REQUEST_ID).map(
            lambda t: Case(
                f"POST {t[0]}",
                self.bodies[t[0]][0][0],
                "request_id",
                {**json_head, "x-request-id": t[1]},
            )
        )
        path = st.sampled_from(self.ROUTES) | st.text(
            st.characters(codec="ascii", categories=["L", "N", "P"]), max_size=20
        ).map(lambda p: "/" + urllib.parse.quote(p))
        other = st.tuples(
            st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
            path,
            st.binary(max_size=32),
        ).map(lambda t: Case(f"{t[0]} {t[1]}", t[2]))
        return st.one_of(*corrupted, hostile, garbage, header, other)

    def check(self, case: Case) -> None:
        method, path = case.op.split(" ", 1)
        body = case.data if isinstance(case.data, bytes) else json.dumps(case.data).encode()
        status, reply = http_call(self.address, method, path, body, dict(case.extra or {}))
        text = check_http(status, reply, case.path, case.op)
        if status >= 400 and method != "HEAD":
            try:
                error = json.loads(text)["error"]
            except (ValueError, KeyError, TypeError) as exc:
                raise Violation(f"{case.op}: HTTP {status} not in the OpenAI error shape") from exc
            if not isinstance(error.get("message"), str) or not error["message"]:
                raise Violation(f"{case.op}: HTTP {status} error without a message: {text}")
        if status == 200 and 'data: {"error"' in text:  # an SSE stream that failed midway
            raise Violation(f"{case.op}: an error in the stream: {text[:500]}")

    def alive(self) -> None:
        body = json.dumps(self.bodies["/v1/completions"][0][0]).encode()
        status, reply = http_call(self.address, "POST", "/v1/completions", body)
        if status != 200:
            raise Dead(f"router-http: a valid completion now answers {status}: {reply[:300]!r}")


def _generate_base(model: str) -> Callable[[int], Message]:
    sampling = common_pb2.SamplingParams(max_tokens=2)
    variants = [
        router_pb2.GenerateRequest(model=model, prompt="hello fuzz", sampling=sampling),
        router_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling),
        router_pb2.GenerateRequest(
            messages=[router_pb2.ChatMessage(role=router_pb2.CHAT_ROLE_USER, content="hi")],
            sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.5, top_p=0.9),
        ),
        router_pb2.GenerateRequest(
            prompt="write", sampling=sampling, mode=router_pb2.DISAGG_MODE_WRITE
        ),
    ]
    return lambda k: variants[k % len(variants)]


class RouterGrpc(GrpcSurface):
    """RouterService; a case may carry a hostile ``x-request-id``."""

    name = "router-grpc"

    def __init__(self, address: str, model: str) -> None:
        services = [router_pb2.DESCRIPTOR.services_by_name["RouterService"]]
        generate = _generate_base(model)
        bases: Bases = {
            "RouterService.Generate": generate,
            "RouterService.GenerateStream": generate,
            "RouterService.Tokenize": lambda k: router_pb2.TokenizeRequest(
                model=model, text="hello fuzz", add_special_tokens=k % 2 == 0
            ),
            "RouterService.ListModels": lambda k: router_pb2.ListModelsRequest(),
            "Health.Check": lambda k: health_pb2.HealthCheckRequest(),
        }
        super().__init__(self.route(address, services), bases, "RouterService.Generate")

    def cases(self) -> st.SearchStrategy[Case]:
        """Also: a valid Generate(Stream) whose ``x-request-id`` metadata is hostile."""
        ids = st.tuples(
            st.sampled_from(["RouterService.Generate", "RouterService.GenerateStream"]),
            st.integers(0, 3),
            REQUEST_ID,
        ).map(lambda t: Case(t[0], self.bases[t[0]](t[1]), "request_id", (("x-request-id", t[2]),)))
        return super().cases() | ids
