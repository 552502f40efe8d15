"""Certificates, keys and credentials of one local cluster, made with the ``cryptography`` package.

Called by :mod:`rolloutfleet.sandbox.cluster` when a cluster directory is first started; owns the
``pki/`` folder of that directory (CA, apiserver serving pair, service-account key pair) and the token
file. Everything is generated once per cluster directory and reused on restart, so a restarted sandbox
keeps working with kubeconfigs that users already exported.

Why tokens rather than client certificates: a static token file is the smallest authentication setup
that still exercises the real authenticator and RBAC (the admin is in ``system:masters``; the
``unauthenticated`` test proves anonymous requests are refused).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib
import secrets

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough for a sandbox that lives for months, short enough to stay within Go's x509 limits.
_VALIDITY = datetime.timedelta(days=3650)


@dataclasses.dataclass(frozen=True)
class Pki:
    """Paths of the files the control plane's flags point at."""

    directory: pathlib.Path

    @property
    def ca_cert(self) -> pathlib.Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> pathlib.Path:
        return self.directory / "ca.key"

    @property
    def server_cert(self) -> pathlib.Path:
        return self.directory / "apiserver.crt"

    @property
    def server_key(self) -> pathlib.Path:
        return self.directory / "apiserver.key"

    @property
    def sa_key(self) -> pathlib.Path:
        return self.directory / "sa.key"

    @property
    def sa_pub(self) -> pathlib.Path:
        return self.directory / "sa.pub"

    @property
    def tokens(self) -> pathlib.Path:
        return self.directory / "tokens.csv"

    @property
    def admin_token_file(self) -> pathlib.Path:
        return self.directory / "admin.token"

    def admin_token(self) -> str:
        return self.admin_token_file.read_text().strip()

    def complete(self) -> bool:
        files = (self.ca_cert, self.ca_key, self.server_cert, self.server_key, self.sa_key, self.sa_pub)
        return all(f.exists() for f in (*files, self.tokens, self.admin_token_file))


def _write_private(path: pathlib.Path, data: bytes) -> None:
    path.touch(mode=0o600)
    path.write_bytes(data)


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ca(now: datetime.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("rolloutfleet-sandbox-ca")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _serving(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    now: datetime.datetime,
    service_ip: str,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    # The service IP and in-cluster names are in the SANs because the apiserver validates its own
    # certificate against them at start; nothing ever dials them (clients use 127.0.0.1 only).
    names: list[x509.GeneralName] = [
        x509.DNSName(name) for name in ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc")
    ]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", service_ip)]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kube-apiserver"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def ensure_pki(directory: pathlib.Path, service_ip: str) -> Pki:
    """Create the CA, serving pair, service-account keys and admin token unless they exist."""
    pki = Pki(directory)
    if pki.complete():
        return pki
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key, ca_cert = _ca(now)
    server_key, server_cert = _serving(ca_key, ca_cert, now, service_ip)
    pem = serialization.Encoding.PEM
    _write_private(pki.ca_key, _pem_key(ca_key))
    pki.ca_cert.write_bytes(ca_cert.public_bytes(pem))
    _write_private(pki.server_key, _pem_key(server_key))
    pki.server_cert.write_bytes(server_cert.public_bytes(pem))
    # RSA for service-account tokens: RS256 is what every client library verifies without extra setup.
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_private(pki.sa_key, _pem_key(sa_key))
    pki.sa_pub.write_bytes(sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo))
    token = secrets.token_hex(24)
    _write_private(pki.admin_token_file, token.encode() + b"\n")
    # Static token file format: token,user,uid,"group1,group2".
    _write_private(pki.tokens, f'{token},rolloutfleet-admin,rolloutfleet-admin,"system:masters"\n'.encode())
    return pki
