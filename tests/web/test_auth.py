"""The read token in front of the dashboard: 401 and the login form without it, pages
with it as a bearer header or as the cookie the form sets; the cookie is HttpOnly and
SameSite=Strict, and the token never appears in a URL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from web.browser import Browser
from web.conftest import READ_TOKEN, Site, running_site

PAGES = ["/", "/hosts/gpu-a", "/hosts/gpu-a/gpus/1", "/events", "/alerts"]


@pytest.fixture
def anonymous(guarded_site: Site) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=guarded_site.url, timeout=30, follow_redirects=False) as client:
        yield client


@pytest.mark.parametrize("path", PAGES)
def test_without_the_token_a_page_is_401_with_the_login_form(
    path: str, anonymous: httpx.Client
) -> None:
    response = anonymous.get(path)
    assert response.status_code == 401
    assert 'name="token"' in response.text and 'action="/login"' in response.text
    assert "gpu-a" not in response.text.replace(f'value="{path}"', "")  # no fleet data


@pytest.mark.parametrize("path", PAGES)
def test_with_the_bearer_token_a_page_renders(path: str, anonymous: httpx.Client) -> None:
    ok = anonymous.get(path, headers={"Authorization": f"Bearer {READ_TOKEN}"})
    assert ok.status_code == 200 and "gpu-a" in ok.text
    wrong = anonymous.get(path, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403


def test_the_login_form_sets_a_strict_http_only_cookie(anonymous: httpx.Client) -> None:
    refused = anonymous.post("/login", data={"token": "nope", "next": "/events"})
    assert refused.status_code == 401 and "not accepted" in refused.text
    assert "set-cookie" not in refused.headers

    response = anonymous.post("/login", data={"token": READ_TOKEN, "next": "/events?kind=idle"})
    assert response.status_code == 303
    assert response.headers["location"] == "/events?kind=idle"
    assert READ_TOKEN not in response.headers["location"]
    cookies = response.headers.get_list("set-cookie")
    token_cookie = next(c for c in cookies if c.startswith("gpuwatch_read="))
    attributes = {part.strip().lower() for part in token_cookie.split(";")}
    assert {"httponly", "samesite=strict", "path=/"} <= attributes

    page = anonymous.get("/events?kind=idle")  # the client kept the cookie
    assert page.status_code == 200 and "dave" in page.text
    assert "secure" not in attributes  # plain HTTP, and nothing says the browser's side is TLS
    assert 'action="/logout"' in page.text

    anonymous.post("/logout")
    assert anonymous.get("/").status_code == 401


def test_behind_a_tls_proxy_the_cookie_is_secure(tmp_path: Path) -> None:
    # The proxy speaks HTTPS to the browser and plain HTTP to the server: the setting says so.
    site = running_site(tmp_path, read_token=READ_TOKEN, cookie_secure=True)
    with site as behind_tls, httpx.Client(base_url=behind_tls.url, timeout=30) as browser_side:
        response = browser_side.post("/login", data={"token": READ_TOKEN, "next": "/"})
    assert response.status_code == 303
    for cookie in response.headers.get_list("set-cookie"):
        assert "secure" in {part.strip().lower() for part in cookie.split(";")}, cookie


def test_a_stale_cookie_asks_to_sign_in_again(anonymous: httpx.Client) -> None:
    anonymous.cookies.set("gpuwatch_read", "an-old-token")
    response = anonymous.get("/")
    assert response.status_code == 401 and "sign in again" in response.text


@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/", "/\\evil.example"])
def test_the_login_form_only_sends_you_to_this_server(target: str, anonymous: httpx.Client) -> None:
    response = anonymous.post("/login", data={"token": READ_TOKEN, "next": target})
    assert response.status_code == 303 and response.headers["location"] == "/"


def test_a_signed_in_user_following_a_link_from_another_site_gets_the_page(
    anonymous: httpx.Client,
) -> None:
    # SameSite=Strict withholds the token on a cross-site navigation; the Lax marker
    # comes along, and the page reloads itself (then same-site, with the token).
    anonymous.cookies.set("gpuwatch_signed_in", "1")
    response = anonymous.get("/alerts", headers={"Sec-Fetch-Site": "cross-site"})
    assert response.status_code == 200
    assert 'http-equiv="refresh"' in response.text and "gpu-b" not in response.text
    same_site = anonymous.get("/alerts", headers={"Sec-Fetch-Site": "same-origin"})
    assert same_site.status_code == 401  # no loop: without the token it is the form


def test_the_api_still_takes_only_the_bearer_token(
    guarded_site: Site, anonymous: httpx.Client
) -> None:
    anonymous.cookies.set("gpuwatch_read", READ_TOKEN)
    assert anonymous.get("/").status_code == 200
    assert anonymous.get("/api/v1/fleet").status_code == 401
    assert guarded_site.client.get("/api/v1/fleet").status_code == 200


def test_static_assets_and_docs_need_no_token(anonymous: httpx.Client) -> None:
    for path in (
        "/static/dashboard/dashboard.css",
        "/static/apidocs/swagger-ui-bundle.js",
        "/docs",
    ):
        assert anonymous.get(path).status_code == 200, path


def test_the_docs_page_cannot_be_framed(anonymous: httpx.Client) -> None:
    # Its "Try it out" form sends calls with a token the user typed: no clickjacking.
    for path in ("/docs", "/docs/oauth2-redirect"):
        page = anonymous.get(path)
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"], path
        assert page.headers["x-frame-options"] == "DENY", path


def test_signing_in_with_a_browser(guarded_site: Site, browser: Browser, tmp_path: Path) -> None:
    browser.driver.delete_all_cookies()
    browser.open(guarded_site.url + "/hosts/gpu-a")
    form = browser.driver.find_element(By.CSS_SELECTOR, "form[action='/login']")
    # The browser logs the 401 of the document itself; nothing else may fail.
    errors = [e for e in browser.console_errors() if "401" not in e]
    assert errors == []
    browser.screenshot("dashboard-login", tmp_path)
    form.find_element(By.NAME, "token").send_keys(READ_TOKEN)
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(browser.driver, 10).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "svg.chart path.layer")
    )
    assert browser.driver.current_url == guarded_site.url + "/hosts/gpu-a"
    assert READ_TOKEN not in browser.driver.current_url
    assert browser.js("return document.cookie").find(READ_TOKEN) == -1  # HttpOnly
    assert browser.console_errors() == []

    browser.driver.find_element(By.CSS_SELECTOR, "form.signout button").click()
    WebDriverWait(browser.driver, 10).until(lambda d: d.current_url.endswith("/login"))
    browser.open(guarded_site.url + "/")
    assert browser.driver.find_elements(By.NAME, "token")
