"""HTTPS (`server.ssl_certfile`/`ssl_keyfile`, `--ssl-certfile`/`--ssl-keyfile`): `python -m
server` in a process with a self-signed certificate answers the official `openai` SDK, which
trusts that certificate, with the greedy text mlx_lm writes; plain HTTP to it is refused and it
goes on serving. A certificate that does not load, or half a pair, stops the start with one
clear line (no traceback), as any invalid setting does."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from support.models import mlx_lm_greedy
from support.servers import TEST_SERVER_ENV, free_port

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
x509 = pytest.importorskip("cryptography.x509")  # dev extras; `make test` installs them


def self_signed(folder, name="cert"):
    """A certificate for 127.0.0.1 and localhost, and its key: (cert path, key path)."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def server_command(tiny_pair, port, *extra) -> list[str]:
    return [sys.executable, "-m", "server", "--model", str(tiny_pair[0]), "--draft-model",
            str(tiny_pair[1]), "--port", str(port), *map(str, extra)]


def test_https_serves_the_sdk_and_refuses_plain_http(tiny_pair, tmp_path):
    import os

    cert, key = self_signed(tmp_path)
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(server_command(tiny_pair, port, "--ssl-certfile", cert,
                                               "--ssl-keyfile", key),
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **TEST_SERVER_ENV})
    url = f"https://127.0.0.1:{port}"
    try:
        trust = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=trust, timeout=60) as http:
            for _ in range(600):
                try:
                    if http.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    assert proc.poll() is None, log.read_text()
                    time.sleep(0.1)
            assert f"serving on https://127.0.0.1:{port}" in log.read_text()
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            with pytest.raises(httpx.ConnectError):  # a client that does not trust it
                httpx.get(f"{url}/health", timeout=10)
            sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", http_client=http,
                                max_retries=0)
            answer = sdk.chat.completions.create(
                model="", messages=[{"role": "user", "content": "Write a function"}],
                max_tokens=12, temperature=0)
            assert answer.choices[0].message.content == mlx_lm_greedy(
                tiny_pair[0], "Write a function", 12)["chat"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("case", ["other key", "missing", "half"])
def test_a_bad_certificate_stops_the_start_with_one_line(tiny_pair, tmp_path, case):
    cert, _ = self_signed(tmp_path, "one")
    _, other_key = self_signed(tmp_path, "two")
    flags = {"other key": ["--ssl-certfile", cert, "--ssl-keyfile", other_key],
             "missing": ["--ssl-certfile", tmp_path / "none.pem", "--ssl-keyfile", other_key],
             "half": ["--ssl-certfile", cert]}[case]
    done = subprocess.run(server_command(tiny_pair, free_port(), *flags), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    expected = ("go together: give both or neither" if case == "half"
                else "do not load as a PEM certificate and its key")
    assert done.stderr.startswith("error: ") and expected in done.stderr


def test_invalid_settings_are_one_line_each(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("server:\n  port: abc\nengine:\n  max_batch_size: 0\n")
    done = subprocess.run([sys.executable, "-m", "server", "--config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "server.port: Input should be a valid integer" in done.stderr
    assert "engine.max_batch_size: Input should be greater than or equal to 1" in done.stderr
    done = subprocess.run([sys.executable, "-m", "server", "--config", str(tmp_path / "no")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "error: cannot read the config file" in done.stderr
