"""TlsConfig's contract and `pdserve certs`: a CA and per-role leaves that chain to it, with the
names and usages mutual TLS needs, keys private on disk."""

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from pdserve.services.common.certs import CertSpec, make_certs
from pdserve.services.common.tls import (ROLES, TlsConfig, channel_credentials, peer_name,
                                         server_credentials)


def load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_tls_config_is_all_or_nothing(tmp_path):
    assert not TlsConfig().enabled
    for partial in ({"ca": "a"}, {"ca": "a", "cert": "b"}, {"key": "c"}):
        with pytest.raises(ValueError, match="all of ca, cert and key"):
            TlsConfig(**partial)
    cfg = TlsConfig.from_dir(str(tmp_path), "kvstore-node")
    assert cfg.enabled and cfg.ca == str(tmp_path / "ca.pem")
    assert (cfg.cert, cfg.key) == (str(tmp_path / "kvstore-node.pem"),
                                   str(tmp_path / "kvstore-node-key.pem"))
    with pytest.raises(ValueError, match="role"):
        TlsConfig.from_dir(str(tmp_path), "attacker")
    with pytest.raises(ValueError):
        server_credentials(TlsConfig())
    with pytest.raises(OSError, match="ca.pem"):  # files are read when credentials are made
        channel_credentials(cfg)


def test_make_certs_chain_names_usages_and_modes(tmp_path):
    out = tmp_path / "certs"
    written = make_certs(out, CertSpec(dns_names=("router.llm.svc", "x.example"),
                                       ip_addresses=("10.0.0.7",), days=30))
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert not (out / "ca-key.pem").exists()  # the CA key stays out of the mount by default
    ca = load(out / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for role in ROLES:
        cert = load(out / f"{role}.pem")
        cert.verify_directly_issued_by(ca)  # raises if not signed by this CA
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(san.get_values_for_type(x509.DNSName)) == {
            peer_name(role), "localhost", "router.llm.svc", "x.example"}
        assert set(san.get_values_for_type(x509.IPAddress)) == {
            ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", "10.0.0.7")}
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(eku)
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert 29 < lifetime.days <= 30
        assert stat.S_IMODE((out / f"{role}-key.pem").stat().st_mode) == 0o600
    assert len(written) == 1 + 2 * len(ROLES)
    creds = TlsConfig.from_dir(str(out), "decode")
    assert server_credentials(creds) is not None and channel_credentials(creds) is not None
    # a second run makes a new CA: the old leaves do not chain to it
    make_certs(tmp_path / "other", CertSpec(roles=("router",), keep_ca_key=True))
    assert (tmp_path / "other" / "ca-key.pem").exists()
    with pytest.raises(Exception):
        load(out / "router.pem").verify_directly_issued_by(load(tmp_path / "other" / "ca.pem"))


@pytest.mark.parametrize("bad", [{"roles": ("router", "root")}, {"roles": ()}, {"days": 0},
                                 {"ip_addresses": ("10.0.0.300",)}, {"dns_names": ("a b",)}])
def test_cert_spec_refuses_bad_settings(bad):
    with pytest.raises(ValueError):
        CertSpec(**bad)


def test_certs_command_and_tls_flags(tmp_path, capsys):
    from pdserve.cli import build_parser, main

    assert main(["certs", "--out", str(tmp_path), "--roles", "router,decode",
                 "--dns", "a.svc,b.svc", "--dns", "c.svc", "--ip", "10.1.1.1"]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(p.rsplit("/", 1)[1] for p in printed) == [
        "ca.pem", "decode-key.pem", "decode.pem", "router-key.pem", "router.pem"]
    san = load(tmp_path / "decode.pem").extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert {"a.svc", "b.svc", "c.svc"} <= set(san.get_values_for_type(x509.DNSName))

    from pdserve.services.common.tls_args import tls_from_args

    args = build_parser().parse_args(["serve", "router", "--tls-dir", str(tmp_path),
                                      "--tls-key", "/elsewhere/k.pem"])
    cfg = tls_from_args(args, "router")  # the folder, one file overridden
    assert cfg == TlsConfig(str(tmp_path / "ca.pem"), str(tmp_path / "router.pem"),
                            "/elsewhere/k.pem")
    for service in ("decode", "prefill"):
        plain = build_parser().parse_args(["serve", service])
        assert not tls_from_args(plain, "decode").enabled  # no flag: plaintext
    with pytest.raises(ValueError):  # a lone file is a mistake, not plaintext
        tls_from_args(build_parser().parse_args(["serve", "decode", "--tls-ca", "x"]), "decode")
