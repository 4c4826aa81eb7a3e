// Tenants: create, change limits, suspend and reactivate.
import { api } from "../api.js";
import { badge, checkName, confirmButton, errorLine, field, h, table } from "../dom.js";

export const title = "Tenants";
const TENANT_RULE = "use lower-case letters, digits, '.', '_' or '-', starting with a " +
  "letter or digit (for example acme or team-2)";
const LIMITS = [
  ["max_requests_per_minute", "Requests / min"],
  ["max_tokens_per_minute", "Tokens / min"],
  ["max_concurrent_requests", "Concurrent"],
];

function limitValue(input) {
  const raw = input.value.trim();
  return raw === "" ? null : Number(raw);
}

function limitInput(value, label) {
  return h("input", { type: "number", min: "1", step: "1", placeholder: "unlimited",
                      "aria-label": label, value: value === null ? "" : String(value) });
}

export async function render(container) {
  const listArea = h("div");
  const createError = errorLine();
  const name = h("input", { required: true, placeholder: "acme", pattern: "[a-z0-9][a-z0-9_.\\-]*",
                            autocomplete: "off", spellcheck: "false" });
  const limitInputs = LIMITS.map(([, label]) => limitInput(null, label));
  // novalidate: checkName explains a refused name in the page, not in a browser tooltip.
  const form = h("form", { class: "inline", id: "create-tenant", novalidate: true },
    field("Name", name, "lower case, digits, . _ -"),
    LIMITS.map(([, label], i) => field(label, limitInputs[i], "empty = unlimited")),
    h("button", { type: "submit", class: "primary" }, "Create tenant"));

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    createError.clear();
    if (!checkName(name, "Tenant name", TENANT_RULE, createError)) return;
    const body = { name: name.value.trim() };
    LIMITS.forEach(([key], i) => {
      const v = limitValue(limitInputs[i]);
      if (v !== null) body[key] = v;
    });
    try {
      await api("POST", "/admin/api/tenants", body);
      form.reset();
      await load();
    } catch (err) { createError.show(err); }
  });

  async function load() {
    let data;
    try {
      data = (await api("GET", "/admin/api/tenants")).data;
    } catch (err) {
      const e = errorLine(); e.show(err); listArea.replaceChildren(e); return;
    }
    const rows = data.map((t) => {
      const inputs = LIMITS.map(([key, label]) => limitInput(t[key], label));
      const rowError = errorLine();
      const save = h("button", { type: "button", class: "small" }, "Save limits");
      save.addEventListener("click", async () => {
        rowError.clear();
        const body = {};
        LIMITS.forEach(([key], i) => { body[key] = limitValue(inputs[i]); });
        try { await api("PATCH", `/admin/api/tenants/${encodeURIComponent(t.name)}`, body);
              await load(); } catch (err) { rowError.show(err); }
      });
      const suspended = t.status === "suspended";
      const toggle = suspended
        ? h("button", { type: "button", class: "small" }, "Reactivate")
        : confirmButton("Suspend", "Confirm suspend", () => setStatus("suspended"), "danger small");
      if (suspended) toggle.addEventListener("click", () => setStatus("active"));
      async function setStatus(status) {
        rowError.clear();
        try { await api("PATCH", `/admin/api/tenants/${encodeURIComponent(t.name)}`, { status });
              await load(); } catch (err) { rowError.show(err); }
      }
      return [h("strong", { class: "tenant-name" }, t.name), badge(t.status),
              ...inputs, `${t.num_active_keys} / ${t.num_adapters}`,
              h("div", {}, h("div", { class: "actions" }, save, toggle), rowError)];
    });
    listArea.replaceChildren(table(
      ["Tenant", "Status", ...LIMITS.map(([, l]) => l), "Keys / adapters", "Actions"], rows,
      "No tenants yet: create the first one above."));
  }

  container.append(
    h("h1", {}, "Tenants"),
    h("div", { class: "card" }, h("h2", {}, "New tenant"), form, createError),
    h("div", { class: "card" }, h("h2", {}, "All tenants"),
      h("p", { class: "muted" }, "Limits apply from the next request. A suspended tenant's keys " +
        "stop working at once and its public adapters disappear for others."), listArea));
  await load();
}
