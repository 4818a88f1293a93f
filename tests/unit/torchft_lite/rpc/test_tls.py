"""TLS settings (torchft_lite.rpc.tls): where they come from, what they turn on, and the errors a bad one gives.

Certificates are made per module with the openssl CLI (no sockets here; the
handshakes are in tests/integration/test_tls.py).
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc
import pytest

from benchmarks._throwaway_pki import openssl_missing
from lighthouse.config import LighthouseConfig
from torchft_lite.rpc.tls import CA_ENV, CERT_ENV, KEY_ENV, TlsSettings

pytestmark = pytest.mark.skipif(openssl_missing() is not None, reason=str(openssl_missing()))


def test_nothing_set_is_plain_text_everywhere():
    tls = TlsSettings.from_env({})
    assert not tls.serving and not tls.enabled and tls.scheme == "http"
    assert not tls.uses_tls("http://lighthouse:29510") and not tls.uses_tls("lighthouse:29510")
    assert "TLS off" in tls.describe()
    with pytest.raises(ValueError, match=f"{CERT_ENV} and {KEY_ENV}"):
        tls.server_context()


def test_an_https_address_uses_tls_even_with_nothing_set():
    tls = TlsSettings()
    assert tls.uses_tls("https://lighthouse:29510") and tls.uses_tls("HTTPS://lighthouse:29510/")
    context = tls.client_context()  # the system's trust store
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_the_variables_turn_on_serving_and_every_client(pki):
    tls = TlsSettings.from_env(pki.env())
    assert (tls.cert, tls.key, tls.ca) == (pki.cert, pki.key, pki.ca)
    assert tls.serving and tls.enabled and tls.scheme == "https"
    # Once a job sets TLS, an address written for torchft (http://) is dialled with TLS too: no downgrade.
    assert tls.uses_tls("http://lighthouse:29510") and tls.uses_tls("127.0.0.1:5")
    server = tls.server_context("h2")
    assert server.minimum_version == ssl.TLSVersion.TLSv1_2
    client = tls.client_context()
    assert client.minimum_version == ssl.TLSVersion.TLSv1_2
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    assert tls.client_context() is client and tls.server_context("h2") is server  # made once
    assert isinstance(tls.grpc_server_credentials(), grpc.ServerCredentials)
    assert isinstance(tls.grpc_channel_credentials(), grpc.ChannelCredentials)
    described = tls.describe()
    assert "TLS on" in described and str(pki.cert) in described and str(pki.ca) in described


def test_a_ca_alone_makes_a_tls_client_that_serves_nothing(pki):
    tls = TlsSettings.from_env({CA_ENV: str(pki.ca)})
    assert tls.enabled and not tls.serving and tls.scheme == "http"
    assert tls.uses_tls("http://lighthouse:29510")
    assert "not serving TLS" in tls.describe()


def test_the_key_never_shows(pki):
    tls = TlsSettings.from_env(pki.env())
    key = pki.key.read_text()
    assert "PRIVATE KEY" in key
    for text in (repr(tls), str(tls), tls.describe()):
        assert "PRIVATE" not in text and key.splitlines()[1] not in text


def test_flags_replace_the_variables(pki, other_pki):
    environ = {CERT_ENV: str(other_pki.cert), KEY_ENV: str(other_pki.key), CA_ENV: str(other_pki.ca)}
    tls = TlsSettings.from_env(environ, cert=pki.cert, key=pki.key)
    assert (tls.cert, tls.key, tls.ca) == (pki.cert, pki.key, other_pki.ca)
    assert TlsSettings.from_env(environ, ca=pki.ca).ca == pki.ca


@pytest.mark.parametrize("given, missing", [(CERT_ENV, KEY_ENV), (KEY_ENV, CERT_ENV)])
def test_a_certificate_without_its_key_or_the_reverse_is_an_error(pki, given, missing):
    path = pki.cert if given == CERT_ENV else pki.key
    with pytest.raises(ValueError, match=f"{given} is set but {missing} is not"):
        TlsSettings.from_env({given: str(path)})


def test_a_flag_without_its_pair_is_named_as_a_flag(pki):
    with pytest.raises(ValueError, match="--tls-cert is set but --tls-key is not"):
        TlsSettings.from_env({KEY_ENV: str(pki.key)}, cert=pki.cert)


def test_a_missing_file_is_named_with_its_variable(pki, tmp_path):
    missing = tmp_path / "nowhere.pem"
    with pytest.raises(ValueError, match=f"{CA_ENV}: cannot read {missing}"):
        TlsSettings.from_env({CA_ENV: str(missing)})
    with pytest.raises(ValueError, match=f"{CERT_ENV}: cannot read {missing}"):
        TlsSettings.from_env({CERT_ENV: str(missing), KEY_ENV: str(pki.key)})


def test_a_directory_or_a_file_that_is_not_pem_is_an_error(pki, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"{CA_ENV}: {text} is not a PEM file"):
        TlsSettings.from_env({CA_ENV: str(text)})
    with pytest.raises(ValueError, match=f"{KEY_ENV}: cannot read {tmp_path}"):
        TlsSettings.from_env({CERT_ENV: str(pki.cert), KEY_ENV: str(tmp_path)})


def test_an_empty_variable_is_an_error():
    with pytest.raises(ValueError, match=f"{CA_ENV} is set but empty"):
        TlsSettings.from_env({CA_ENV: " "})


def test_a_key_that_is_not_the_certificates_is_an_error(pki, other_pki):
    with pytest.raises(ValueError, match=f"{CERT_ENV}/{KEY_ENV}: cannot use {pki.cert} with the key {other_pki.key}"):
        TlsSettings.from_env({CERT_ENV: str(pki.cert), KEY_ENV: str(other_pki.key)})


def test_a_ca_file_without_a_certificate_is_an_error(pki):
    with pytest.raises(ValueError, match=f"{CA_ENV}: {pki.key} holds no usable CA certificate"):
        TlsSettings.from_env({CA_ENV: str(pki.key)})


def test_settings_made_directly_are_checked_the_same(pki, tmp_path):
    assert TlsSettings(cert=str(pki.cert), key=str(pki.key)).cert == Path(pki.cert)  # strings become paths
    with pytest.raises(ValueError, match="the TLS certificate is set but the TLS key is not"):
        TlsSettings(cert=pki.cert)


# ------------------------------------------------------------------ the lighthouse's flags


def test_the_lighthouse_flags_and_variables(pki, other_pki):
    parser = LighthouseConfig.arg_parser()
    flags = ["--min_replicas", "1", "--tls-cert", str(pki.cert), "--tls-key", str(pki.key)]
    config = LighthouseConfig.from_args(parser.parse_args(flags), environ={CA_ENV: str(pki.ca)})
    assert config.tls.serving and config.tls.cert == pki.cert and config.tls.ca == pki.ca
    from_env = LighthouseConfig.from_args(parser.parse_args(["--min_replicas", "1"]), environ=other_pki.env())
    assert from_env.tls.cert == other_pki.cert
    plain = LighthouseConfig.from_args(parser.parse_args(["--min_replicas", "1"]), environ={})
    assert not plain.tls.enabled
    with pytest.raises(ValueError, match="--tls-cert is set but --tls-key is not"):
        LighthouseConfig.from_args(parser.parse_args(["--min_replicas", "1", "--tls-cert", str(pki.cert)]),
                                   environ={})
    assert "--tls-cert" in parser.format_help() and CERT_ENV in parser.format_help()
