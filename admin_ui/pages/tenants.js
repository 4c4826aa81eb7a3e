// Tenants: create, change limits, scheduling settings and storage quotas, suspend and
// reactivate.
import { api } from "../api.js";
import { badge, checkName, confirmButton, errorLine, field, fmtBytes, fmtInt, fmtUsed, h,
  table } from "../dom.js";

export const title = "Tenants";
const TENANT_RULE = "use lower-case letters, digits, '.', '_' or '-', starting with a " +
  "letter or digit (for example acme or team-2)";
const LIMITS = [
  ["max_requests_per_minute", "Requests / min"],
  ["max_tokens_per_minute", "Tokens / min"],
  ["max_concurrent_requests", "Concurrent"],
];

// Scheduling settings: [field, label, input attributes, hint]. Weight and class always have
// a value; an empty KV fraction or SLO means the server's default (sent as null).
const CLASSES = ["interactive", "batch"];
const SETTINGS = [
  ["weight", "Weight", { min: "0", max: "1000", step: "any", placeholder: "1" },
   "share of a busy engine, relative to other tenants"],
  ["max_kv_fraction", "Max KV fraction", { min: "0", max: "1", step: "any", placeholder: "default" },
   "most of the KV pool its running requests may hold (0–1]"],
  ["slo_ttft_ms", "TTFT SLO (ms)", { min: "1", step: "1", placeholder: "default" },
   "time to first token"],
  ["slo_tpot_ms", "TPOT SLO (ms)", { min: "1", step: "1", placeholder: "default" },
   "time per output token"],
];

function settingInput([key, label, attrs, hint], value) {
  return h("input", { type: "number", ...attrs, "aria-label": label, title: hint,
                      "data-setting": key,
                      value: value === null || value === undefined ? "" : String(value) });
}

function classSelect(value) {
  const select = h("select", { "aria-label": "Priority class", "data-setting": "priority_class",
                               title: "interactive work is admitted before batch work" },
    CLASSES.map((c) => h("option", { value: c }, c)));
  select.value = value || "interactive";
  return select;
}

/** The settings a row's inputs hold, as the API takes them. An empty weight is left out
 * (unchanged, or 1 for a new tenant); an empty KV fraction or SLO is null. */
function settingsBody(inputs, select) {
  const body = { priority_class: select.value };
  SETTINGS.forEach(([key], i) => {
    const v = limitValue(inputs[i]);
    if (key !== "weight" || v !== null) body[key] = v;
  });
  return body;
}

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
  const newWeight = settingInput(SETTINGS[0], null);
  const newClass = classSelect("interactive");
  // novalidate: checkName explains a refused name in the page, not in a browser tooltip.
  const form = h("form", { class: "inline", id: "create-tenant", novalidate: true },
    field("Name", name, "lower case, digits, . _ -"),
    LIMITS.map(([, label], i) => field(label, limitInputs[i], "empty = unlimited")),
    field("Weight", newWeight, "empty = 1"),
    field("Priority class", newClass, "interactive goes first"),
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
    const weight = limitValue(newWeight);
    if (weight !== null) body.weight = weight;
    body.priority_class = newClass.value;
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
    schedulingArea.replaceChildren(schedulingTable(data, load));
    storageArea.replaceChildren(storageTable(data, load));
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
      // The server refuses to suspend the tenant of the admin key in use (is_own): say so
      // instead of offering a button that can only fail.
      const toggle = suspended
        ? h("button", { type: "button", class: "small" }, "Reactivate")
        : t.is_own
          ? h("small", { class: "muted own-tenant" },
              "Cannot be suspended: it holds the admin key you are using.")
          : confirmButton("Suspend", "Confirm suspend", () => setStatus("suspended"),
                          "danger small");
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

  const schedulingArea = h("div", { id: "tenant-scheduling" });
  const storageArea = h("div", { id: "tenant-storage" });
  container.append(
    h("h1", {}, "Tenants"),
    h("div", { class: "card" }, h("h2", {}, "New tenant"), form, createError),
    h("div", { class: "card" }, h("h2", {}, "All tenants"),
      h("p", { class: "muted" }, "Limits apply from the next request. A suspended tenant's keys " +
        "stop working at once and its public adapters disappear for others."), listArea),
    h("div", { class: "card" }, h("h2", {}, "Scheduling"),
      h("p", { class: "muted" }, "When the engine is busy, interactive work is admitted " +
        "before batch work, and tenants of a class share it by weight. An empty KV fraction " +
        "or SLO uses the server's default. Changes apply from the next request."),
      schedulingArea),
    h("div", { class: "card" }, h("h2", {}, "Storage"),
      h("p", { class: "muted" }, "What each tenant keeps in the adapter store against its " +
        "quotas. An upload that would pass one is refused and nothing of it is kept. A " +
        "deleted version counts until its files are removed. Sizes take K, M, G or T " +
        "(powers of 1024); empty = unlimited."),
      storageArea));
  await load();
}

/** One row per tenant: weight, class, KV fraction and SLOs, each saved with its row. */
function schedulingTable(data, reload) {
  const rows = data.map((t) => {
    const inputs = SETTINGS.map((setting) => settingInput(setting, t[setting[0]]));
    const select = classSelect(t.priority_class);
    const rowError = errorLine();
    const save = h("button", { type: "button", class: "small" }, "Save scheduling");
    save.addEventListener("click", async () => {
      rowError.clear();
      try {
        await api("PATCH", `/admin/api/tenants/${encodeURIComponent(t.name)}`,
                  settingsBody(inputs, select));
        await reload();
      } catch (err) { rowError.show(err); }
    });
    return [h("strong", { class: "scheduled-tenant" }, t.name), inputs[0], select,
            ...inputs.slice(1), h("div", {}, h("div", { class: "actions" }, save), rowError)];
  });
  return table(["Tenant", "Weight", "Class", ...SETTINGS.slice(1).map(([, l]) => l),
                "Actions"], rows, "No tenants yet.");
}

const UNITS = ["", "K", "M", "G", "T"];

/** A byte quota as typed: "500M", "2G", "1048576"; null when empty. Text that is not a
 * size is sent as it is, so the server refuses it naming the field. */
function sizeValue(input) {
  const raw = input.value.trim();
  if (raw === "") return null;
  const m = /^(\d+)\s*(?:([kmgt])(?:i?b)?|b)?$/i.exec(raw);
  if (!m) return raw;
  const value = BigInt(m[1]) * 1024n ** BigInt(UNITS.indexOf((m[2] || "").toUpperCase()));
  return value <= BigInt(Number.MAX_SAFE_INTEGER) ? Number(value) : raw;
}

/** A byte quota shown in the largest unit that divides it exactly. */
function sizeText(n) {
  if (n === null || n === undefined) return "";
  let i = 0;
  while (i < UNITS.length - 1 && n % 1024 === 0 && n > 0) { n /= 1024; i += 1; }
  return `${n}${UNITS[i]}`;
}

/** One row per tenant: stored bytes and versions against the quotas, which save with it. */
function storageTable(data, reload) {
  const rows = data.map((t) => {
    const bytes = h("input", { type: "text", placeholder: "unlimited", "aria-label": "Max storage",
                               "data-quota": "max_storage_bytes", autocomplete: "off",
                               value: sizeText(t.max_storage_bytes) });
    const versions = h("input", { type: "number", min: "1", step: "1", placeholder: "unlimited",
                                  "aria-label": "Max adapter versions",
                                  "data-quota": "max_adapter_versions",
                                  value: t.max_adapter_versions === null ? ""
                                    : String(t.max_adapter_versions) });
    const rowError = errorLine();
    const save = h("button", { type: "button", class: "small" }, "Save quotas");
    save.addEventListener("click", async () => {
      rowError.clear();
      const raw = versions.value.trim();
      try {
        await api("PATCH", `/admin/api/tenants/${encodeURIComponent(t.name)}`, {
          max_storage_bytes: sizeValue(bytes),
          max_adapter_versions: raw === "" ? null : Number(raw) });
        await reload();
      } catch (err) { rowError.show(err); }
    });
    return [h("strong", { class: "storage-tenant" }, t.name),
            h("span", { class: "storage-used" }, fmtUsed(t.storage_bytes, t.max_storage_bytes, fmtBytes)),
            h("span", { class: "versions-used" },
              fmtUsed(t.num_adapter_versions, t.max_adapter_versions, fmtInt)),
            bytes, versions, h("div", {}, h("div", { class: "actions" }, save), rowError)];
  });
  return table(["Tenant", "Stored", "Versions", "Max storage", "Max versions", "Actions"], rows,
               "No tenants yet.");
}
