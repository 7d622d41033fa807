// The dashboard's only script: keeps the API key in this tab's sessionStorage, fetches the page's
// fragments with it as a bearer token (never in a URL) and swaps them in every few seconds.
"use strict";

(() => {
  const STORE = "sluice-api-key";
  const $ = (id) => document.getElementById(id);
  const every = Number(document.body.dataset.refresh) || 3000;
  const parts = Array.from(document.querySelectorAll("[data-src]"));
  let timer = null;

  function source(el) {
    // The list's page comes from this page's ?after=, and nothing else of its URL goes along.
    const after = new URLSearchParams(location.search).get("after");
    return el.id === "batches" && after ? `${el.dataset.src}?after=${encodeURIComponent(after)}` : el.dataset.src;
  }

  function get(url) {
    const key = sessionStorage.getItem(STORE);
    return fetch(url, { headers: key ? { Authorization: `Bearer ${key}` } : {}, cache: "no-store",
                        credentials: "omit" });
  }

  async function message(answer) {
    try {
      return (await answer.json()).error.message;
    } catch {
      return `HTTP ${answer.status}`;
    }
  }

  function swap(el, html) {
    // Rendered by the server, escaped there. Keyboard focus inside stays on the same link or control.
    const active = el.contains(document.activeElement) ? document.activeElement : null;
    const href = active && active.getAttribute("href");
    const find = active && (active.id ? `#${CSS.escape(active.id)}` : href ? `[href="${CSS.escape(href)}"]` : null);
    el.innerHTML = html;
    if (find) el.querySelector(find)?.focus();
  }

  function say(problem) {
    // A live region: only a change is announced, not every refresh.
    if ($("problem").textContent !== problem) $("problem").textContent = problem;
  }

  function showLogin(error) {
    clearTimeout(timer);
    if (error) sessionStorage.removeItem(STORE);
    parts.forEach((el) => { el.replaceChildren(); });  // nothing read with a key stays on screen
    $("app").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = error;
    if (error) $("key").focus();
  }

  function showApp() {
    $("login").hidden = true;
    $("app").hidden = false;
    $("logout").hidden = !sessionStorage.getItem(STORE);
  }

  async function start() {
    // Ask first whether this tab's key (or none) may read the fragments: /dashboard/session answers 200
    // either way, so a page that shows its login logs no 401 in the console.
    clearTimeout(timer);
    const key = sessionStorage.getItem(STORE);
    try {
      const answer = await get("/dashboard/session");
      const session = answer.ok ? await answer.json() : { authorized: false };
      if (!session.authorized) {
        showLogin(key ? "That API key was refused: check SLUICE_API_KEY." : "");
        return;
      }
    } catch (e) {
      say(`The API did not answer (${e.message}); trying again.`);
      timer = setTimeout(start, every);
      return;
    }
    refresh();
  }

  async function refresh() {
    clearTimeout(timer);
    try {
      const answers = await Promise.all(parts.map((el) => get(source(el))));
      if (answers.some((a) => a.status === 401)) {
        showLogin(sessionStorage.getItem(STORE) ? "That API key was refused: check SLUICE_API_KEY." : "");
        return;
      }
      const problems = [];
      for (const [i, answer] of answers.entries()) {
        if ((answer.headers.get("content-type") || "").startsWith("text/html")) {
          swap(parts[i], await answer.text());
        } else {
          problems.push(await message(answer));
        }
      }
      showApp();
      $("updated").textContent = `Updated ${new Date().toLocaleTimeString()}`;
      say(problems.join("; "));
    } catch (e) {
      say(`The API did not answer (${e.message}); trying again.`);
    }
    if (!document.hidden) timer = setTimeout(refresh, every);
  }

  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(STORE, $("key").value);
    $("key").value = "";
    $("login-error").textContent = "";
    start();
  });
  $("logout").addEventListener("click", () => {
    sessionStorage.removeItem(STORE);
    showLogin("");
  });
  document.addEventListener("visibilitychange", () => {
    // Polling pauses while the tab is hidden; behind the login there is nothing to poll.
    if (!document.hidden && !$("app").hidden) refresh();
  });
  start();
})();
