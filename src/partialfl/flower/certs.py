"""Certificates and keys of a local federation (``partialfl flower local``), generated with
``cryptography`` (a dependency of Flower):

* a certificate authority (``ca.crt``, EC P-384, self-signed) and the SuperLink's server
  certificate (``server.pem`` / ``server.key``) signed by it, valid for ``127.0.0.1``,
  ``::1`` and ``localhost`` (or the host names and addresses given) — TLS between the
  SuperLink, the SuperNodes and ``flwr``;
* one EC P-384 key pair per SuperNode (``supernode-i.key`` / ``supernode-i.pub``, OpenSSH
  formats, what ``flower-supernode`` and ``flwr supernode register`` read) — SuperNode
  authentication: the
  SuperLink accepts only registered SuperNodes.

Private keys are written owner-readable only (0600), atomically. For separate machines use
the same layout (docs/flower.md: the multi-machine guide), with the server certificate
naming the SuperLink's public address.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from partialfl import io as pio

#: how long the generated certificates are valid
VALID_DAYS = 30
#: the most SuperNodes one command makes credentials or node stores for (10^5 key pairs take
#: minutes; a typo such as 10^11 would run for days)
MAX_NODES = 10 ** 5


def check_num_nodes(n, flag: str = "--nodes") -> int:
    """``n`` if it is an integer in [1, :data:`MAX_NODES`], else a one-line ConfigError naming
    ``flag`` (0 or a negative count wrote nothing and said it was done)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NODES:
        from partialfl.config import ConfigError

        raise ConfigError(f"{flag} must be an integer in [1, {MAX_NODES}], got {n!r}")
    return n


@dataclass(frozen=True)
class Credentials:
    """Where a local federation's certificates and SuperNode keys are."""

    folder: Path
    num_nodes: int

    @property
    def ca(self) -> Path:
        """The CA certificate every party trusts (``--root-certificates``)."""
        return self.folder / "ca.crt"

    @property
    def server_cert(self) -> Path:
        return self.folder / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.folder / "server.key"

    def node_key(self, i: int) -> Path:
        """SuperNode ``i``'s private key (``--auth-supernode-private-key``)."""
        return self.folder / f"supernode-{i}.key"

    def node_public_key(self, i: int) -> Path:
        """SuperNode ``i``'s public key (``flwr supernode register``)."""
        return self.folder / f"supernode-{i}.pub"


#: the names of the files :func:`generate` writes (any number of SuperNodes)
_OWN = re.compile(r"ca\.crt|server\.(pem|key)|supernode-\d+\.(key|pub)")


def _write_private(path: Path, data: bytes) -> None:
    pio.write_bytes(path, data, private=True)  # 0600 before the key has its name


def _names(hosts: Sequence[str]):
    from cryptography import x509

    out = []
    for h in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def generate(folder: str | Path, num_nodes: int,
             hosts: Sequence[str] = ("127.0.0.1", "::1", "localhost")) -> Credentials:
    """Write a CA, a server certificate for ``hosts`` and ``num_nodes`` SuperNode key pairs
    into ``folder`` (see the module docstring)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    creds = Credentials(Path(folder), check_num_nodes(num_nodes))
    if creds.folder.is_dir():  # what a killed run of this command left (its own files only)
        pio.clean_stale_writes(creds.folder, recursive=False, targets={
            n[1:-13] for n in os.listdir(creds.folder) if _OWN.fullmatch(n[1:-13])})
    now = dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=VALID_DAYS)

    def name(cn: str):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (x509.CertificateBuilder().subject_name(name("partialfl local CA"))
          .issuer_name(name("partialfl local CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start)
          .not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .sign(ca_key, hashes.SHA384()))
    key = ec.generate_private_key(ec.SECP384R1())
    cert = (x509.CertificateBuilder().subject_name(name(hosts[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA384()))
    pem = serialization.Encoding.PEM
    raw = serialization.PrivateFormat.PKCS8
    none = serialization.NoEncryption()
    pio.write_bytes(creds.ca, ca.public_bytes(pem))
    pio.write_bytes(creds.server_cert, cert.public_bytes(pem))
    _write_private(creds.server_key, key.private_bytes(pem, raw, none))
    for i in range(num_nodes):
        k = ec.generate_private_key(ec.SECP384R1())
        _write_private(creds.node_key(i), k.private_bytes(
            pem, serialization.PrivateFormat.OpenSSH, none))  # what flower-supernode reads
        pio.write_bytes(creds.node_public_key(i), k.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH))
    return creds
