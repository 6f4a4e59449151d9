"""Enforcing :mod:`ftd.authz`'s table on gRPC servers: who called (:func:`peer_identity`, from the
peer certificate's URI SAN or the agent's Unix socket), the :class:`Guard` that decides a call and
reports a denial, and the server interceptors that run it before every handler sees a request
(:class:`AuthzInterceptor` for a blocking server, :class:`AioAuthzInterceptor` for an asyncio one).

A denied call ends with ``PERMISSION_DENIED`` (``UNAUTHENTICATED`` for a caller without an identity)
and the decision's reason as its details, and changes nothing. Every message of a request stream is
checked, not only the first.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import Message
from grpc import aio

from ftd.authz import FIELDS, NODE_KINDS, TABLE, AuthzFacts, Decision, authorize, method_label
from ftd.deny_list import REVOKED_RULE, DenyList, serial_of_pem
from ftd.identity import LOCAL_IDENTITY, Identity, parse_spiffe
from ftd.throttle import LogThrottle

log = logging.getLogger("ftd.rpc")  # the denials' log lines keep the logger operators filter on


# ---- the caller's identity -------------------------------------------------------------------------

AnyContext: TypeAlias = "grpc.ServicerContext | aio.ServicerContext[Any, Any]"


def peer_identity(context: AnyContext) -> Identity | None:
    """Who called: the ftd identity of the peer certificate (:func:`identity_from_auth`) on a TLS
    connection; :data:`~ftd.identity.LOCAL_IDENTITY` on a ``unix:`` socket; ``None`` for anyone else."""
    auth: Mapping[str, Any] = context.auth_context() or {}
    if b"ssl" in (auth.get("transport_security_type") or ()):
        return identity_from_auth(auth)
    return LOCAL_IDENTITY if (context.peer() or "").startswith("unix:") else None


def identity_from_auth(auth: Mapping[str, Any]) -> Identity | None:
    """The identity in a TLS peer's auth context: its certificate's URI SAN, which must be exactly one
    (gRPC sets ``peer_spiffe_id`` only then) and a ``spiffe://ftd/...`` name. Never a DNS SAN or the
    subject (a CA-signed certificate whose DNS SAN spells an operator's URI is no operator), and
    ``None`` for a certificate with no or several URI SANs."""
    uris = list(auth.get("x509_uri_subject_alternative_name") or ())
    spiffe = list(auth.get("peer_spiffe_id") or ())
    if len(spiffe) != 1 or len(uris) > 1 or (uris and uris[0] != spiffe[0]):
        return None
    return parse_spiffe(spiffe[0].decode("utf-8", "replace"))


def peer_serial(context: AnyContext) -> str | None:
    """The serial number (hex) of the peer's certificate, for the deny list (``None``: no TLS peer)."""
    auth: Mapping[str, Any] = context.auth_context() or {}
    pem = list(auth.get("x509_pem_cert") or ())
    return serial_of_pem(pem[0]) if len(pem) == 1 else None


def authz_fields(request: object) -> dict[str, object]:
    """Only the fields :func:`ftd.authz.authorize` reads (:data:`ftd.authz.FIELDS`): cheap enough for
    every message of every heartbeat stream."""
    names = _FIELDS_OF.get(type(request))
    if names is None:
        fields = request.DESCRIPTOR.fields_by_name if isinstance(request, Message) else {}
        names = _FIELDS_OF[type(request)] = tuple(n for n in FIELDS if n in fields)
    return {name: getattr(request, name) for name in names}


_FIELDS_OF: dict[type, tuple[str, ...]] = {}


# ---- enforcing the authorization table -------------------------------------------------------------

FactsProvider: TypeAlias = "Callable[[str, Identity, Mapping[str, object]], AuthzFacts]"
DeniedHook: TypeAlias = "Callable[[str, str], None]"
DENIAL_LOG_PERIOD_S = 10.0  # one denial line per (identity, method, rule) this often, with a suppressed count


class Guard:
    """Decides calls against :data:`ftd.authz.TABLE` and reports denials.

    ``cluster``: the server's cluster (certificates of another are refused). ``facts``: called with
    (method, identity, :func:`authz_fields` of the request) for a node caller of a method whose rule
    needs what the server knows (the job's members, the round's rank 0, the node's registered host);
    it must be quick and not block (it runs on the serving thread or event loop); an exception fails
    the call. Without it
    those checks stay ``unchecked`` in the decision and are the handler's to make. ``on_denied``:
    called with the method's label and the rule's name for every denial, e.g.
    ``metrics.rpc_denied.labels(method, rule).inc`` (both from fixed sets). ``deny``: the deny list in
    force (:mod:`ftd.deny_list`), consulted before the table for every caller with an identity.
    Denials are logged at most once per (identity, method, rule) every :data:`DENIAL_LOG_PERIOD_S`
    (a flood of refused calls wrote 2.3 MiB of log in 15 s)."""

    def __init__(self, cluster: str | None = None, facts: FactsProvider | None = None,
                 on_denied: DeniedHook | None = None, deny: Callable[[], DenyList] | None = None,
                 log_period_s: float = DENIAL_LOG_PERIOD_S) -> None:
        self.cluster = cluster
        self.facts = facts
        self.on_denied = on_denied
        self.deny = deny
        self._known = AuthzFacts(cluster=cluster)
        self.log_throttle = LogThrottle(log, log_period_s, max_kinds=1024)

    def decide(self, method: str, identity: Identity | None, request: object,
               serial: str | None = None) -> Decision:
        """The decision on one request of ``identity`` (presenting the certificate ``serial``)."""
        if identity is not None and self.deny is not None:
            revoked = self.deny().refusal(identity, serial)
            if revoked is not None:
                return self._denied(method, identity, Decision(False, REVOKED_RULE, revoked))
        fields = authz_fields(request)
        facts = self._known
        policy = TABLE.get(method)
        if (self.facts is not None and policy is not None and policy.facts and identity is not None
                and identity.kind in NODE_KINDS):
            facts = replace(self.facts(method, identity, fields), cluster=self.cluster)
        decision = authorize(method, identity, fields, facts)
        return decision if decision.allowed else self._denied(method, identity, decision)

    def _denied(self, method: str, identity: Identity | None, decision: Decision) -> Decision:
        label = method_label(method)
        # The kind is bounded: identities are the CA's, methods and rules fixed sets.
        self.log_throttle.log(logging.WARNING, f"{identity}|{label}|{decision.rule}", "denied %s: %s", label,
                              decision.reason)
        if self.on_denied is not None:
            self.on_denied(label, decision.rule)
        return decision

    def check(self, context: grpc.ServicerContext, method: str, request: object,
              identity: Identity | None = None, serial: str | None = None) -> None:
        """For a blocking servicer: aborts the call (``PERMISSION_DENIED``/``UNAUTHENTICATED``, the
        reason as details) unless the table allows it. ``identity``/``serial``: the peer's, when the
        caller has them already (a stream's peer is the same for every message)."""
        decision = self.decide(method, identity or peer_identity(context), request, serial or peer_serial(context))
        if not decision.allowed:
            context.abort(_code(decision), decision.reason)

    async def check_aio(self, context: aio.ServicerContext[Any, Any], method: str, request: object,
                        identity: Identity | None = None, serial: str | None = None) -> None:
        """:meth:`check` for an asyncio servicer."""
        decision = self.decide(method, identity or peer_identity(context), request, serial or peer_serial(context))
        if not decision.allowed:
            await context.abort(_code(decision), decision.reason)


def _code(decision: Decision) -> grpc.StatusCode:
    return grpc.StatusCode.UNAUTHENTICATED if decision.unauthenticated else grpc.StatusCode.PERMISSION_DENIED


def _rebuild(handler: grpc.RpcMethodHandler[Any, Any], behavior: Callable[..., Any]) -> grpc.RpcMethodHandler[Any, Any]:
    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return factory(behavior, request_deserializer=handler.request_deserializer,
                   response_serializer=handler.response_serializer)


def _inner(handler: grpc.RpcMethodHandler[Any, Any]) -> Callable[..., Any]:
    fn = (handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)
    assert fn is not None
    return fn


class AuthzInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Enforces the table on a blocking server (``grpc.server(..., interceptors=[...])``): every
    request (each message of a request stream) is checked before the handler sees it; a denied call
    changes nothing."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method, guard, inner = handler_call_details.method, self.guard, _inner(handler)

        if handler.request_streaming:
            def streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                identity, serial = peer_identity(context), peer_serial(context)  # once per stream

                def checked() -> Iterator[Any]:
                    for request in requests:
                        guard.check(context, method, request, identity, serial)
                        yield request
                return inner(checked(), context)
            return _rebuild(handler, streaming)

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            guard.check(context, method, request)
            return inner(request, context)
        return _rebuild(handler, unary)


class _CheckedReadContext:
    """An asyncio servicer context whose ``read()`` checks each message before handing it over (for
    servicers that read a request stream with ``context.read()`` rather than iterating it)."""

    def __init__(self, context: aio.ServicerContext[Any, Any], check: Callable[[Any], Awaitable[None]]) -> None:
        self._context = context
        self._check = check

    async def read(self) -> Any:
        message = await self._context.read()
        if message is not aio.EOF:  # type: ignore[attr-defined]  # missing from grpc-stubs
            await self._check(message)
        return message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class AioAuthzInterceptor(aio.ServerInterceptor):  # type: ignore[type-arg]
    """:class:`AuthzInterceptor` for an asyncio server (``aio.server(interceptors=[...])``)."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method, guard, inner = handler_call_details.method, self.guard, _inner(handler)

        async def call(first: Any, context: Any) -> Any:
            result = inner(first, context)
            return await result if inspect.isawaitable(result) else result

        if handler.request_streaming:
            def prepare(requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]) -> tuple[Any, Any]:
                identity, serial = peer_identity(context), peer_serial(context)  # once per stream

                async def check(message: Any) -> None:
                    await guard.check_aio(context, method, message, identity, serial)

                async def checked() -> AsyncIterator[Any]:
                    async for request in requests:
                        await check(request)
                        yield request
                return checked(), _CheckedReadContext(context, check)

            if inspect.isasyncgenfunction(inner):
                async def stream_gen(requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]) -> Any:
                    checked, proxy = prepare(requests, context)
                    async for response in inner(checked, proxy):
                        yield response
                return _rebuild(handler, stream_gen)

            async def stream_coro(requests: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]) -> Any:
                checked, proxy = prepare(requests, context)
                return await call(checked, proxy)
            return _rebuild(handler, stream_coro)

        if inspect.isasyncgenfunction(inner):
            async def unary_gen(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
                await guard.check_aio(context, method, request)
                async for response in inner(request, context):
                    yield response
            return _rebuild(handler, unary_gen)

        async def unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
            await guard.check_aio(context, method, request)
            return await call(request, context)
        return _rebuild(handler, unary)
