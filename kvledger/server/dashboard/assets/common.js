// Shared by the dashboard pages: the API key (entered once, kept in sessionStorage), fetching
// the /dashboard/api routes, and number formats. Plain script, no build step.
"use strict";
const KV = (() => {
  const STORE = "kvledger-api-key";
  const body = document.body;
  const authRequired = body.dataset.auth === "required";
  let onReady = null;

  class AuthError extends Error {}

  function key() { return sessionStorage.getItem(STORE); }

  async function api(path, options = {}) {
    const headers = Object.assign({}, options.headers || {});
    if (key()) headers["Authorization"] = "Bearer " + key();
    const response = await fetch(path, Object.assign({}, options, { headers }));
    if (response.status === 401) throw new AuthError("the API key was refused");
    const data = await response.json();
    if (!response.ok) throw new Error((data.error && data.error.message) || response.statusText);
    return data;
  }

  function showLogin(message) {
    document.getElementById("content").hidden = true;
    document.getElementById("login").hidden = false;
    document.getElementById("logout").hidden = true;
    document.getElementById("login-error").textContent = message || "";
    document.getElementById("login-key").focus();
  }

  function showContent() {
    document.getElementById("login").hidden = true;
    document.getElementById("content").hidden = false;
    document.getElementById("logout").hidden = !authRequired;
  }

  // Call ready() once the page may fetch data (at once without --api-key, else after login).
  function start(ready) {
    onReady = ready;
    document.getElementById("login-form").addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(STORE, document.getElementById("login-key").value);
      showContent();
      onReady();
    });
    document.getElementById("logout").addEventListener("click", () => {
      sessionStorage.removeItem(STORE);
      location.reload();
    });
    if (authRequired && !key()) { showLogin(); return; }
    showContent();
    onReady();
  }

  // A refused key: forget it and ask again (data stays hidden).
  function refused() {
    sessionStorage.removeItem(STORE);
    showLogin("That key was refused; try again.");
  }

  function bytes(n) {
    const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
    for (const [unit, size] of units) {
      if (Math.abs(n) >= size) return (n / size).toFixed(size >= 2 ** 30 ? 2 : 1) + " " + unit;
    }
    return Math.round(n) + " B";
  }
  function seconds(s) { return s < 1 ? (s * 1e3).toFixed(s < 0.01 ? 2 : 1) + " ms" : s.toFixed(2) + " s"; }
  function pct(x) { return (100 * x).toFixed(1) + "%"; }

  // el("td", {className: "id"}, "text"): DOM built without innerHTML (request ids are data).
  function el(tag, props, ...children) {
    const node = Object.assign(document.createElement(tag), props || {});
    for (const c of children) node.append(c instanceof Node ? c : String(c));
    return node;
  }

  return { AuthError, api, start, refused, bytes, seconds, pct, el, authRequired };
})();
