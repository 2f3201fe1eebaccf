"""docs/metrics.md lists exactly the metrics the services define (name, type, labels, which
services expose them), and the Grafana dashboard queries only those."""

from __future__ import annotations

import json
import re
from pathlib import Path

import metrics_catalog
import pytest
from metrics_catalog import Metric

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
SOURCES = [ROOT / "pdserve", ROOT / "services"]

_ROW = re.compile(r"^\|\s*`(pdserve_[a-z0-9_]+)`\s*\|([^|]*)\|([^|]*)\|([^|]*)\|")


def parse_doc(text: str) -> dict[str, tuple[Metric, frozenset[str]]]:
    """{name: (Metric, services)} from the doc's tables; a name listed twice is an error."""
    out: dict[str, tuple[Metric, frozenset[str]]] = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        name, type_, labels, services = (g.strip() for g in m.groups())
        assert name not in out, f"{name} is listed twice"
        label_set = () if labels == "-" else tuple(sorted(x.strip() for x in labels.split(",")))
        out[name] = (
            Metric(name, type_, label_set),
            frozenset(s.strip() for s in services.split(",")),
        )
    return out


@pytest.fixture(scope="module")
def catalog() -> dict[str, dict[str, Metric]]:
    return metrics_catalog.by_service()


@pytest.fixture(scope="module")
def documented() -> dict[str, tuple[Metric, frozenset[str]]]:
    return parse_doc(DOC.read_text())


def _normalized(m: Metric) -> Metric:
    return Metric(m.name, m.type, tuple(sorted(m.labels)))


def doc_problems(catalog: dict[str, dict[str, Metric]], documented: dict) -> list[str]:
    problems = []
    services: dict[str, set[str]] = {}
    defined: dict[str, Metric] = {}
    for service, metrics in catalog.items():
        for name, m in metrics.items():
            services.setdefault(name, set()).add(service)
            defined[name] = _normalized(m)
    for name, m in sorted(defined.items()):
        if name not in documented:
            problems.append(f"{name} ({m.type}) is not in docs/metrics.md")
            continue
        doc_m, doc_services = documented[name]
        if doc_m != m:
            problems.append(f"{name}: the doc says {doc_m}, the code defines {m}")
        if doc_services != services[name]:
            problems.append(
                f"{name}: the doc says exposed by {sorted(doc_services)}, "
                f"the code by {sorted(services[name])}"
            )
    problems += [
        f"{n} is documented but not defined" for n in sorted(set(documented) - set(defined))
    ]
    return problems


def test_every_metric_is_documented_and_nothing_else(catalog, documented):
    assert doc_problems(catalog, documented) == []
    assert len(documented) >= 60  # the tables parsed, not skipped


def test_the_doc_check_catches_drift(catalog, documented):
    drifted = dict(documented)
    gone = drifted.pop("pdserve_router_ttft_seconds")
    m, services = drifted["pdserve_meta_instances"]
    drifted["pdserve_meta_instances"] = (Metric(m.name, "counter", ()), services)
    drifted["pdserve_router_made_up_total"] = (Metric("x", "counter", ()), frozenset({"router"}))
    problems = doc_problems(catalog, drifted)
    assert any(p.startswith("pdserve_router_ttft_seconds (histogram) is not") for p in problems)
    assert any(p.startswith("pdserve_meta_instances: the doc says") for p in problems)
    assert "pdserve_router_made_up_total is documented but not defined" in problems
    assert gone[0].type == "histogram"


def test_the_catalog_covers_every_metric_the_services_register(catalog):
    """A metric registered by a module the catalog does not know about fails here."""
    known = {name for metrics in catalog.values() for name in metrics}
    missing = metrics_catalog.registered_at_import() - known
    assert not missing, f"add their modules to tests/deploy/metrics_catalog.py MODULES: {missing}"


def test_every_metric_name_in_the_source_is_in_the_catalog(catalog):
    """Belt and braces: every ``"pdserve_..."`` literal in a module that uses prometheus_client
    names a cataloged metric family (or, ending in ``_``, prefixes some)."""
    families = set()
    for metrics in catalog.values():
        for m in metrics.values():
            families |= {m.name, m.name.removesuffix("_total")}
    literal = re.compile(r"[\"'](pdserve_[a-z0-9_]*)[\"']")
    unknown = []
    for top in SOURCES:
        for path in top.rglob("*.py"):
            if "bench" in path.parts:  # the benchmark reads metrics, it defines none
                continue
            text = path.read_text()
            if "prometheus_client" not in text:
                continue
            for name in literal.findall(text):
                ok = (
                    any(f.startswith(name) for f in families)
                    if name.endswith("_")
                    else name in families
                )
                if not ok:
                    unknown.append(f"{path.relative_to(ROOT)}: {name}")
    assert unknown == [], (
        "a metric the catalog misses: add its module to MODULES in tests/deploy/metrics_catalog.py "
        "and the metric to docs/metrics.md"
    )


# --- the Grafana dashboard ------------------------------------------------------------------

_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _expressions(dashboard: dict) -> list[tuple[str, str]]:
    out = []

    def walk(panels):
        for p in panels:
            out.extend((p.get("title", ""), t["expr"]) for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    return out


def query_problems(
    exprs: list[tuple[str, str]], catalog: dict[str, dict[str, Metric]]
) -> list[str]:
    """Names a PromQL expression uses that no documented metric exposes, and expressions that
    query no pdserve metric at all."""
    series = set()
    for metrics in catalog.values():
        for m in metrics.values():
            series |= m.series()
    problems = []
    for title, expr in exprs:
        stripped = re.sub(r'"[^"]*"', '""', expr)  # label values are not names
        stripped = re.sub(r"\[[^\]]*\]", "", stripped)  # nor ranges ($__rate_interval)
        names = [n for n in _IDENT.findall(stripped) if n.startswith("pdserve_")]
        if not names:
            problems.append(f"{title!r}: {expr} queries no pdserve metric")
        problems += [f"{title!r}: {n} is not a documented metric" for n in names if n not in series]
        hq = re.findall(r"histogram_quantile\([^,]+,[^()]*\(\s*rate\(\s*([a-z0-9_]+)", expr)
        problems += [
            f"{title!r}: quantile of {n}, not a _bucket" for n in hq if not n.endswith("_bucket")
        ]
    return problems


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_queries_only_documented_metrics(dashboard, catalog, documented):
    exprs = _expressions(dashboard)
    assert len(exprs) >= 30
    assert query_problems(exprs, catalog) == []
    # and the names the doc lists are the same the check uses
    assert set(documented) == {n for metrics in catalog.values() for n in metrics}


def test_the_query_check_catches_a_made_up_or_misspelt_name(catalog):
    bad = [
        ("a", "sum(rate(pdserve_router_request_total[5m]))"),  # no such counter
        (
            "b",
            "histogram_quantile(0.9, sum by (le) (rate(pdserve_router_tpot_seconds_bucket[5m])))",
        ),
        ("c", "sum(pdserve_router_ttft_seconds_total)"),  # a histogram has no _total
        ("d", "sum(up)"),
    ]
    problems = query_problems(bad, catalog)
    assert len(problems) == 4, problems
    assert (
        query_problems([("ok", 'sum(rate(pdserve_router_requests_total{plan="x"}[1m]))')], catalog)
        == []
    )


def test_the_dashboard_is_a_grafana_model_with_a_prometheus_variable(dashboard):
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    (var,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert var["query"] == "prometheus"
    ids, titles = set(), set()

    def walk(panels):
        for p in panels:
            assert p["id"] not in ids, f"panel id {p['id']} twice"
            ids.add(p["id"])
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]
            if p["type"] != "row":
                assert p["title"] not in titles, f"panel {p['title']!r} twice"
                titles.add(p["title"])
                # every panel and query uses the variable, not a fixed datasource
                assert p["datasource"]["uid"] == "${" + var["name"] + "}", p["title"]
                assert p["targets"] and all(
                    t["datasource"] == p["datasource"] for t in p["targets"]
                )
                assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    # panels do not overlap
    cells = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps another panel"
                cells.add((x, y))


#: What operators watch: the dashboard must query each of these.
WATCHED = [
    "pdserve_router_requests_total",
    "pdserve_router_ttft_seconds_bucket",
    "pdserve_router_e2e_seconds_bucket",
    "pdserve_router_phase_seconds_sum",
    "pdserve_router_rejected_total",
    "pdserve_router_workers",
    "pdserve_router_refused_workers_total",
    "pdserve_router_breaker_trips_total",
    "pdserve_router_queued",
    "pdserve_decode_running_requests",
    "pdserve_router_prompt_tokens_total",
    "pdserve_kvstore_master_objects",
    "pdserve_kvstore_master_used_bytes",
    "pdserve_kvstore_master_capacity_bytes",
    "pdserve_kvstore_master_puts_total",
    "pdserve_kvstore_master_gets_total",
    "pdserve_kvnode_bytes_read",
    "pdserve_kvstore_master_repairs_total",
    "pdserve_kvstore_master_under_replicated",
]


def test_the_dashboard_shows_what_operators_watch(dashboard):
    text = " ".join(expr for _, expr in _expressions(dashboard))
    used = set(_IDENT.findall(text))
    assert [n for n in WATCHED if n not in used] == []
