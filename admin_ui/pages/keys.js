// API keys: issue (shown once, with a copy button) and revoke.
import { api } from "../api.js";
import { badge, confirmButton, errorLine, field, fmtTime, h, latestLoad, table } from "../dom.js";

export const title = "API keys";

export async function tenantOptions(select, { all = false, selected = "" } = {}) {
  const { data } = await api("GET", "/admin/api/tenants");
  select.replaceChildren(
    ...(all ? [h("option", { value: "" }, "All tenants")] : []),
    ...data.map((t) => h("option", { value: t.name }, t.status === "active" ? t.name
                                                          : `${t.name} (${t.status})`)));
  if (selected) select.value = selected;
  return data;
}

async function copy(text, input) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    input.select();  // no clipboard permission: leave it selected for Ctrl+C
    return document.execCommand && document.execCommand("copy");
  }
}

export async function render(container) {
  const tenant = h("select", { required: true });
  const keyName = h("input", { placeholder: "e.g. production", maxlength: "128" });
  const role = h("select", {}, h("option", { value: "tenant" }, "tenant"),
                 h("option", { value: "admin" }, "admin"));
  const issueError = errorLine();
  const issued = h("div", { class: "notice", id: "issued-key", hidden: true });
  const form = h("form", { class: "inline", id: "issue-key" },
    field("Tenant", tenant), field("Key name (optional)", keyName),
    field("Role", role, "admin keys can use this console"),
    h("button", { type: "submit", class: "primary" }, "Issue key"));
  const filter = h("select", { "aria-label": "Show keys of" });
  const listArea = h("div");

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    issueError.clear();
    issued.hidden = true;
    try {
      const key = await api("POST", `/admin/api/tenants/${encodeURIComponent(tenant.value)}/keys`,
                            { name: keyName.value.trim() || null, role: role.value });
      const secret = h("input", { readonly: true, value: key.key, "aria-label": "New API key",
                                  spellcheck: "false" });
      const status = h("span", { class: "muted", role: "status" });
      const copyButton = h("button", { type: "button", class: "primary" }, "Copy");
      copyButton.addEventListener("click", async () => {
        status.textContent = (await copy(key.key, secret)) ? "Copied." : "Press Ctrl+C to copy.";
      });
      issued.replaceChildren(
        h("strong", {}, `New key for ${key.tenant}`),
        h("div", {}, "Copy it now: it is shown only this once and cannot be recovered."),
        h("div", { class: "secret" }, secret, copyButton), status);
      issued.hidden = false;
      form.reset();
      tenant.value = key.tenant;
      await load();
    } catch (err) { issueError.show(err); }
  });
  filter.addEventListener("change", () => load());

  const begin = latestLoad();

  async function load() {
    const stale = begin();
    let data;
    try {
      const query = filter.value ? `?tenant=${encodeURIComponent(filter.value)}` : "";
      data = (await api("GET", `/admin/api/keys${query}`)).data;
    } catch (err) {
      if (stale()) return;
      const e = errorLine(); e.show(err); listArea.replaceChildren(e); return;
    }
    if (stale()) return;
    data.sort((a, b) => (a.status === b.status ? b.id - a.id : a.status === "active" ? -1 : 1));
    listArea.replaceChildren(table(
      ["Key", "Tenant", "Name", "Role", "Status", "Created", "Last used", ""],
      data.map((k) => {
        const rowError = errorLine();
        const revoke = k.status === "active"
          ? confirmButton("Revoke", "Confirm revoke", async () => {
            rowError.clear();
            try { await api("DELETE", `/admin/api/keys/${k.id}`); await load(); }
            catch (err) { rowError.show(err); }
          }, "danger small") : "";
        return [h("code", {}, `${k.prefix}…`), k.tenant, k.name || "—", badge(k.role),
                badge(k.status), fmtTime(k.created_at), fmtTime(k.last_used_at),
                h("div", {}, revoke, rowError)];
      }), "No keys."));
  }

  container.append(
    h("h1", {}, "API keys"),
    h("div", { class: "card" }, h("h2", {}, "Issue a key"), form, issueError, issued),
    h("div", { class: "card" },
      h("div", { class: "page-head" }, h("h2", {}, "Keys"), field("Show", filter)), listArea));
  try {
    const tenants = await tenantOptions(tenant);
    await tenantOptions(filter, { all: true });
    if (!tenants.length) issueError.show(new Error("Create a tenant first (Tenants page)."));
  } catch (err) { issueError.show(err); }
  await load();
}
