"""A throwaway certificate authority and a server certificate, made with the ``openssl`` CLI.

For the TLS tests and ``--tls`` benchmark runs: a CA that signs one server
certificate valid for ``127.0.0.1``, ``::1`` and ``localhost``
(SubjectAltName IP and DNS entries), both P-256 keys, valid for two days.
Nothing here is fit for a real job: the CA's key sits next to its
certificate in a temporary directory. The ``cryptography`` package would do
the same in Python; it is not a dependency, and ``openssl`` is on every host
these tests run on (:func:`openssl_missing` names the reason when it is not).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Pki", "make_pki", "openssl_missing"]

OPENSSL = "/usr/bin/openssl"
HOSTS = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class Pki:
    """PEM files: the CA's certificate, and a server certificate it signed with its key."""

    ca: Path
    cert: Path
    key: Path

    def env(self) -> dict[str, str]:
        """The variables that turn TLS on for a process (torchft_lite.rpc.tls)."""
        return {"TORCHFT_LITE_TLS_CERT": str(self.cert), "TORCHFT_LITE_TLS_KEY": str(self.key),
                "TORCHFT_LITE_TLS_CA": str(self.ca)}


def openssl_missing() -> str | None:
    """Why no certificates can be made here (None when they can)."""
    if shutil.which(OPENSSL) is None and shutil.which("openssl") is None:
        return f"the openssl CLI is not installed ({OPENSSL} missing): it makes the tests' throwaway certificates"
    return None


def make_pki(directory: Path, name: str = "test", hosts: tuple[str, ...] = HOSTS) -> Pki:
    """A new CA and a server certificate for ``hosts`` in ``directory`` (created); raises ``RuntimeError``
    with openssl's own words when it fails."""
    openssl = OPENSSL if Path(OPENSSL).exists() else (shutil.which("openssl") or OPENSSL)
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / f"{name}-ca.pem", directory / f"{name}-ca.key"
    cert, key, csr = directory / f"{name}-server.pem", directory / f"{name}-server.key", directory / f"{name}.csr"
    extensions = directory / f"{name}-server.ext"
    alt_names = ",".join(f"IP:{h}" if h[0].isdigit() or ":" in h else f"DNS:{h}" for h in hosts)
    extensions.write_text(f"subjectAltName={alt_names}\nbasicConstraints=critical,CA:FALSE\n"
                          "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                          "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    _run([openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj",
          f"/CN=torchft_lite throwaway CA {name}", "-addext", "basicConstraints=critical,CA:TRUE",
          "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
    _run([openssl, "req", *ec, "-keyout", key, "-out", csr, "-subj", f"/CN={hosts[-1]}"])
    _run([openssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
          "-days", "2", "-extfile", extensions])
    return Pki(ca=ca, cert=cert, key=key)


def _run(command: list) -> None:
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command[:3]))} failed ({done.returncode}): {done.stderr.strip()}")
