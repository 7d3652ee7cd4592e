"""The chart's discovery modes and observability wiring, rendered by Helm's own engine.

- discovery: registry (default): every engine registers its pod IP (downward API) in the
  chart's Redis, the router watches it; both read the URL with the password from the same
  Secret as a file. dns: the router resolves the headless Services instead.
- The Grafana dashboard ships as a ConfigMap labelled for the sidecar (the same JSON as
  deploy/grafana); PodMonitors (opt-in) scrape every router and engine pod on a declared port.
"""

from __future__ import annotations

import json

import pytest

from pdserve.tests.deploy.test_helm_chart import (CHART, FULL, ROOT, by_kind, chart,  # noqa: F401
                                                  expanded_args, parse, render, workloads)


def _container(docs, component):
    spec = workloads(docs)[f"{FULL}-{component}"]["spec"]["template"]["spec"]
    return spec, spec["containers"][0]


def test_registry_mode_engines_register_pod_ips_and_router_watches(chart):
    docs, _ = render(chart, {"decode": {"replicas": 3}, "prefill": {"replicas": 2}})
    config = by_kind(docs, "ConfigMap")[FULL]["data"]
    assert "ROUTER_BACKENDS" not in config and "PREFILL_BACKENDS" not in config
    _, master = _container(docs, "kvstore-master")
    redis_url = parse(expanded_args(docs, master)).redis_url
    spec, router = _container(docs, "router")
    rargs = parse(expanded_args(docs, router))
    assert rargs.registry == redis_url and rargs.backends == rargs.prefill_backends == ""
    assert "redis" not in " ".join(router["args"])  # the URL (password) is only in the file
    for role, port in (("decode", 50061), ("prefill", 50071)):
        spec, c = _container(docs, role)
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
        assert env == {"POD_IP": "status.podIP"}
        args = parse(expanded_args(docs, c))
        assert args.registry == redis_url
        assert args.advertise_address == f"10.1.2.3:{port}" and args.port == port
        vol = next(v for v in spec["volumes"] if v["name"] == "registry-url")
        assert vol["secret"]["defaultMode"] == 0o440
    # the registry needs no per-pod Service, but the headless ones stay (dns mode, DNS names)
    assert by_kind(docs, "Service")[f"{FULL}-decode"]["spec"]["clusterIP"] == "None"
    # a router config the service accepts
    from pdserve.services.cli_serve import _addresses
    from pdserve.services.router.cli_args import router_config

    cfg = router_config(rargs, _addresses)
    assert cfg.registry_url == redis_url and cfg.disaggregated


def test_dns_mode_lists_the_headless_services(chart):
    docs, _ = render(chart, {"discovery": "dns"})
    config = by_kind(docs, "ConfigMap")[FULL]["data"]
    assert config["ROUTER_BACKENDS"] == f"dns:{FULL}-decode:50061"
    for component in ("router", "decode", "prefill"):
        spec, c = _container(docs, component)
        assert "registry-url" not in {v["name"] for v in spec["volumes"]}
        assert parse(expanded_args(docs, c)).registry == ""


def test_bad_discovery_is_refused(chart):
    import helm_python as helm

    with pytest.raises(helm.HelmError):
        render(chart, {"discovery": "static"})


def test_dashboard_configmap_for_the_grafana_sidecar(chart):
    source = (ROOT / "deploy" / "grafana" / "pdserve-dashboard.json").read_text()
    assert (CHART / "dashboards" / "pdserve-dashboard.json").read_text() == source
    docs, _ = render(chart, {})
    cm = by_kind(docs, "ConfigMap")[f"{FULL}-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["pdserve-dashboard.json"]) == json.loads(source)
    docs, _ = render(chart, {"grafanaDashboard": {"enabled": False}})
    assert f"{FULL}-dashboard" not in by_kind(docs, "ConfigMap")


def test_podmonitors_scrape_router_and_engines_on_declared_ports(chart):
    docs, _ = render(chart, {})
    assert not by_kind(docs, "PodMonitor")  # the CRD may be absent: opt-in
    docs, _ = render(chart, {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}})
    monitors = by_kind(docs, "PodMonitor")
    assert set(monitors) == {f"{FULL}-{c}" for c in ("router", "prefill", "decode")}
    for name, pm in monitors.items():
        assert pm["metadata"]["labels"]["release"] == "kps"
        spec, c = _container(docs, name.removeprefix(f"{FULL}-"))
        pod_labels = workloads(docs)[name]["spec"]["template"]["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        endpoint = pm["spec"]["podMetricsEndpoints"][0]
        role = name.removeprefix(f"{FULL}-")  # decode's role is decode by default
        assert endpoint["relabelings"] == [{"targetLabel": "role", "replacement": role}]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        if endpoint["port"] == "metrics":  # the engine serves its metrics there
            assert parse(expanded_args(docs, c)).metrics_port == ports["metrics"]
    # and the NetworkPolicies let the scraper in on that port
    for role in ("prefill", "decode"):
        policy = by_kind(docs, "NetworkPolicy")[f"{FULL}-{role}"]
        ports = [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]]
        assert 9400 in ports
