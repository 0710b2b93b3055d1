"""The operator page (issue 33) in a real browser: headless Chromium, driven with selenium,
against a real controller with auth on and three real engines (tests/web/conftest.py).

The tests run in order on one cluster and one browser (later ones change the cluster):
the cluster view shows the numbers ``GET /v1/instances`` reports; a lookup by token ids
finds the document where it lives; a tier's entries show a ``<script>`` key as text; an
evict through the page (with its confirmation) empties that tier; a tenant's token sees
and evicts its own namespace only; no token ever appears in a URL the browser requested.
Each view is saved as a PNG in the test's temp dir; with ``LMCACHE_WRITE_SCREENSHOTS=1``
the cluster view is also written to docs/images/operator-page.png (the docs embed it).
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from _missing import missing
from _procs import until
from _web import ADMIN, DOC, MODEL, ROOT, TENANT_TOKENS, Browser, Cluster

# read at import: the suite's autouse fixture clears LMCACHE_* variables while a test runs
WRITE_SCREENSHOTS = os.environ.get("LMCACHE_WRITE_SCREENSHOTS") == "1"
TEXT = "Where does this document live? The operator page asks the controller, which asks an instance to tokenize it. " * 2
DOCS_SHOT = ROOT / "docs" / "images" / "operator-page.png"
#: tier cell class -> the field of /v1/instances' tier_stats it shows (data-value)
CELLS = {"entries": "entries", "used-bytes": "used_bytes", "capacity-bytes": "capacity_bytes", "hit-rate": "hit_rate",
         "evictions": "evictions", "errors": "errors", "write-refusals": "refused_writes", "backoff": "retry_in_s"}


# ---------------------------------------------------------------- page helpers
def css(browser: Browser, selector: str, within: Any = None) -> list[Any]:
    from selenium.webdriver.common.by import By

    return (within or browser.driver).find_elements(By.CSS_SELECTOR, selector)


def one(browser: Browser, selector: str, within: Any = None) -> Any:
    found = css(browser, selector, within)
    assert len(found) == 1, f"{selector}: {len(found)} elements"
    return found[0]


def use_token(browser: Browser, url: str, token: str) -> None:
    """Open the page (if not open) and give it ``token`` through its token field."""
    d = browser.driver
    if not d.current_url.startswith(url):
        d.get(url + "/")
    field = one(browser, "input#token")
    assert field.get_attribute("type") == "password"
    field.clear()
    field.send_keys(token)
    one(browser, "button#token-save").click()
    until(lambda: d.execute_script("return sessionStorage.getItem('lmcache.token')") == token,
          "the token kept in sessionStorage")


def tier_element(browser: Browser, iid: str, tier: str) -> Any:
    return one(browser, f'.tier[data-instance="{iid}"][data-tier="{tier}"]')


def value(raw: str | None) -> Any:
    """A cell's data-value as the JSON number it shows (``None`` for empty)."""
    return None if raw in (None, "") else json.loads(raw)


def snapshot(browser: Browser, script: str, *args: Any) -> Any:
    """What ``script`` returns, read in one go: the page redraws its tables on every poll,
    so elements found one call earlier may be gone."""
    return browser.driver.execute_script(script, *args)


def shown_instances(browser: Browser) -> set[str]:
    return set(snapshot(browser, "return [...document.querySelectorAll('table#instances tr[data-instance]')]"
                                 ".map(tr => tr.dataset.instance)"))


def instance_rows(browser: Browser) -> dict[str, dict[str, str]]:
    """The cluster table: instance id -> the text of its cells, by class."""
    return snapshot(browser, """
        const out = {};
        for (const tr of document.querySelectorAll('table#instances tr[data-instance]')) {
          out[tr.dataset.instance] = Object.fromEntries([...tr.querySelectorAll('td')].map(td => [td.className, td.textContent]));
        }
        return out;""")


def page_numbers(browser: Browser) -> dict[tuple[str, str], dict[str, Any]]:
    """Each tier element's cells (:data:`CELLS`): their data-value as the JSON number
    (``None`` for empty), and ``bar``: whether it holds a used/capacity bar."""
    raw = snapshot(browser, """
        const out = {};
        for (const el of document.querySelectorAll('.tier[data-instance][data-tier]')) {
          const o = {bar: el.querySelector('.bar') !== null};
          for (const c of arguments[0]) { const x = el.querySelector('.' + c); o[c] = x ? x.getAttribute('data-value') : null; }
          out[el.dataset.instance + '|' + el.dataset.tier] = o;
        }
        return out;""", list(CELLS))
    return {tuple(k.split("|")): {c: v if c == "bar" else value(v) for c, v in cells.items()} for k, cells in raw.items()}


def click(browser: Browser, selector: str, within: tuple[str, str] | None = None) -> None:
    """Click the one element ``selector`` (inside the tier element ``within``: instance,
    tier), found again if a redraw replaced it between finding and clicking."""
    from selenium.common.exceptions import StaleElementReferenceException

    def attempt():
        try:
            scope = tier_element(browser, *within) if within else None
            target = one(browser, selector, scope)
            # the page's header stays at the top: bring the element to the middle first
            browser.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", target)
            target.click()
            return True
        except StaleElementReferenceException:
            return None

    until(attempt, f"clicked {selector}")


def api_numbers(cluster: Cluster, token: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(iid, t): {"bar": True, **{cls: row["tier_stats"][t][field] for cls, field in CELLS.items()}}
            for iid, row in cluster.instances(token).items() for t in row["tiers"]}


def png(browser: Browser, height: int | None = None) -> bytes:
    """The page from its top, ``height`` CSS pixels of it (all of it when ``None``), as
    PNG (DevTools' capture beyond the window)."""
    d = browser.driver
    d.execute_script("window.scrollTo(0, 0)")
    size = d.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": height or size["height"], "scale": 1}
    shot = d.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip})
    data = base64.b64decode(shot["data"])
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    return data


def shot(browser: Browser, tmp_path: Path, name: str) -> Path:
    """The whole page as it is now, as ``<tmp_path>/<name>.png``."""
    path = tmp_path / f"{name}.png"
    path.write_bytes(png(browser))
    print(f"screenshot: {path}")
    return path


def confirm(browser: Browser, yes: bool) -> str:
    """Answer the page's confirmation dialog; its text."""
    dialog = one(browser, "dialog#confirm")
    until(lambda: dialog.get_attribute("open") is not None, "the confirmation dialog open")
    text = one(browser, "#confirm-text").text
    one(browser, "#confirm-yes" if yes else "#confirm-no").click()
    until(lambda: dialog.get_attribute("open") is None, "the confirmation dialog closed")
    return text


def no_alert(browser: Browser) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    try:
        text = browser.driver.switch_to.alert.text
    except NoAlertPresentException:
        return
    raise AssertionError(f"an alert opened: {text!r}")


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer (the model file the suite installs), or ``missing()``."""
    from lmcache.errors import MissingDependencyError

    try:
        from transformers import AutoTokenizer

        from lmcache.plugins.connectors.hf_models import smollm2_checkpoint

        return AutoTokenizer.from_pretrained(str(smollm2_checkpoint()))
    except (MissingDependencyError, ImportError) as exc:
        missing(f"the text lookup needs SmolLM2's tokenizer: {exc} (make test installs it)")


# ---------------------------------------------------------------- tests, in order
def test_the_cluster_view_shows_what_the_api_reports(cluster: Cluster, browser: Browser, tmp_path):
    """The admin's page lists the three instances (health, version, model, tiers) and each
    tier's entries, bytes, capacity, hit rate, evictions, errors, write refusals and
    backoff with exactly the numbers of GET /v1/instances (same token)."""
    use_token(browser, cluster.url, ADMIN)
    until(lambda: shown_instances(browser) == set(cluster.engines), "the three instances shown")
    shown = instance_rows(browser)
    for iid, row in cluster.instances().items():
        cells = shown[iid]
        assert cells["health ok"] == "healthy" and row["healthy"]
        assert cells["version"] == row["version"] and cells["model"] == MODEL == row["model"]
        assert cells["tiers"] == ", ".join(row["tiers"]), (cells, row["tiers"])
    # the page polls; the same numbers as the API at one moment (both read on each try)
    until(lambda: page_numbers(browser) == api_numbers(cluster, ADMIN), "the page's tier numbers equal the API's")
    numbers = page_numbers(browser)
    assert set(numbers) == {("web-a1", "cpu"), ("web-a1", "disk"), ("web-a2", "cpu"), ("web-b1", "cpu")}
    assert numbers[("web-a1", "cpu")]["entries"] == 5 and numbers[("web-a1", "cpu")]["used-bytes"] == 5 * 4096
    assert numbers[("web-a1", "disk")]["capacity-bytes"] == 16 << 20
    assert css(browser, "svg#chart") and css(browser, "#chart-legend")
    no_alert(browser)
    shot(browser, tmp_path, "cluster")
    if WRITE_SCREENSHOTS:  # the top 800 pixels (of 1200), for the docs, once the chart has a few points
        until(lambda: snapshot(browser, "return (document.querySelector('#chart-legend').textContent"
                                        ".match(/(\\d+) samples/) || [0, 0])[1] >= 4"), "4 samples in the chart")
        DOCS_SHOT.parent.mkdir(parents=True, exist_ok=True)
        DOCS_SHOT.write_bytes(png(browser, 800))
    browser.drain()


def test_a_lookup_by_token_ids_finds_the_document(cluster: Cluster, browser: Browser, tmp_path):
    """DOC's 80 token ids typed into the lookup: web-a1 holds all 80, web-b1 its first 32
    (another tenant's copy, seen by the admin), web-a2 none: the rows of POST /v1/lookup."""
    field = one(browser, "input#lookup-tokens")
    field.clear()
    field.send_keys(", ".join(map(str, DOC)))
    one(browser, "button#lookup-go").click()

    def shown():
        rows = css(browser, "table#lookup-results tr[data-instance]")
        return {tr.get_attribute("data-instance"): int(one(browser, "td.tokens", tr).text.replace(",", ""))
                for tr in rows} or None

    got = until(shown, "lookup results shown")
    api = {r["instance_id"]: r["hit_tokens"] for r in cluster.ctl().lookup(DOC)["results"]}
    assert got == api == {"web-a1": 80, "web-b1": 32}
    first = css(browser, "table#lookup-results tr[data-instance]")[0]
    assert first.get_attribute("data-instance") == "web-a1"
    shot(browser, tmp_path, "lookup")
    browser.drain()


def test_a_key_holding_a_script_tag_is_shown_as_text(cluster: Cluster, browser: Browser, tmp_path):
    """web-a2's cpu entries, listed by the page: every key as the API lists it, the
    ``<script>alert(1)</script>`` key as plain text (no element inside its cell, no script
    element in the table, no alert)."""
    click(browser, "button.show-entries", ("web-a2", "cpu"))
    api = {e["key"]: e["size"] for e in cluster.api("web-a2").keys("cpu")["entries"]}
    assert cluster.hostile in api and len(api) == 4

    def shown():
        rows = css(browser, "table#entries tr.entry")
        return {one(browser, "td.key", tr).text: tr for tr in rows} if len(rows) == len(api) else None

    rows = until(shown, "web-a2's cpu entries listed")
    assert set(rows) == set(api)
    for key, tr in rows.items():
        assert int(one(browser, "td.size", tr).get_attribute("data-value") or one(browser, "td.size", tr).text) == api[key]
        assert css(browser, "button.evict-key", tr)
    cell = one(browser, "td.key", rows[cluster.hostile])
    assert cell.text == cluster.hostile
    assert cell.get_attribute("textContent") == cluster.hostile
    assert css(browser, "*", cell) == []  # nothing parsed as markup
    assert css(browser, "table#entries script, td.key *") == []
    assert browser.driver.execute_script("return document.querySelectorAll('script').length") == len(
        css(browser, "script[src]"))  # only the page's own script file(s)
    no_alert(browser)
    shot(browser, tmp_path, "entries")
    browser.drain()


def test_an_evict_through_the_page_empties_the_tier(cluster: Cluster, browser: Browser, tmp_path):
    """evict-tier on web-a1's cpu tier: "no" in the confirmation removes nothing; "yes"
    empties the tier (its own API lists nothing) and leaves the disk tier whole; the page
    then shows 0 entries there."""
    assert len(cluster.keys("web-a1", "cpu")) == 5
    click(browser, "button.evict-tier", ("web-a1", "cpu"))
    text = confirm(browser, yes=False)
    assert "web-a1" in text and "cpu" in text, text
    assert len(cluster.keys("web-a1", "cpu")) == 5
    click(browser, "button.evict-tier", ("web-a1", "cpu"))
    confirm(browser, yes=True)
    until(lambda: cluster.keys("web-a1", "cpu") == [], "web-a1's cpu tier emptied")
    assert len(cluster.keys("web-a1", "disk")) == 5
    assert len(cluster.keys("web-a2", "cpu")) == 4 and len(cluster.keys("web-b1", "cpu")) == 5
    until(lambda: page_numbers(browser).get(("web-a1", "cpu"), {}).get("entries") == 0, "the page shows 0 entries")
    until(lambda: one(browser, "#status").text == "evicted 5 entries", "the outcome in the status line")
    shot(browser, tmp_path, "evicted")
    browser.drain()


def test_a_lookup_by_text_is_tokenized_by_an_instance(cluster: Cluster, browser: Browser, tmp_path):
    """A text typed into the lookup: the controller has web-a1 tokenize it (the real
    SmolLM2 tokenizer, as a transformers connector gives the engine) and finds it where
    web-a1 stored its tokens: the page's rows are POST /v1/lookup {text}'s."""
    import torch

    a1 = cluster.engines["web-a1"]
    tok = smollm2_tokenizer()
    a1.tokenize = lambda text: list(tok(text)["input_ids"])
    tokens = a1.tokenize(TEXT)
    a1.store(tokens, torch.randn(2, 2, len(tokens), 2, 8))
    a1.flush()
    until(lambda: [(r["instance_id"], r["hit_tokens"]) for r in cluster.ctl().lookup(tokens)["results"]]
          == [("web-a1", len(tokens))], "the text's tokens indexed on web-a1")
    one(browser, "input#lookup-tokens").clear()  # token ids, when given, take precedence
    field = one(browser, "textarea#lookup-text")
    field.clear()
    field.send_keys(TEXT)
    click(browser, "button#lookup-go")

    def shown():
        rows = snapshot(browser, "return [...document.querySelectorAll('table#lookup-results tr[data-instance]')]"
                                 ".map(tr => [tr.dataset.instance, tr.querySelector('td.tokens').dataset.value])")
        return {iid: int(n) for iid, n in rows} if rows and rows[0][0] == "web-a1" else None

    got = until(shown, "the text's lookup results shown")
    api = cluster.ctl().request("POST", "/v1/lookup", body={"text": TEXT})
    assert got == {r["instance_id"]: r["hit_tokens"] for r in api["results"]} == {"web-a1": len(tokens)}
    assert api["num_tokens"] == len(tokens) > 2 * 16
    shot(browser, tmp_path, "lookup-text")
    browser.drain()


def test_a_tenant_token_sees_and_evicts_its_own_namespace_only(cluster: Cluster, browser: Browser, tmp_path):
    """With team-b's token the page shows web-b1 only (no tier, entry or evict button of
    team-a), its lookup sees web-b1's 32 tokens only, its entries are team-b's; a clear of
    team-a's instance sent from the page with that token is refused; its evict of its own
    tier removes nothing of team-a (checked through the admin API)."""
    before = {("web-a1", "disk"): cluster.keys("web-a1", "disk"), ("web-a2", "cpu"): cluster.keys("web-a2", "cpu")}
    use_token(browser, cluster.url, TENANT_TOKENS["team-b"])
    until(lambda: shown_instances(browser) == {"web-b1"}, "only team-b's instance shown")
    until(lambda: set(page_numbers(browser)) == {("web-b1", "cpu")}, "only team-b's tier shown")
    assert page_numbers(browser) == api_numbers(cluster, TENANT_TOKENS["team-b"]) or until(
        lambda: page_numbers(browser) == api_numbers(cluster, TENANT_TOKENS["team-b"]), "team-b's numbers")
    field = one(browser, "input#lookup-tokens")
    field.clear()
    field.send_keys(" ".join(map(str, DOC)))
    one(browser, "button#lookup-go").click()
    until(lambda: [(tr.get_attribute("data-instance"), one(browser, "td.tokens", tr).text)
                   for tr in css(browser, "table#lookup-results tr[data-instance]")] == [("web-b1", "32")],
          "the tenant's lookup shows its own instance only")
    click(browser, "button.show-entries", ("web-b1", "cpu"))
    until(lambda: len(css(browser, "table#entries tr.entry")) == 5, "web-b1's entries listed")
    assert all(one(browser, "td.key", tr).text.startswith("lmc1:team-b:") for tr in css(browser, "table#entries tr.entry"))
    shot(browser, tmp_path, "tenant")
    # the page's own request path with the tenant's token, aimed at team-a's instance
    status = browser.driver.execute_async_script("""
        const done = arguments[arguments.length - 1];
        fetch('/v1/clear', {method: 'POST', body: JSON.stringify({instance: 'web-a2', all: true}),
            headers: {'Content-Type': 'application/json',
                      'Authorization': 'Bearer ' + sessionStorage.getItem('lmcache.token')}})
          .then(r => done(r.status), e => done(String(e)));""")
    assert status == 404, status  # another namespace's instance is answered like an unknown one
    click(browser, "button.evict-tier", ("web-b1", "cpu"))
    confirm(browser, yes=True)
    until(lambda: cluster.keys("web-b1", "cpu") == [], "team-b's own tier emptied")
    assert {k: cluster.keys(*k) for k in before} == before  # nothing of team-a removed
    browser.drain()


def test_the_token_is_never_in_a_url_and_lives_in_session_storage(cluster: Cluster, browser: Browser):
    """Every request the browser made in this module (DevTools performance log): no token
    in any URL; the JSON calls carried it in the Authorization header. The token is in
    sessionStorage only (not localStorage, not a cookie); token-clear forgets it."""
    browser.drain()
    assert browser.requests
    tokens = [ADMIN, *TENANT_TOKENS.values()]
    for req in browser.requests:
        assert not any(t in req["url"] for t in tokens), req["url"]
    api_calls = [r for r in browser.requests if "/v1/" in r["url"]]
    assert api_calls
    authed = {r["headers"].get("Authorization") for r in api_calls}
    assert f"Bearer {ADMIN}" in authed and f"Bearer {TENANT_TOKENS['team-b']}" in authed, authed
    d = browser.driver
    assert d.execute_script("return sessionStorage.getItem('lmcache.token')") == TENANT_TOKENS["team-b"]
    stored = d.execute_script("return JSON.stringify(localStorage) + document.cookie")
    assert not any(t in stored for t in tokens)
    one(browser, "button#token-clear").click()
    until(lambda: d.execute_script("return sessionStorage.getItem('lmcache.token')") is None, "the token forgotten")
    assert one(browser, "input#token").get_attribute("value") == ""
