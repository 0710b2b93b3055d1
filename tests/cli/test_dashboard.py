"""``lmcache dashboard`` (issue 33): prints the operator page's URL, never with a token in
it, after checking that the controller serves the page; a real controller on loopback."""

from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

from lmcache.cli.main import app
from lmcache.server.controller import ControllerServer

runner = CliRunner()
TOKEN = "dash-secret"


@pytest.fixture(scope="module")
def controller():
    with ControllerServer(port=0, token=TOKEN) as ctl:
        yield ctl


def test_prints_the_page_url_and_never_a_token(controller, monkeypatch):
    monkeypatch.delenv("LMCACHE_CONTROLLER_TOKEN", raising=False)
    r = runner.invoke(app, ["dashboard", "--controller", controller.url + "/v1/health?token=" + TOKEN + "#x"])
    assert r.exit_code == 0, r.output
    assert r.stdout == controller.url + "/\n"
    assert "wants a token" in r.stderr and TOKEN not in r.stdout + r.stderr
    # with the token (from the environment, as the controller commands take it): the counts, still no token printed
    monkeypatch.setenv("LMCACHE_CONTROLLER_TOKEN", TOKEN)
    r = runner.invoke(app, ["dashboard", "--controller", controller.url, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"url": controller.url + "/", "checked": True, "version": json.loads(r.stdout)["version"],
                                    "instances": 0, "healthy_instances": 0}
    assert "0 of 0 instances healthy" in r.stderr and TOKEN not in r.stdout + r.stderr


def test_the_url_comes_from_the_config(controller, tmp_path, monkeypatch):
    monkeypatch.delenv("LMCACHE_CONTROLLER_URL", raising=False)
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(f"controller: {{url: '{controller.url}', token: {TOKEN}}}\n")
    r = runner.invoke(app, ["dashboard", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert r.stdout == controller.url + "/\n"


def test_a_controller_that_does_not_answer_or_a_url_with_credentials_is_one_line_error(controller):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = runner.invoke(app, ["dashboard", "--controller", f"http://127.0.0.1:{port}", "--timeout", "2"])
    assert r.exit_code == 1 and "does not answer" in r.stderr and "lmcache controller serve" in r.stderr, r.output
    assert r.stdout == ""
    host = controller.url.split("//", 1)[1]
    r = runner.invoke(app, ["dashboard", "--controller", f"http://admin:{TOKEN}@{host}"])
    assert r.exit_code == 1 and "credentials" in r.stderr and TOKEN not in r.stdout + r.stderr, r.output
    # --no-check prints without asking
    r = runner.invoke(app, ["dashboard", "--controller", f"http://127.0.0.1:{port}/x", "--no-check"])
    assert r.exit_code == 0 and r.stdout == f"http://127.0.0.1:{port}/\n", r.output


def test_a_config_naming_several_controller_replicas_gives_the_page_of_one_that_answers(controller, tmp_path,
                                                                                        monkeypatch):
    """controller.url as a list of replicas (docs/distributed.md): the first that serves
    the page is printed; before, the list was refused as 'bad port'."""
    monkeypatch.delenv("LMCACHE_CONTROLLER_URL", raising=False)
    with socket.socket() as s:  # a replica that is down
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(f"controller: {{url: ['{down}', '{controller.url}'], token: {TOKEN}}}\n")
    r = runner.invoke(app, ["dashboard", "--config", str(cfg), "--timeout", "2"])
    assert r.exit_code == 0, r.output
    assert r.stdout == controller.url + "/\n"
    r = runner.invoke(app, ["dashboard", "--config", str(cfg), "--no-check"])
    assert r.exit_code == 0 and r.stdout == down + "/\n", r.output
    r = runner.invoke(app, ["dashboard", "--controller", f"{down},{down.replace('127.0.0.1', 'localhost')}",
                            "--timeout", "2"])
    assert r.exit_code == 1 and "does not answer" in r.stderr and "nor 1 other URLs" in r.stderr, r.output
