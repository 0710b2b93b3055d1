"""Prefill->decode (PD) disaggregation in the vLLM connector, driven the two ways users drive it.

**LMCache's proxy protocol** (``examples/disagg_prefill/disagg_proxy_server.py``, production-stack's
``disaggregated_prefill`` router): the prefill request carries ``kv_transfer_params``
``{"ret_first_tok": true, "disagg_spec": {"req_id", "receiver_host", "receiver_init_port": [..],
"receiver_alloc_port": [..]}}``. Once the prompt's KV is stored, each prefiller rank *pushes* the
request's chunks into the decoder rank's transfer endpoint (``receiver_host:receiver_init_port[rank]``,
where a ``pd.role: receiver`` decoder's rank listens; over nixl the decoder reads them:
``transfer.push_by``), on a thread of its own, and then notifies the
proxy (ZMQ PUSH to ``pd.proxy_host:pd.proxy_port``, the msgpack map ``{"type": "ProxyNotif",
"req_id": ...}``). The notification is sent whether or not the push succeeded: the proxy waits for
it without a timeout, and a decoder whose KV did not arrive simply computes the prompt.
``request_finished`` answers ``{"first_tok": ...}`` for ``ret_first_tok``. The decoder then gets
prompt + first token; ``skip_last_n_tokens: 1`` makes its lookup find the pushed chunks.
A sender configured with a fixed receiver (``pd.peer_host`` and ``pd.peer_init_port``, LMCache's old
``nixl_peer_*`` keys) and a request without ``disagg_spec`` pushes there within the step, before the
prefill's answer leaves, since no notification tells anyone when it is done.

**vLLM's kv_transfer_params flow** (vLLM's ``toy_proxy_server.py``, llm-d's sidecar): the prefill
request carries ``do_remote_decode: true``. Each prefiller rank *offers* the stored chunks under a
name the scheduler chose; ``request_finished`` answers the fields NixlConnector answers
(``do_remote_prefill``, ``remote_engine_id``, ``remote_host``, ``remote_port``, ...) plus
``"lmcache": {"offer", "endpoints": [[url, identity] per rank], "tokens"}``, which the proxy passes to
the decoder unchanged. The decoder promises the offered prompt tokens and its worker *pulls* them
(asynchronously under our ``LMCacheConnector`` name, vLLM schedules other requests meanwhile; within
the step under vLLM's ``LMCacheConnectorV1`` wrapper, which reports every load as synchronous), then
loads them like a CPU-tier hit. A pull that does not complete within ``pd.recv_timeout`` is reported
as failed blocks: vLLM computes them (never a hang). An offer not pulled within ``pd.offer_ttl`` is
dropped by the prefiller.

Everything a request names is hostile: hosts and ports are checked, lists bounded, the peer must prove
the transfer token before any byte moves (:mod:`lmcache.auth`: no credential is sent to an address a
request chose), and what arrives is checked like any peer's chunk (namespace, model, kv signature,
checksum) before it reaches a tier.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .common import usable_tokens
from .metadata import LoadSpec, PDPlan, PDSend, PushTarget

if TYPE_CHECKING:
    from lmcache.config import Config
    from lmcache.engine import CacheEngine

log = logging.getLogger(__name__)

#: at most this many TP ranks named by a request (hostile input)
MAX_RANKS = 64


def _host(v: Any, what: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= 253 or any(c.isspace() or c in "/@?#" for c in v):
        raise ValueError(f"{what} must be a host name or address, got {str(v)[:60]!r}")
    return v.strip("[]")


def _ports(v: Any, what: str) -> list[int]:
    vs = v if isinstance(v, list) else [v]
    if not 0 < len(vs) <= MAX_RANKS:
        raise ValueError(f"{what}: 1-{MAX_RANKS} ports")
    out = []
    for p in vs:
        if isinstance(p, bool) or not isinstance(p, (int, str)) or not str(p).isdigit() or not 0 < int(p) < 65536:
            raise ValueError(f"{what}: {str(p)[:20]!r} is not a port")
        out.append(int(p))
    return out


def plan_of(params: dict[str, Any], config: Config) -> PDPlan | None:
    """The PD plan of a request's ``kv_transfer_params`` under ``config`` (``None``: no PD).
    ValueError (one line) for a malformed request."""
    pd = config.pd
    if pd.role == "off":
        return None
    sender = pd.role in ("sender", "both")
    receiver = pd.role in ("receiver", "both")
    spec = params.get("disagg_spec")
    if spec is not None and sender:
        if not isinstance(spec, dict):
            raise ValueError("disagg_spec must be a mapping")
        rid = spec.get("req_id")
        if not isinstance(rid, (str, int)) or isinstance(rid, bool) or not 0 < len(str(rid)) <= 256:
            raise ValueError("disagg_spec.req_id must be a string of 1-256 characters")
        target = PushTarget(_host(spec.get("receiver_host"), "disagg_spec.receiver_host"),
                            _ports(spec.get("receiver_init_port"), "disagg_spec.receiver_init_port"))
        return PDPlan(target=target, notify_id=str(rid), ret_first_tok=bool(params.get("ret_first_tok")))
    if params.get("do_remote_decode") is True and sender:
        return PDPlan(offer=f"pd-{secrets.token_hex(12)}")
    lm = params.get("lmcache")
    if params.get("do_remote_prefill") is True and isinstance(lm, dict) and receiver:
        from lmcache.transfer_buffer import offer_name

        eps = lm.get("endpoints")
        tokens = lm.get("tokens")
        if not isinstance(eps, list) or not 0 < len(eps) <= MAX_RANKS:
            raise ValueError(f"lmcache.endpoints: 1-{MAX_RANKS} endpoints")
        clean = []
        for ep in eps:
            if not (isinstance(ep, list) and len(ep) == 2 and all(isinstance(x, str) and len(x) <= 300 for x in ep)):
                raise ValueError("lmcache.endpoints: each one is [url, identity]")
            from lmcache.transfer_wire import split_url

            split_url(ep[0])  # ValueError for a malformed address
            clean.append([ep[0], ep[1]])
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError("lmcache.tokens must be a positive whole number")
        return PDPlan(pull={"offer": offer_name(lm.get("offer")), "endpoints": clean, "tokens": tokens})
    if pd.role == "sender" and pd.peer_init_port and not params.get("do_remote_prefill"):
        return PDPlan(target=PushTarget(pd.peer_host, list(pd.peer_init_port)), static=True,
                      ret_first_tok=bool(params.get("ret_first_tok")))
    if params.get("ret_first_tok") and sender:
        return PDPlan(ret_first_tok=True)
    return None


# ------------------------------------------------------------------ where a worker's endpoint is
def endpoint_file(instance: str, dp_rank: int, tp_rank: int) -> str:
    """Where a worker writes its transfer endpoint's address, for the scheduler on its host."""
    from ...services.lookup import socket_path

    return socket_path(instance, dp_rank, tp_rank)[: -len(".sock")] + ".transfer.json"


def read_endpoints(instance: str, dp_rank: int, tp_size: int) -> list[list[str]] | None:
    """Every rank's ``[url, identity]`` (``None`` while one has not written its file)."""
    out = []
    for r in range(tp_size):
        try:
            with open(endpoint_file(instance, dp_rank, r)) as f:
                d = json.load(f)
            out.append([str(d["url"]), str(d["identity"])])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return out


def advertised(host: str, port: int, advertise: str | None) -> str:
    """The address peers use to reach an endpoint bound to ``host:port``."""
    h = advertise or (host if host not in ("0.0.0.0", "::", "") else None) or os.environ.get("POD_IP")
    if not h:
        try:
            h = socket.gethostbyname(socket.gethostname())
        except OSError:
            h = "127.0.0.1"
    return f"[{h}]:{port}" if ":" in h else f"{h}:{port}"


def receiver_port(config: Config, tp_rank: int) -> dict[str, Any]:
    """The ``transfer`` overrides of one worker: a receiver's rank listens on
    ``pd.peer_init_port[rank]`` at ``pd.peer_host`` (LMCache's keys)."""
    pd = config.pd
    if pd.role not in ("receiver", "both") or not pd.peer_init_port:
        return {}
    ports = list(pd.peer_init_port)
    port = ports[tp_rank] if tp_rank < len(ports) else ports[0] + tp_rank
    return {"host": pd.peer_host, "port": port}


# ------------------------------------------------------------------ the scheduler's side
class PDScheduler:
    """The scheduler's PD state: each request's plan (from its kv_transfer_params, read once),
    and what ``request_finished`` answers."""

    def __init__(self, config: Config, instance: str, dp_rank: int, tp_size: int):
        self.config = config
        self.instance, self.dp_rank, self.tp_size = instance, dp_rank, tp_size
        self.plans: dict[str, PDPlan] = {}
        self._endpoints: list[list[str]] | None = None
        self.stats = {"pd_pushes": 0, "pd_offers": 0, "pd_pulls": 0, "pd_refused": 0}

    def plan(self, request: Any) -> PDPlan | None:
        rid = request.request_id
        if rid in self.plans:
            return self.plans[rid]
        params = getattr(request, "kv_transfer_params", None) or {}
        try:
            p = plan_of(params, self.config) if isinstance(params, dict) else None
        except ValueError as exc:
            self.stats["pd_refused"] += 1
            log.warning("lmcache: PD: %s: kv_transfer_params refused (%s); computed without PD", rid, exc)
            p = None
        if p is not None:
            self.plans[rid] = p
        return p

    def pull_match(self, request: Any, num_computed: int, block_size: int) -> int:
        """Decoder, vLLM's flow: how many tokens past ``num_computed`` the offer brings
        (:func:`.common.usable_tokens`)."""
        p = self.plans[request.request_id]
        assert p.pull is not None
        offered = min(p.pull["tokens"], len(request.prompt_token_ids or []))
        return max(0, usable_tokens(offered, request.num_tokens, block_size) - num_computed)

    def send(self, req_id: str, prompt: list[int], extra: Any) -> PDSend | None:
        """The request's prompt is stored this step: what its workers send (once)."""
        p = self.plans.get(req_id)
        if p is None or p.sent or (p.target is None and p.offer is None):
            return None
        p.sent = True
        self.stats["pd_offers" if p.offer else "pd_pushes"] += 1
        return PDSend(req_id, list(prompt), extra, p.offer, p.target, p.notify_id, p.static)

    def finished(self, request: Any) -> dict[str, Any] | None:
        """What ``request_finished`` answers in kv_transfer_params (``None``: nothing)."""
        p = self.plans.pop(request.request_id, None)
        if p is None:
            return None
        out: dict[str, Any] = {}
        if p.ret_first_tok:
            toks = list(getattr(request, "output_token_ids", None) or [])
            if toks:
                out["first_tok"] = int(toks[0])
        if p.offer is not None and p.sent:
            eps = self._endpoints or read_endpoints(self.instance, self.dp_rank, self.tp_size)
            if eps is None:
                log.warning("lmcache: PD: %s: the workers' transfer endpoints are unknown; the decoder computes it",
                            request.request_id)
                return out or None
            self._endpoints = eps
            host, port = split_first(eps[0][0])
            out.update({"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [],
                        "remote_engine_id": self.instance, "remote_host": host, "remote_port": port,
                        "tp_size": self.tp_size,
                        "lmcache": {"offer": p.offer, "endpoints": eps, "tokens": len(request.prompt_token_ids or [])}})
        return out or None

    def forget(self, req_id: str) -> None:
        self.plans.pop(req_id, None)


def split_first(url: str) -> tuple[str, int]:
    from lmcache.transfer_wire import split_url

    h, p = split_url(url)
    return h, int(p)


# ------------------------------------------------------------------ the worker's side
class PDWorker:
    """One worker's PD work: offers and pushes after the step's saves, notifications to the
    proxy, pulls before a load. Pushes of LMCache's protocol run on two threads of their own."""

    def __init__(self, engine: CacheEngine, config: Config, tp_rank: int, instance: str, dp_rank: int):
        self.engine = engine
        self.pd = config.pd
        self.tp_rank = tp_rank
        self.svc = engine.services.get("transfer")
        self.nice = config.transfer.thread_nice  # of the push threads and of a pull (transfer_wire.raise_priority)
        self.stats = {"pushed": 0, "push_failed": 0, "offered": 0, "pulled": 0, "pull_failed": 0, "notified": 0,
                      "notify_failed": 0}
        self._pool: ThreadPoolExecutor | None = None
        self._zmq: Any = None
        self._zlock = threading.Lock()
        self._file: str | None = None
        if self.svc is None:
            log.error("lmcache: pd.role %s but no transfer endpoint (transfer_channel unset or unusable): "
                      "requests are computed without PD", self.pd.role)
            return
        h, p = self.svc.endpoint.server.address
        self.url = advertised(h, p, config.transfer.advertise_host)
        self._file = endpoint_file(instance, dp_rank, tp_rank)
        try:
            tmp = f"{self._file}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"url": self.url, "identity": self.svc.endpoint.identity}, f)
            os.replace(tmp, self._file)
        except OSError as exc:
            log.warning("lmcache: cannot write %s (%s): vLLM's kv_transfer_params flow cannot offer", self._file, exc)
            self._file = None
        log.info("lmcache PD %s: rank %d's transfer endpoint is %s (%s)", self.pd.role, tp_rank, self.url,
                 self.svc.endpoint.name)

    # ------------------------------------------------------------ prefiller
    def send(self, sends: list[PDSend]) -> None:
        """After the step's saves: offer or push each request whose prompt is stored."""
        for s in sends:
            keys: list[str] = []
            if self.svc is not None:
                try:
                    keys = self.engine.prompt(s.token_ids, s.extra, request=s.req_id).keys
                except Exception:
                    log.exception("lmcache: PD: cannot key %s", s.req_id)
            if s.offer is not None and self.svc is not None and keys:
                try:
                    r = self.svc.offer(keys, s.req_id, ttl=self.pd.offer_ttl, name=s.offer)
                    self.stats["offered"] += 1
                    if r["missing"]:
                        log.warning("lmcache: PD: %s: %d of %d chunks not held here; the decoder computes them",
                                    s.req_id, len(r["missing"]), len(keys))
                except Exception:
                    log.exception("lmcache: PD: offering %s failed; the decoder computes it", s.req_id)
            if s.target is None:
                continue
            if s.static:  # no notification tells anyone: done before the prefill's answer leaves
                self._push(s, keys)
                continue
            if self._pool is None:
                from lmcache.transfer_wire import raise_priority

                self._pool = ThreadPoolExecutor(2, thread_name_prefix="lmcache-pd-push", initializer=raise_priority,
                                                initargs=(self.nice,))
            self._pool.submit(self._push, s, keys)

    def _push(self, s: PDSend, keys: list[str]) -> None:
        assert s.target is not None
        url = s.target.url(self.tp_rank)
        try:
            if self.svc is None or not keys:
                raise RuntimeError("nothing to send (no transfer endpoint or no chunks)")
            r = self.svc.push(keys, url, s.notify_id or s.req_id)
            self.stats["pushed"] += 1
            log.debug("lmcache: PD: %s: %d chunks to %s in %.1f ms", s.req_id, r["chunks"], url, r["seconds"] * 1e3)
            if r["missing"] or r["rejected"]:
                log.warning("lmcache: PD: %s: %d chunks missing here, %d refused by %s; the decoder computes them",
                            s.req_id, len(r["missing"]), len(r["rejected"]), url)
        except Exception as exc:
            self.stats["push_failed"] += 1
            log.warning("lmcache: PD: pushing %s to %s failed (%s); the decoder computes it", s.req_id, url, exc)
        finally:
            if s.notify_id is not None:
                self.notify(s.notify_id)

    def notify(self, req_id: str) -> None:
        """Tell LMCache's proxy that this rank is done with ``req_id`` (bounded by ``pd.notify_timeout``)."""
        if not self.pd.notify or not self.pd.proxy_host or not self.pd.proxy_port:
            return
        try:
            import msgpack
            import zmq
        except ImportError as exc:  # the `events` extra: pip install 'lmcache[events]'
            self.stats["notify_failed"] += 1
            log.error("lmcache: PD: cannot notify the proxy of %s: %s (pip install pyzmq msgpack)", req_id, exc)
            return
        msg = msgpack.packb({"type": "ProxyNotif", "req_id": req_id})
        with self._zlock:
            try:
                if self._zmq is None:
                    ctx = zmq.Context.instance()
                    sock = ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.SNDTIMEO, int(self.pd.notify_timeout * 1000))
                    sock.setsockopt(zmq.LINGER, int(self.pd.notify_timeout * 1000))
                    host = self.pd.proxy_host
                    sock.connect(f"tcp://[{host}]:{self.pd.proxy_port}" if ":" in host
                                 else f"tcp://{host}:{self.pd.proxy_port}")
                    self._zmq = sock
                self._zmq.send(msg)
                self.stats["notified"] += 1
            except zmq.ZMQError as exc:
                self.stats["notify_failed"] += 1
                log.warning("lmcache: PD: notifying the proxy %s:%s of %s failed: %s", self.pd.proxy_host,
                            self.pd.proxy_port, req_id, exc)

    # ------------------------------------------------------------ decoder
    def pull(self, spec: LoadSpec) -> None:
        """Pull a request's offer into the engine (bounded by ``pd.recv_timeout``), then lease
        what arrived as the scheduler's lookup would have; the load that follows reads it."""
        p = spec.pull
        assert p is not None
        eps = p["endpoints"]
        t0 = time.perf_counter()
        try:
            if self.svc is None:
                raise RuntimeError("no transfer endpoint here")
            if self.tp_rank >= len(eps):
                raise RuntimeError(f"the offer names {len(eps)} ranks, this is rank {self.tp_rank}")
            url, ident = eps[self.tp_rank]
            from lmcache.transfer_wire import raised_priority

            with raised_priority(self.nice):  # this load thread copies, as a push thread does
                r = self.svc.pull_named(url, p["offer"], identity=ident,
                                        deadline=time.monotonic() + self.pd.recv_timeout)
            self.stats["pulled"] += 1
            log.debug("lmcache: PD: %s: pulled %d chunks (%d bytes) in %.1f ms", spec.req_id, r["committed"],
                      r["bytes"], (time.perf_counter() - t0) * 1e3)
        except Exception as exc:
            self.stats["pull_failed"] += 1
            log.warning("lmcache: PD: pulling %s failed after %.2f s (%s); vLLM computes what did not arrive",
                        spec.req_id, time.perf_counter() - t0, exc)
        self.engine.lookup(spec.keyed(self.engine), pin=True, extra=spec.extra)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._zlock:
            if self._zmq is not None:
                self._zmq.close()
                self._zmq = None
        if self._file is not None:
            try:
                os.unlink(self._file)
            except OSError:
                pass


__all__ = ["MAX_RANKS", "PDPlan", "PDScheduler", "PDWorker", "PushTarget", "advertised", "endpoint_file", "plan_of",
           "read_endpoints", "receiver_port"]
