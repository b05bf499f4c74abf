"""Prometheus metrics: request counters and latencies, and the engine's state read at scrape time."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvtier.engine.outputs import RequestOutput

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# the kvtier_kv_tier_* families every tier has: a tier's own gauge of one of these names is left out (base.py)
TIER_FAMILIES = {"lookups", "hit_blocks", "bytes_read", "bytes_written", "evictions", "hit_tokens", "bytes_used",
                 "budget_bytes", "bandwidth_bytes_per_second", "computed_instead_tokens"}
# what the tiers' own gauges (Tier.extra_stats) mean; one a tier adds without a line here gets a generic text
TIER_GAUGES = {"pinned_bytes": "Bytes the tier keeps pinned for live bounded sequences",
               "buffer_bytes": "Bytes of the tier's budget given to the mover's read buffers",
               "enabled": "1 while the tier serves, 0 while it is disabled (it tries again after a back-off)"}
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Metrics:
    """One registry per app, so that several apps (and tests) never share counters."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvtier_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.errors = Counter("kvtier_request_errors", "HTTP requests answered with an error, by endpoint, status "
                              "code and reason", ["endpoint", "status", "reason"], registry=r)
        self.prompt_tokens = Counter("kvtier_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter("kvtier_cached_prompt_tokens",
                                            "Prompt tokens restored from the KV cache instead of computed",
                                            registry=r)
        self.generation_tokens = Counter("kvtier_generation_tokens", "Tokens generated", registry=r)
        self.time_to_first_token = Histogram("kvtier_time_to_first_token_seconds",
                                             "From request arrival to its first output token",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("kvtier_time_per_output_token_seconds",
                                               "Mean time between output tokens after the first, per request",
                                               buckets=TPOT_BUCKETS, registry=r)
        self.request_latency = Histogram("kvtier_request_latency_seconds", "From request arrival to its last token",
                                         buckets=LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(engine))

    def observe_finished(self, out: RequestOutput, arrival: float, first_token: float, end: float) -> None:
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.cached_prompt_tokens.inc(out.num_cached_tokens)
        self.generation_tokens.inc(out.num_output_tokens)
        self.request_latency.observe(end - arrival)
        if out.num_output_tokens > 1:
            self.time_per_output_token.observe((end - first_token) / (out.num_output_tokens - 1))

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """Pool and queue gauges, read from engine.stats() once per scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        total, used = s["num_blocks"], s["num_blocks"] - s["num_free_blocks"]
        yield GaugeMetricFamily("kvtier_kv_pool_blocks_total", "Blocks in the device KV pool", value=total)
        yield GaugeMetricFamily("kvtier_kv_pool_blocks_used", "Device KV blocks held by requests", value=used)
        yield GaugeMetricFamily("kvtier_kv_pool_usage_ratio", "Share of the device KV pool in use",
                                value=used / total if total else 0.0)
        yield GaugeMetricFamily("kvtier_kv_pool_blocks_cached", "Device KV blocks published under a content key",
                                value=s["num_cached_blocks"])
        yield from self._tiers(s)
        yield from self._residency(s.get("residency"))
        yield from self._speculation(s.get("speculation"))
        yield GaugeMetricFamily("kvtier_requests_running", "Requests being prefilled or decoded",
                                value=s["num_running"])
        yield GaugeMetricFamily("kvtier_requests_waiting", "Requests queued for the engine", value=s["num_waiting"])

    @staticmethod
    def _speculation(sp: dict | None):
        if sp is None:
            return
        for name, doc in (("proposed_tokens", "Draft tokens proposed for verify steps"),
                          ("accepted_tokens", "Draft tokens the target accepted"),
                          ("verify_steps", "Verify steps (a sequence's last token and its draft, in one step)")):
            yield _labelled(CounterMetricFamily(f"kvtier_spec_{name}", doc, labels=["method"]), sp["method"],
                            sp[name])
        if steps := sp["verify_steps"]:
            yield _labelled(GaugeMetricFamily("kvtier_spec_mean_acceptance_length", "Tokens a verify step appends "
                                              "on average: the accepted draft tokens and the target's own",
                                              labels=["method"]), sp["method"], 1 + sp["accepted_tokens"] / steps)

    @staticmethod
    def _residency(r: dict | None):
        if r is None:
            return
        for name, doc in (("page_ins", "Blocks paged back onto the device under bounded residency"),
                          ("page_outs", "Blocks paged out to the host tier under bounded residency"),
                          ("reselects", "Residency reselections (score, page out losers, page in winners)"),
                          ("reselect_seconds", "Time spent in residency reselections")):
            yield CounterMetricFamily(f"kvtier_kv_{name}", doc, value=r[name])
        yield GaugeMetricFamily("kvtier_kv_max_resident_blocks", "Most device blocks one sequence has held",
                                value=r["max_resident_blocks"])
        yield GaugeMetricFamily("kvtier_kv_host_reserved_bytes", "Host-tier bytes promised to admitted bounded "
                                "sequences' paged-out blocks", value=r["host_reserved_bytes"])

    @staticmethod
    def _tiers(s: dict):
        tiers = s.get("tiers", {})
        if not tiers:
            return
        counters = {"lookups": "Prefix lookups", "hit_blocks": "Blocks restored from the tier",
                    "bytes_read": "Bytes read from the tier", "bytes_written": "Bytes written to the tier",
                    "evictions": "Blocks or files evicted under the tier's budget"}
        for name, doc in counters.items():
            family = CounterMetricFamily(f"kvtier_kv_tier_{name}", doc, labels=["tier"])
            for tier, st in tiers.items():
                family.add_metric([tier], st.get(name, 0))
            yield family
        hit_tokens = CounterMetricFamily("kvtier_kv_tier_hit_tokens", "Prompt tokens restored from the tier",
                                         labels=["tier"])
        for gauge, doc in (("bytes_used", "Bytes held by the tier"), ("budget_bytes", "The tier's byte budget")):
            family = GaugeMetricFamily(f"kvtier_kv_tier_{gauge}", doc, labels=["tier"])
            for tier, st in tiers.items():
                family.add_metric([tier], st[gauge])
            yield family
        for tier, st in tiers.items():
            hit_tokens.add_metric([tier], st.get("hit_blocks", 0) * s["block_size"])
        yield hit_tokens
        for gauge in sorted({name for st in tiers.values() for name in st["gauges"]} - TIER_FAMILIES):  # their own
            family = GaugeMetricFamily(f"kvtier_kv_tier_{gauge}", TIER_GAUGES.get(gauge, "A tier's own gauge"),
                                       labels=["tier"])
            for tier, st in tiers.items():
                if gauge in st["gauges"]:
                    family.add_metric([tier], st["gauges"][gauge])
            yield family
        rates = s["rates"]
        bandwidth = GaugeMetricFamily("kvtier_kv_tier_bandwidth_bytes_per_second", "Measured restore bandwidth of "
                                      "the tier (read and copy to the device), which compute-or-load weighs",
                                      labels=["tier"])
        for tier, value in rates["tier_bytes_per_s"].items():
            bandwidth.add_metric([tier], value)
        yield bandwidth
        if rates["prefill_tokens_per_s"] is not None:
            yield GaugeMetricFamily("kvtier_prefill_tokens_per_second", "Measured prefill rate, which "
                                    "compute-or-load weighs", value=rates["prefill_tokens_per_s"])
        computed = CounterMetricFamily("kvtier_kv_tier_computed_instead_tokens", "Cached tokens the tier holds that "
                                       "were computed again, beside or instead of a load, because that was faster",
                                       labels=["tier"])
        for tier, value in rates["computed_instead"].items():
            computed.add_metric([tier], value)
        yield computed
        cumulative, buckets = 0, []
        for le, count in zip((*s["load_buckets"], float("inf")), s["load_counts"]):
            cumulative += count
            buckets.append((str(le) if le != float("inf") else "+Inf", cumulative))
        yield HistogramMetricFamily("kvtier_kv_load_seconds", "Time to restore a prefix from the tiers",
                                    buckets=buckets, sum_value=s["load_seconds_sum"])
        yield GaugeMetricFamily("kvtier_requests_loading", "Requests waiting for their prefix to load",
                                value=s["num_loading"])


class RequestCounter:
    """ASGI middleware counting finished HTTP requests by endpoint and status (streams count when they end)."""

    def __init__(self, app, metrics: Metrics, endpoints: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints   # a fixed set, so that random paths cannot grow the label space

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in self.endpoints:
            return await self.app(scope, receive, send)
        status = 500   # if the app raises before answering

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.requests.labels(scope["path"], str(status)).inc()
            if status >= 400:
                # an unexpected exception is answered outside this middleware, with no reason left behind
                reason = scope.get("state", {}).get("error_reason", "server_error" if status >= 500 else "unknown")
                self.metrics.errors.labels(scope["path"], str(status), reason).inc()


def _labelled(family, label: str, value: float):
    family.add_metric([label], value)
    return family
