"""deploy/helm/pdserve, linted and rendered by Helm's own engine (helm-python-sdk, offline),
every manifest validated against the Kubernetes schemas (kubernetes-validate), for the default
values and the GPU, scale and external-Redis examples (plus one with every option on).

Beyond the schemas: every container's args, after Kubernetes' $(VAR) expansion from the
rendered ConfigMap, Secrets and env, parse with `pdserve.cli.build_parser()`; the ports the
chart names are the CLI's defaults and the ones the args listen on; probes use the router's
real routes; Services, HPAs and the ServiceMonitor point at things that exist.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python as helm
import kubernetes_validate as kv
import pytest
import yaml
from kubernetes_validate.utils import latest_version

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
KUBE_VERSIONS = ("1.25.0", latest_version())  # the chart's kubeVersion floor, newest
RELEASE, NAMESPACE = "demo", "llm"
FULL = f"{RELEASE}-pdserve"

EVERYTHING = {
    "servedModelName": "my-model",
    "apiKeys": {"keys": ["k1", "k2"]},
    "router": {"service": {"type": "LoadBalancer"}, "extraArgs": ["--health-interval", "2"]},
    "decode": {"extraArgs": ["--block-size", "32"], "kvCacheBytes": None},
    "autoscaling": {r: {"enabled": True, "minReplicas": 1, "maxReplicas": 3,
                        "targetCPUUtilizationPercentage": 75}
                    for r in ("router", "prefill", "decode")},
    "serviceMonitor": {"enabled": True},
    "redis": {"persistence": {"enabled": False}},
    "imagePullSecrets": [{"name": "regcred"}],
}
EXISTING_SECRET = {"redis": {"enabled": False, "external": {"existingSecret": "my-redis",
                                                             "existingSecretKey": "url"}}}


def _example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())


SCENARIOS = {
    "default": {},
    "gpu": _example("gpu"),
    "scale": _example("scale"),
    "external-redis": _example("external-redis"),
    "external-redis-secret": EXISTING_SECRET,
    "everything": EVERYTHING,
    "colocated": {"decode": {"role": "unified"}, "prefill": {"replicas": 0}},
    "dns": {"discovery": "dns"},
}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def render(chart, values: dict) -> tuple[list[dict], str]:
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    notes = next(t for p, t in out.items() if p.endswith("NOTES.txt"))
    return docs, notes


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs):
    return {**by_kind(docs, "Deployment"), **by_kind(docs, "StatefulSet")}


def expanded_args(docs, container) -> list[str]:
    """The container's args after Kubernetes expands $(VAR) from its env and envFrom."""
    env = {}
    for src in container.get("envFrom", []):
        env.update(by_kind(docs, "ConfigMap")[src["configMapRef"]["name"]]["data"])
    secrets = by_kind(docs, "Secret")
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            env[var["name"]] = {"status.podIP": "10.1.2.3",
                                "metadata.name": "pod-abc"}[ref["fieldRef"]["fieldPath"]]
        else:
            key = ref["secretKeyRef"]
            secret = secrets.get(key["name"])
            env[var["name"]] = (secret["stringData"][key["key"]] if secret
                                else "redis://user-secret:6379/0")  # the user's own Secret
    args = []
    for word in container["args"]:
        for name in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", word):
            assert name in env, f"$({name}) in {container['name']} args has no value"
        args.append(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], word))
    return [mounted_file(docs, container, w[1:]) if w.startswith("@") else w for w in args]


def mounted_file(docs, container, path: str) -> str:
    """What `--flag @PATH` reads (services/common/arg_files.py): PATH in a Secret volume."""
    spec = next(w["spec"]["template"]["spec"] for w in workloads(docs).values()
                if container in w["spec"]["template"]["spec"]["containers"])
    folder, _, name = path.rpartition("/")
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == folder)
    source = next(v for v in spec["volumes"] if v["name"] == mount["name"])["secret"]
    key = next(i["key"] for i in source["items"] if i["path"] == name)
    secret = by_kind(docs, "Secret").get(source["secretName"])
    return secret["stringData"][key] if secret else "redis://user-secret:6379/0"


def parse(argv):
    from pdserve.cli import build_parser

    return build_parser().parse_args(argv)


def _master(docs, address: str) -> bool:
    """`address` is the KV store master's Service and port."""
    host, port = address.rsplit(":", 1)
    svc = by_kind(docs, "Service").get(host)
    return (svc is not None and svc["metadata"]["labels"]["app.kubernetes.io/component"] ==
            "kvstore-master" and int(port) in [p["port"] for p in svc["spec"]["ports"]])


def pdserve_containers(docs):
    for wl in workloads(docs).values():
        for c in wl["spec"]["template"]["spec"]["containers"]:
            if c["image"].startswith("redis"):
                continue
            yield wl, c


# ---------------------------------------------------------------- lint, schema, kube schemas


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_lint_is_clean(scenario):
    report = helm.lint(str(CHART), SCENARIOS[scenario], strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_manifest_validates_against_kubernetes_schemas(chart, scenario):
    chart.validate_schema(SCENARIOS[scenario])
    docs, _ = render(chart, SCENARIOS[scenario])
    assert docs
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":  # a CRD: no upstream schema, checked below
            continue
        for version in KUBE_VERSIONS:
            kv.validate(doc, version, strict=True)


def test_values_schema_rejects_bad_values(chart):
    for bad in ({"decode": {"role": "prefill"}}, {"ports": {"routerHttp": "80"}},
                {"decode": {"antiAffinity": "sometimes"}}, {"unknownKey": 1},
                {"redis": {"external": {"url": "http://not-redis"}}},
                {"kvstore": {"node": {"transport": "carrier-pigeon"}}}):
        with pytest.raises(helm.HelmError):
            chart.validate_schema(bad)
    with pytest.raises(helm.HelmError):  # bundled Redis on and an external URL: ambiguous
        chart.render({"redis": {"external": {"url": "redis://x:6379/0"}}}, name=RELEASE)
    with pytest.raises(helm.HelmError):  # no Redis at all
        chart.render({"redis": {"enabled": False}}, name=RELEASE)


# ---------------------------------------------------------------- commands, ports, probes

CLI_PORTS = {  # values.ports key -> (`pdserve serve` service, flag)
    "routerHttp": ("router", "port"), "routerGrpc": ("router", "grpc_port"),
    "decode": ("decode", "port"), "prefill": ("prefill", "port"),
    "kvstoreMaster": ("kvstore-master", "port"),
}


def test_port_defaults_are_the_cli_defaults(chart):
    ports = chart.values["ports"]
    for key, (service, attr) in CLI_PORTS.items():
        assert ports[key] == getattr(parse(["serve", service]), attr), key
    # The node transport's CLI default is 0 (any free port); the chart gives it a fixed,
    # declared containerPort, and the image EXPOSEs the same one.
    assert parse(["serve", "kvstore-node"]).node_port == 0
    assert str(ports["kvstoreNode"]) in (ROOT / "deploy/docker/Dockerfile").read_text()
    values = chart.values
    defaults = parse(["serve", "decode"])
    for role in ("decode", "prefill"):
        assert values[role]["maxModelLen"] == defaults.max_model_len
        assert values[role]["maxNumSeqs"] == defaults.max_num_seqs
        assert values[role]["numThreads"] == defaults.num_threads
    assert values["model"] == defaults.model
    router = parse(["serve", "router"])
    assert values["router"]["maxN"] == router.max_n
    assert values["router"]["minPrefillTokens"] == router.min_prefill_tokens
    assert values["router"]["prefillTimeout"] == router.prefill_timeout
    # pinned rather than "auto" (resolved per host): node and GPU engine pods must agree
    assert values["kvstore"]["node"]["transport"] == "tcp" and defaults.kv_transport == "auto"
    master = parse(["serve", "kvstore-master"])
    assert values["kvstore"]["master"]["namespace"] == master.namespace
    assert values["kvstore"]["master"]["replicaNum"] == master.replica_num
    assert values["kvstore"]["master"]["nodeTimeout"] == master.node_timeout
    assert values["kvstore"]["node"]["capacityMiB"] == parse(["serve", "kvstore-node"]).capacity_mib


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_container_args_parse_and_listen_where_declared(chart, scenario):
    values = chart.merge_values(SCENARIOS[scenario])
    docs, _ = render(chart, SCENARIOS[scenario])
    services_seen = set()
    for wl, c in pdserve_containers(docs):
        args = parse(expanded_args(docs, c))
        assert args.command == "serve" and callable(args.func)
        services_seen.add(args.service)
        declared = {p["name"]: p["containerPort"] for p in c["ports"]}
        if args.service == "router":
            assert declared == {"http": args.port, "grpc": args.grpc_port}
            assert args.model == values["model"]
            registry = values["discovery"] == "registry"
            if registry:  # the engines register their pod IPs; nothing is listed
                assert args.registry.startswith("redis://") and args.backends == ""
            for b in [] if registry else args.backends.split(","):
                assert b.startswith("dns:")  # the router resolves the pods, not a ClusterIP
                host, port = b.removeprefix("dns:").rsplit(":", 1)
                svc = by_kind(docs, "Service")[host]
                assert svc["spec"]["clusterIP"] == "None"  # headless: one address per pod
                assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
                assert svc["metadata"]["labels"]["app.kubernetes.io/component"] == "decode"
            if values["servedModelName"]:
                assert args.served_model_name == values["servedModelName"]
            assert _master(docs, args.kv_store)
            if values["decode"]["role"] == "decode":  # disaggregated
                for b in [] if registry else args.prefill_backends.split(","):
                    assert b.startswith("dns:")
                    host, port = b.removeprefix("dns:").rsplit(":", 1)
                    svc = by_kind(docs, "Service")[host]
                    assert svc["spec"]["clusterIP"] == "None"
                    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
                    assert svc["metadata"]["labels"]["app.kubernetes.io/component"] == "prefill"
                assert args.min_prefill_tokens == values["router"]["minPrefillTokens"]
                assert args.prefill_timeout == values["router"]["prefillTimeout"]
            else:
                assert args.prefill_backends == ""
        elif args.service in ("decode", "prefill"):
            assert declared == {"grpc": args.port, "metrics": args.metrics_port}
            assert args.metrics_port == values["ports"]["engineMetrics"]
            assert args.host == "0.0.0.0" and args.model == values["model"]
            if values["discovery"] == "registry":  # registers its own pod IP
                assert args.registry.startswith("redis://")
                assert args.advertise_address == f"10.1.2.3:{args.port}"
            else:
                assert args.registry == "" and args.advertise_address == ""
            assert args.kv_cache_bytes == values[args.service].get("kvCacheBytes")  # null: unset
            assert args.role == (values["decode"]["role"] if args.service == "decode"
                                 else "prefill")
            assert _master(docs, args.kv_store)
            assert args.kv_transport == values["kvstore"]["node"]["transport"]
        elif args.service == "kvstore-master":
            assert declared == {"grpc": args.port}
            assert args.redis_url.startswith("redis://")
            if not values["redis"]["enabled"] and values["redis"]["external"]["url"]:
                assert args.redis_url == values["redis"]["external"]["url"]
        elif args.service == "kvstore-node":
            assert declared == {"transport": args.node_port}
            assert args.host == "10.1.2.3" and args.node_id == "pod-abc"  # the pod's own
            host, port = args.master.rsplit(":", 1)
            assert int(port) == values["ports"]["kvstoreMaster"]
            assert host in by_kind(docs, "Service")
        else:
            pytest.fail(args.service)
    assert services_seen == {"router", "decode", "prefill", "kvstore-master", "kvstore-node"}


@pytest.mark.parametrize("scenario", ["default", "everything"])
def test_probes_use_real_health_endpoints(chart, scenario):
    from pdserve.tests.deploy.router_routes import router_app

    routes = {r.path for r in router_app().routes}
    docs, _ = render(chart, SCENARIOS[scenario])
    for wl, c in pdserve_containers(docs):
        args = parse(expanded_args(docs, c))
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c[probe]
            if args.service == "router":
                get = p["httpGet"]
                assert get["path"] in routes and get["port"] == "http"
            else:  # pdserve-healthcheck in auto mode: reads the process's own command line
                assert p["exec"]["command"] == ["pdserve-healthcheck", "--quiet"]
        if args.service == "router":
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_configmap_and_env_are_what_the_args_use(chart):
    """Every ConfigMap key and env var reaches a service: expanded into its args."""
    docs, _ = render(chart, EVERYTHING)
    config = by_kind(docs, "ConfigMap")[FULL]["data"]
    used = set()
    for _, c in pdserve_containers(docs):
        refs = {m for w in c["args"] for m in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", w)}
        used |= refs
        for var in c.get("env", []):
            assert var["name"] in refs, f"{c['name']}: env {var['name']} is never used"
    assert set(config) <= used, set(config) - used


# ---------------------------------------------------------------- the scenarios' specifics


def test_gpu_values(chart):
    docs, notes = render(chart, SCENARIOS["gpu"])
    deps = by_kind(docs, "Deployment")
    for role in ("prefill", "decode"):
        spec = deps[f"{FULL}-{role}"]["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["image"].endswith("-cuda")
        assert c["args"][c["args"].index("--device") + 1] == "cuda"  # the engine uses it
        assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    router = deps[f"{FULL}-router"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in router["resources"].get("limits", {})
    assert "CUDA" in notes
    default_docs, _ = render(chart, {})
    for _, c in pdserve_containers(default_docs):
        assert c["image"].endswith("-cpu")
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
        assert "--device" not in c.get("args", [])


def test_scale_values(chart):
    values = SCENARIOS["scale"]
    docs, _ = render(chart, values)
    deps = by_kind(docs, "Deployment")
    assert deps[f"{FULL}-prefill"]["spec"]["replicas"] == 2
    assert "replicas" not in deps[f"{FULL}-decode"]["spec"]  # the HPA owns it
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {f"{FULL}-router", f"{FULL}-decode"}
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deps
        assert hpa["spec"]["minReplicas"] >= 2
    anti = deps[f"{FULL}-decode"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["requiredDuringSchedulingIgnoredDuringExecution"][0]
    labels = deps[f"{FULL}-decode"]["spec"]["template"]["metadata"]["labels"]
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    assert deps[f"{FULL}-kvstore-node"]["spec"]["replicas"] == 2
    # the default: preferred (soft) anti-affinity between decode replicas
    docs, _ = render(chart, {})
    spec = by_kind(docs, "Deployment")[f"{FULL}-decode"]["spec"]["template"]["spec"]
    assert "preferredDuringSchedulingIgnoredDuringExecution" in spec["affinity"]["podAntiAffinity"]


def test_redis_bundled_or_external(chart):
    docs, _ = render(chart, {})
    sts = by_kind(docs, "StatefulSet")[f"{FULL}-redis"]
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    secret = by_kind(docs, "Secret")[FULL]["stringData"]
    password = secret["redis-password"]  # random per install, in the URL the master reads
    assert len(password) == 32 and secret["redis-url"] == f"redis://:{password}@{FULL}-redis:6379/0"
    docs, _ = render(chart, SCENARIOS["external-redis"])
    assert not by_kind(docs, "StatefulSet")
    assert f"{FULL}-redis" not in by_kind(docs, "Service")
    assert by_kind(docs, "Secret")[FULL]["stringData"]["redis-url"] == \
        SCENARIOS["external-redis"]["redis"]["external"]["url"]
    docs, _ = render(chart, EXISTING_SECRET)
    assert FULL not in by_kind(docs, "Secret")
    master = by_kind(docs, "Deployment")[f"{FULL}-kvstore-master"]["spec"]["template"]["spec"]
    url = next(v for v in master["volumes"] if v["name"] == "redis-url")["secret"]
    assert url["secretName"] == "my-redis" and url["items"] == [{"key": "url", "path": "url"}]
    assert "env" not in master["containers"][0]  # a file, not an environment variable


def test_services_select_pods_and_name_their_ports(chart):
    for scenario, values in SCENARIOS.items():
        docs, _ = render(chart, values)
        pods = {n: w["spec"]["template"] for n, w in workloads(docs).items()}
        for name, svc in by_kind(docs, "Service").items():
            sel = svc["spec"]["selector"]
            matches = [t for t in pods.values() if sel.items() <= t["metadata"]["labels"].items()]
            assert len(matches) == 1, (scenario, name)
            port_names = {p["name"] for c in matches[0]["spec"]["containers"]
                          for p in c.get("ports", [])}
            for p in svc["spec"]["ports"]:
                assert p["targetPort"] in port_names, (scenario, name, p)
        for name, wl in workloads(docs).items():
            assert wl["spec"]["selector"]["matchLabels"].items() <= \
                wl["spec"]["template"]["metadata"]["labels"].items()
            spec = wl["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True
            for c in spec["containers"]:
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
                assert "requests" in c["resources"], (name, c["name"])


def test_api_keys_secret_and_servicemonitor(chart):
    docs, notes = render(chart, EVERYTHING)
    keys = by_kind(docs, "Secret")[f"{FULL}-api-keys"]["stringData"]["keys"]
    assert keys.split() == ["k1", "k2"]
    router = by_kind(docs, "Deployment")[f"{FULL}-router"]["spec"]["template"]["spec"]
    assert router["volumes"][0]["secret"]["secretName"] == f"{FULL}-api-keys"
    assert router["containers"][0]["volumeMounts"][0]["mountPath"] == "/etc/pdserve/api-keys"
    args = router["containers"][0]["args"]  # and the router enforces them
    assert args[args.index("--api-key-file") + 1] == "/etc/pdserve/api-keys/keys"
    assert router["imagePullSecrets"] == [{"name": "regcred"}]
    sm = by_kind(docs, "ServiceMonitor")[f"{FULL}-router"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    svc = by_kind(docs, "Service")[f"{FULL}-router"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    endpoint = sm["spec"]["endpoints"][0]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    from pdserve.tests.deploy.router_routes import router_app

    assert endpoint["path"] in {r.path for r in router_app().routes}
    assert svc["spec"]["type"] == "LoadBalancer" and "loadBalancer.ingress" in notes
    docs, _ = render(chart, {})
    assert not by_kind(docs, "ServiceMonitor") and not by_kind(docs, "HorizontalPodAutoscaler")
    assert f"{FULL}-api-keys" not in by_kind(docs, "Secret")
    default_router = by_kind(docs, "Deployment")[f"{FULL}-router"]
    assert "--api-key-file" not in default_router["spec"]["template"]["spec"]["containers"][0]["args"]


def test_notes_tell_how_to_reach_the_router(chart):
    _, notes = render(chart, {})
    assert f"port-forward svc/{FULL}-router 8000:8000" in notes
    assert "/v1/chat/completions" in notes and "/health" in notes
    assert f"http://{FULL}-router.{NAMESPACE}.svc:8000/v1" in notes


def test_values_schema_covers_values_yaml(chart):
    """values.schema.json describes every key values.yaml has (additionalProperties: false
    all the way down would reject an undocumented key)."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(values, node, path):
        if isinstance(values, dict) and node.get("type") == "object" and "properties" in node:
            for key, sub in values.items():
                assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
                walk(sub, node["properties"][key], f"{path}.{key}")

    walk(chart.values, schema, "values")


def test_engines_drain_on_termination_and_have_disruption_budgets(chart):
    """preStop waits out the router's DNS refresh, the engine drains for --drain-timeout,
    and the grace period covers both; a PodDisruptionBudget per engine kind."""
    docs, _ = render(chart, {})
    values = chart.merge_values({})
    drain = values["drain"]
    pdbs = by_kind(docs, "PodDisruptionBudget")
    for role in ("prefill", "decode"):
        dep = by_kind(docs, "Deployment")[f"{FULL}-{role}"]
        spec = dep["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert c["lifecycle"]["preStop"]["exec"]["command"] == [
            "sleep", str(drain["preStopSleepSeconds"])]
        args = parse(expanded_args(docs, c))
        assert args.drain_timeout == drain["timeoutSeconds"]
        assert spec["terminationGracePeriodSeconds"] > (drain["timeoutSeconds"]
                                                        + drain["preStopSleepSeconds"])
        pdb = pdbs[f"{FULL}-{role}"]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
