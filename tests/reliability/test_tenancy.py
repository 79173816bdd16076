"""Tenants on a live keyed server (fake engine): keys from a key file, and no prompt of one
key readable by another through the prefix cache on any route (CVE-2025-46570)."""

from __future__ import annotations

import httpx
import pytest
from rel_servers import FakeServerProcess

pytestmark = pytest.mark.reliability

KEY_A, KEY_B = "sk-abc#SECRET", "tenant-b"
KEY_FILE = f"# tenants of the reliability suite\n\n  {KEY_A}  \n#not-a-key\n{KEY_B}\n"
SECRET = "Our merger with Initech closes on 3 March at 41 dollars a share; tell nobody. " * 2
WRONG = "Xur" + SECRET[3:]


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    (folder / "keys.txt").write_text(KEY_FILE)
    server = FakeServerProcess(folder / "server.log", "--api-keys-file",
                               str(folder / "keys.txt"))
    yield server
    server.close()


def _post(server, route: str, key: str, text: str) -> httpx.Response:
    body = ({"prompt": text, "max_tokens": 2} if route == "/v1/completions" else
            {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
            if route == "/v1/chat/completions" else
            {"input": text, "max_output_tokens": 2, "store": False})
    return httpx.post(server.url + route, json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"})


def _cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return (usage.get("prompt_tokens_details") or usage["input_tokens_details"])["cached_tokens"]


def test_key_file_keys_are_whole_trimmed_lines(tenant_server):
    def status(key: str) -> int:
        return httpx.get(tenant_server.url + "/v1/models", timeout=10,
                         headers={"Authorization": f"Bearer {key}"}).status_code

    assert status(KEY_A) == 200 and status(KEY_B) == 200
    assert status("sk-abc") == 401 and status("#not-a-key") == 401


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_a_right_guess_from_another_key_hits_no_more_than_a_wrong_one(tenant_server, route):
    _cached(_post(tenant_server, route, KEY_A, SECRET))
    right = _cached(_post(tenant_server, route, KEY_B, SECRET))
    wrong = _cached(_post(tenant_server, route, KEY_B, WRONG))
    assert right <= wrong
    assert _cached(_post(tenant_server, route, KEY_A, SECRET)) >= 32
    assert "Traceback" not in tenant_server.log_text()
