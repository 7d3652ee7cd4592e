"""The chart's security: checkov's Kubernetes checks pass on the rendered manifests of every
example's values (the skips are the operator's choices, each with its reason); mutual TLS is on
by default and each pod mounts only its own role's key; the chart's generated certificates do
a real mutual-TLS handshake through services/common/tls.py; NetworkPolicies let each component
be reached only by its callers; read-only root filesystems, CPU limits, a high UID for Redis,
and no secret in any argv or environment."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from cryptography import x509

from pdserve.services.common.tls import TlsConfig, open_channel, peer_name, server_credentials
from pdserve.tests.deploy.test_helm_chart import (FULL, NAMESPACE, SCENARIOS, by_kind, chart,  # noqa: F401
                                                  expanded_args, parse, pdserve_containers,
                                                  render, workloads)

MOUNT = "/etc/pdserve/tls"
ROLES = ("router", "prefill", "decode", "kvstore-master", "kvstore-node")
CHECKOV_SCENARIOS = ("default", "gpu", "scale", "external-redis")  # deploy/helm/examples
OPERATOR_CHOICES = {"CKV_K8S_43", "CKV_K8S_15"}  # image digests, imagePullPolicy: Always
CERT_MANAGER = {"tls": {"source": "certManager"}}


def component(doc) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def pod_specs(docs) -> dict[str, dict]:
    return {component(w): w["spec"]["template"]["spec"] for w in workloads(docs).values()}


def service_of(args) -> str:
    return args.service


# ---------------------------------------------------------------- checkov


def test_checkov_kubernetes_checks_pass_for_every_example(chart, tmp_path):
    for name in (*CHECKOV_SCENARIOS, "cert-manager"):
        values = CERT_MANAGER if name == "cert-manager" else SCENARIOS[name]
        out = chart.render(values, name="demo", namespace=NAMESPACE, is_install=True)
        (tmp_path / f"{name}.yaml").write_text(
            "\n---\n".join(t for p, t in out.items() if p.endswith(".yaml")))
    proc = subprocess.run(
        [sys.executable, "-m", "checkov.main", "-d", str(tmp_path), "--framework", "kubernetes",
         "--compact", "--skip-download", "-o", "json"],
        capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout)
    summary = report["summary"]
    failed = [(f["check_id"], f["resource"], f["file_path"])
              for f in report["results"]["failed_checks"]]
    assert failed == [] and proc.returncode == 0, failed
    assert summary["parsing_errors"] == 0 and summary["resource_count"] >= 90
    assert summary["passed"] > 1500
    skipped = report["results"]["skipped_checks"]
    assert {s["check_id"] for s in skipped} == OPERATOR_CHOICES
    assert all("operator's choice" in s["check_result"]["suppress_comment"] for s in skipped)
    passed = {p["check_id"] for p in report["results"]["passed_checks"]}
    # the ones the chart used to fail: network policies, read-only root, CPU limits, secrets
    # as files, high UIDs, the namespace
    assert {"CKV2_K8S_6", "CKV_K8S_22", "CKV_K8S_11", "CKV_K8S_35", "CKV_K8S_40",
            "CKV_K8S_21"} <= passed


# ---------------------------------------------------------------- mutual TLS


def tls_volume(spec) -> dict:
    return next(v for v in spec["volumes"] if v["name"] == "tls")["secret"]


@pytest.mark.parametrize("scenario", ["default", "colocated", "everything"])
def test_tls_is_on_by_default_and_each_pod_mounts_only_its_role(chart, scenario):
    docs, _ = render(chart, SCENARIOS[scenario])
    specs = {}
    for wl, c in pdserve_containers(docs):
        args = parse(expanded_args(docs, c))
        specs[args.service] = (args, wl["spec"]["template"]["spec"], c)
    for service, (args, spec, c) in specs.items():
        role = {"decode": "decode", "prefill": "prefill", "router": "router"}.get(service)
        mount = next(m for m in c["volumeMounts"] if m["name"] == "tls")
        assert mount == {"name": "tls", "mountPath": MOUNT, "readOnly": True}
        source = tls_volume(spec)
        if role is None:  # the KV store's pods: mounted, wired when the store takes --tls-dir
            role = service
            assert source["items"][1]["path"] == f"{role}.pem"
            continue
        assert args.tls_dir == MOUNT
        from pdserve.services.common.tls_args import tls_from_args

        cfg = tls_from_args(args, role)
        assert cfg == TlsConfig.from_dir(MOUNT, role)
        assert sorted(i["path"] for i in source["items"]) == sorted(
            p.rsplit("/", 1)[1] for p in (cfg.ca, cfg.cert, cfg.key))
        assert source["secretName"] == f"{FULL}-tls"
        assert source["defaultMode"] == 0o440
    secret = by_kind(docs, "Secret")[f"{FULL}-tls"]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_chart_certificates_chain_and_handshake(chart, tmp_path):
    """The certificates Helm generates (ECDSA, Go's x509) work with services/common/tls.py:
    the decode engine's server accepts the router's certificate and checks its role name;
    a plaintext client is refused."""
    docs, _ = render(chart, {})
    files = by_kind(docs, "Secret")[f"{FULL}-tls"]["stringData"]
    ca = x509.load_pem_x509_certificate(files["ca.pem"].encode())
    for role in ROLES:
        cert = x509.load_pem_x509_certificate(files[f"{role}.pem"].encode())
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        assert peer_name(role) in names and f"{FULL}-{role}.{NAMESPACE}.svc" in names
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    echo = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.Echo", {"Echo": echo})])
    port = server.add_secure_port("127.0.0.1:0",
                                  server_credentials(TlsConfig.from_dir(str(tmp_path), "decode")))
    server.start()
    try:
        addr = f"127.0.0.1:{port}"
        with open_channel(addr, TlsConfig.from_dir(str(tmp_path), "router"), "decode",
                          aio=False) as ch:
            assert ch.unary_unary("/t.Echo/Echo")(b"hi", timeout=10) == b"hi"
        with open_channel(addr, TlsConfig.from_dir(str(tmp_path), "router"), "prefill",
                          aio=False) as ch, pytest.raises(grpc.RpcError):  # not a prefill cert
            ch.unary_unary("/t.Echo/Echo")(b"hi", timeout=10)
        with grpc.insecure_channel(addr) as ch, pytest.raises(grpc.RpcError) as info:
            ch.unary_unary("/t.Echo/Echo")(b"hi", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_cert_manager_and_user_secret_sources(chart):
    docs, _ = render(chart, CERT_MANAGER)
    assert f"{FULL}-tls" not in by_kind(docs, "Secret")
    certs = by_kind(docs, "Certificate")
    issuers = by_kind(docs, "Issuer")
    assert set(issuers) == {f"{FULL}-selfsigned", f"{FULL}-ca"}
    assert certs[f"{FULL}-ca"]["spec"]["isCA"] is True
    for comp, spec in pod_specs(docs).items():
        if comp == "redis":
            continue
        source = tls_volume(spec)
        cert = certs[source["secretName"]]["spec"]  # the pod mounts its role's Certificate
        assert cert["secretName"] == source["secretName"] == f"{FULL}-tls-{comp}"
        assert peer_name(comp) in cert["dnsNames"]
        assert {"server auth", "client auth"} <= set(cert["usages"])
        assert cert["issuerRef"] == {"name": f"{FULL}-ca", "kind": "Issuer"}
        assert {i["path"] for i in source["items"]} == {"ca.pem", f"{comp}.pem",
                                                        f"{comp}-key.pem"}
    ref = {"name": "corp-ca", "kind": "ClusterIssuer"}
    docs, _ = render(chart, {"tls": {"source": "certManager",
                                     "certManager": {"issuerRef": ref}}})
    assert not by_kind(docs, "Issuer")
    assert all(c["spec"]["issuerRef"] == ref for c in by_kind(docs, "Certificate").values())
    docs, _ = render(chart, {"tls": {"source": "secret", "existingSecret": "my-certs"}})
    assert {tls_volume(s)["secretName"] for c, s in pod_specs(docs).items()
            if c != "redis"} == {"my-certs"}
    with pytest.raises(Exception, match="existingSecret"):
        render(chart, {"tls": {"source": "secret"}})
    docs, _ = render(chart, {"tls": {"enabled": False}})
    for _, c in pdserve_containers(docs):
        assert "--tls-dir" not in c["args"]
        assert all(m["name"] != "tls" for m in c["volumeMounts"])


# ---------------------------------------------------------------- network policies

CALLERS = {  # who may open connections to each component
    "decode": {"router"}, "prefill": {"router"},
    "kvstore-master": {"prefill", "decode", "router", "kvstore-node"},
    "kvstore-node": {"prefill", "decode"},
    "redis": {"kvstore-master", "router", "prefill", "decode"},
}


METRICS_PORT = 9400  # values.ports.engineMetrics


@pytest.mark.parametrize("scenario", ["default", "external-redis", "scale"])
def test_network_policies_admit_only_the_callers(chart, scenario):
    docs, _ = render(chart, SCENARIOS[scenario])
    pods = {n: w["spec"]["template"] for n, w in workloads(docs).items()}
    policies = by_kind(docs, "NetworkPolicy")
    covered = set()
    for name, pol in policies.items():
        spec = pol["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        sel = spec["podSelector"]["matchLabels"]
        matches = [t for t in pods.values() if sel.items() <= t["metadata"]["labels"].items()]
        assert len(matches) == 1, name
        target = matches[0]["metadata"]["labels"]["app.kubernetes.io/component"]
        covered.add(target)
        declared = {p["containerPort"] for c in matches[0]["spec"]["containers"]
                    for p in c.get("ports", [])}
        rule, *metrics = spec["ingress"]
        if target in ("prefill", "decode"):  # + the metrics port, for Prometheus
            (scrape,) = metrics
            assert [p["port"] for p in scrape["ports"]] == [METRICS_PORT] and "from" not in scrape
            declared -= {METRICS_PORT}
        else:
            assert not metrics, target
        assert {p["port"] for p in rule["ports"]} == declared
        if target == "router":
            assert "from" not in rule  # clients: wherever its Service is exposed
            continue
        callers = {f["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                   for f in rule["from"]}
        assert callers == CALLERS[target], target
        for f in rule["from"]:  # each names pods of this release that exist
            assert any(f["podSelector"]["matchLabels"].items() <=
                       t["metadata"]["labels"].items() for t in pods.values())
    assert covered == {component(w) for w in workloads(docs).values()}
    peer = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    docs, _ = render(chart, {"networkPolicy": {"router": {"allowFrom": peer}}})
    assert by_kind(docs, "NetworkPolicy")[f"{FULL}-router"]["spec"]["ingress"][0]["from"] == peer
    docs, _ = render(chart, {"networkPolicy": {"metrics": {"allowFrom": peer}}})
    assert by_kind(docs, "NetworkPolicy")[f"{FULL}-decode"]["spec"]["ingress"][1]["from"] == peer
    docs, _ = render(chart, {"networkPolicy": {"enabled": False}})
    assert not by_kind(docs, "NetworkPolicy")


# ---------------------------------------------------------------- pods and secrets


@pytest.mark.parametrize("scenario", ["default", "gpu", "everything"])
def test_read_only_root_cpu_limits_and_high_uids(chart, scenario):
    docs, _ = render(chart, SCENARIOS[scenario])
    for comp, spec in pod_specs(docs).items():
        uid = spec["securityContext"]["runAsUser"]
        assert uid >= 10000 and spec["securityContext"]["runAsNonRoot"] is True, comp
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, comp
            assert c["resources"]["limits"]["cpu"], comp
            tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
            assert "emptyDir" in volumes[tmp["name"]], comp  # scratch space stays writable


def test_no_secret_in_argv_or_environment(chart):
    docs, _ = render(chart, SCENARIOS["everything"])
    secrets = by_kind(docs, "Secret")
    password = secrets[FULL]["stringData"]["redis-password"]
    words = []
    for comp, spec in pod_specs(docs).items():
        for c in spec["containers"]:
            words += c.get("command", []) + c.get("args", [])
            for var in c.get("env", []):
                assert "secretKeyRef" not in var.get("valueFrom", {}), (comp, var)
                words.append(var.get("value", ""))
    text = json.dumps(words)
    assert password not in text and "redis://" not in text
    redis = pod_specs(docs)["redis"]
    c = redis["containers"][0]
    assert "requirepass $(cat /etc/pdserve/redis-auth/password)" in c["args"][0]
    assert c["args"][0].lstrip().startswith("exec redis-server - ")  # config on stdin
    for probe in ("readinessProbe", "livenessProbe"):
        assert "REDISCLI_AUTH=" in c[probe]["exec"]["command"][-1]  # authenticated pings
    auth = next(v for v in redis["volumes"] if v["name"] == "auth")["secret"]
    assert auth["secretName"] == FULL and auth["items"] == [
        {"key": "redis-password", "path": "password"}]
    master = pod_specs(docs)["kvstore-master"]["containers"][0]
    assert master["args"][master["args"].index("--redis-url") + 1] == "@/etc/pdserve/redis/url"
    # and the master's parser reads the URL from that file
    args = parse(expanded_args(docs, master))
    assert args.redis_url == secrets[FULL]["stringData"]["redis-url"]
    assert args.redis_url == f"redis://:{password}@{FULL}-redis:6379/0"


def test_kv_store_secrets_and_tls_are_on_by_default(chart):
    """The store's two secrets are on by default, each pod mounting only the one it needs; the
    master and nodes serve on mutual TLS; a given Secret replaces the generated one."""
    docs, _ = render(chart, SCENARIOS["default"])
    kv = by_kind(docs, "Secret")[f"{FULL}-kv"]["stringData"]
    assert len(kv["store-secret"]) >= 32 and len(kv["block-secret"]) >= 32
    assert kv["store-secret"] != kv["block-secret"]
    wants = {"kvstore-master": ("store-secret", "--store-secret-file"),
             "kvstore-node": ("store-secret", "--store-secret-file"),
             "prefill": ("block-secret", "--kv-block-secret-file"),
             "decode": ("block-secret", "--kv-block-secret-file"),
             "router": ("block-secret", "--kv-block-secret-file")}
    specs = pod_specs(docs)
    for comp, (key, flag) in wants.items():
        spec, c = specs[comp], specs[comp]["containers"][0]
        volume = next(v for v in spec["volumes"] if v["name"] == "kv-secret")["secret"]
        assert volume["secretName"] == f"{FULL}-kv" and volume["items"] == [
            {"key": key, "path": key}], comp
        assert c["args"][c["args"].index(flag) + 1] == f"/etc/pdserve/kv/{key}", comp
        assert "--tls-dir" in c["args"], comp
    given, _ = render(chart, {**SCENARIOS["default"], "kvSecrets": {"existingSecret": "mine"}})
    assert f"{FULL}-kv" not in by_kind(given, "Secret")
    master = pod_specs(given)["kvstore-master"]
    assert next(v for v in master["volumes"]
                if v["name"] == "kv-secret")["secret"]["secretName"] == "mine"
