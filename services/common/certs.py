"""A private CA and one certificate per role, for the internal plane's mutual TLS.

`make_certs(out_dir, ...)` writes the layout TlsConfig.from_dir reads:

    ca.pem                      the CA certificate (every process trusts it)
    <role>.pem, <role>-key.pem  per role: router, prefill, decode, kvstore-master,
                                kvstore-node, client (health checks, tools)
    ca-key.pem                  only with keep_ca_key=True; anyone holding it can mint peers

Keys are ECDSA P-256 (fast to make, fast handshakes); each leaf is valid for both server and
client authentication (an engine serves the router and is itself a client of the store). Every
leaf names its role (`tls.peer_name`), localhost, 127.0.0.1 and ::1, plus the DNS names and IPs
given. Key files are created 0600, the folder 0700 when it is new.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.services.common.tls import CA_FILE, ROLES, cert_file, key_file, peer_name

CA_KEY_FILE = "ca-key.pem"


@dataclass(frozen=True)
class CertSpec:
    roles: tuple[str, ...] = ROLES
    dns_names: tuple[str, ...] = ()  # extra SANs on every leaf (Service names, hostnames)
    ip_addresses: tuple[str, ...] = ()
    days: int = 365
    keep_ca_key: bool = False

    def __post_init__(self):
        bad = [r for r in self.roles if r not in ROLES]
        if bad or not self.roles:
            raise ValueError(f"roles must be among {', '.join(ROLES)}, got {self.roles}")
        if not 1 <= self.days <= 3650:
            raise ValueError(f"days must be in [1, 3650], got {self.days}")
        for ip in self.ip_addresses:
            ipaddress.ip_address(ip)  # ValueError names it
        for name in self.dns_names:
            if not name or len(name) > 253 or any(c.isspace() for c in name):
                raise ValueError(f"bad DNS name {name!r}")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if private:
        os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _ca(now: datetime.datetime, days: int):
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("pdserve internal CA")
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def _sans(role: str, spec: CertSpec) -> x509.SubjectAlternativeName:
    names = [peer_name(role), "localhost", *spec.dns_names]
    ips = ["127.0.0.1", "::1", *spec.ip_addresses]
    return x509.SubjectAlternativeName(
        [x509.DNSName(n) for n in dict.fromkeys(names)]
        + [x509.IPAddress(ipaddress.ip_address(i)) for i in dict.fromkeys(ips)])


def _leaf(role: str, spec: CertSpec, ca_key, ca_cert, now: datetime.datetime):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name(role))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=spec.days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_sans(role, spec), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def complete(out_dir: str | os.PathLike, roles: Iterable[str]) -> bool:
    """`out_dir` already holds a CA and every role's certificate and key."""
    out = Path(out_dir)
    names = [CA_FILE] + [f for r in roles for f in (cert_file(r), key_file(r))]
    return all((out / n).is_file() for n in names)


def make_certs(out_dir: str | os.PathLike, spec: CertSpec = CertSpec()) -> list[Path]:
    """Writes a new CA and a certificate per role of `spec` into `out_dir` (replacing what
    is there); returns the files written."""
    out = Path(out_dir)
    if not out.exists():
        out.mkdir(parents=True, mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, ca_cert = _ca(now, spec.days)
    written = [out / CA_FILE]
    _write(written[0], _cert_pem(ca_cert), private=False)
    if spec.keep_ca_key:
        written.append(out / CA_KEY_FILE)
        _write(written[-1], _key_pem(ca_key), private=True)
    for role in spec.roles:
        key, cert = _leaf(role, spec, ca_key, ca_cert, now)
        _write(out / cert_file(role), _cert_pem(cert), private=False)
        _write(out / key_file(role), _key_pem(key), private=True)
        written += [out / cert_file(role), out / key_file(role)]
    return written


def split_words(values: Iterable[str]) -> tuple[str, ...]:
    """Flags given several times and/or comma-separated -> one tuple, blanks dropped."""
    return tuple(w.strip() for v in values for w in v.split(",") if w.strip())
