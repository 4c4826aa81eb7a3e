// The admin UI shell: sign-in, navigation between pages (#/tenants …), sign-out.
import { api, session, setUnauthorizedHandler } from "./api.js";
import * as tenants from "./pages/tenants.js";
import * as keys from "./pages/keys.js";
import * as adapters from "./pages/adapters.js";
import * as usage from "./pages/usage.js";
import * as engine from "./pages/engine.js";

const PAGES = { tenants, keys, adapters, usage, engine };
const $ = (id) => document.getElementById(id);
let cleanup = null;

function showSignIn(message) {
  if (cleanup) { cleanup(); cleanup = null; }
  $("page").hidden = true;
  $("nav").hidden = true;
  $("sign-out").hidden = true;
  $("sign-in").hidden = false;
  const error = $("sign-in-error");
  error.hidden = !message;
  error.textContent = message || "";
  $("admin-key").focus();
}

async function render() {
  if (!session.key) { showSignIn(); return; }
  const name = (location.hash.match(/^#\/(\w+)/) || [])[1];
  const page = PAGES[name] ? name : "tenants";
  if (cleanup) { cleanup(); cleanup = null; }
  $("sign-in").hidden = true;
  $("nav").hidden = false;
  $("sign-out").hidden = false;
  for (const link of document.querySelectorAll("#nav a")) {
    link.classList.toggle("active", link.dataset.page === page);
    if (link.dataset.page === page) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  const container = $("page");
  container.replaceChildren();
  container.hidden = false;
  container.dataset.page = page;
  document.title = `${PAGES[page].title} · loraplex admin`;
  cleanup = (await PAGES[page].render(container)) || null;
}

$("sign-in-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const key = $("admin-key").value.trim();
  const button = event.submitter || event.target.querySelector("button");
  button.disabled = true;
  try {
    await api("GET", "/admin/api/tenants", undefined, key);  // checks the key is an admin's
    session.set(key);
    $("admin-key").value = "";
    if (!location.hash) location.hash = "#/tenants";
    await render();
  } catch (err) {
    showSignIn(err.status === 403 ? "This key is valid but is not an admin key."
                                   : err.message);
  } finally {
    button.disabled = false;
  }
});

$("sign-out").addEventListener("click", () => {
  session.clear();
  showSignIn("Signed out.");
});

setUnauthorizedHandler((error) => {
  session.clear();
  showSignIn(`Signed out: ${error.message}`);
});

window.addEventListener("hashchange", render);
render();
