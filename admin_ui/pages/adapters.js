// Adapters: upload (with progress; refusals shown inline), versions with the current one,
// a canary split's shares and pins, promote (confirmed), split, cancel, pin or unpin,
// visibility, delete.
import { api, upload } from "../api.js";
import {
  badge, checkName, confirmButton, errorLine, field, fmtBytes, fmtTime, h, latestLoad, table,
} from "../dom.js";
import { tenantOptions } from "./keys.js";

export const title = "Adapters";
const enc = encodeURIComponent;
// An unmeasured version this young is still being measured (the probe waits behind
// interactive work); an older one's probe failed, or it predates probes.
const MEASURING_MS = 120_000;

// A version's measured effect (the mean KL of its next-token distribution from the base
// model's on the probe prompts, and how many of their greedy continuations it changed).
export function effectText(effect) {
  if (!effect) return null;
  const kl = effect.kl === 0 ? "0" : effect.kl < 0.001 ? effect.kl.toExponential(1)
    : String(Number(effect.kl.toPrecision(2)));
  return `KL ${kl} · ${Math.round(effect.changed * effect.prompts)}/${effect.prompts} changed`;
}

export async function render(container) {
  const tenant = h("select", { required: true });
  const name = h("input", { required: true, placeholder: "support-bot", autocomplete: "off",
                            spellcheck: "false", pattern: "[A-Za-z0-9][A-Za-z0-9_.\\-]*" });
  const visibility = h("select", {}, h("option", { value: "private" }, "private"),
                       h("option", { value: "public" }, "public (others call it as tenant/name)"));
  const files = h("input", { type: "file", multiple: true, required: true,
                             accept: ".json,.safetensors,.zip,.gz,.tgz,.md" });
  const submit = h("button", { type: "submit", class: "primary" }, "Upload");
  const progress = h("progress", { max: "1", value: "0", hidden: true, "aria-label": "Upload progress" });
  const uploadError = errorLine();
  uploadError.id = "upload-error";
  const uploadDone = h("p", { class: "success", role: "status", hidden: true, id: "upload-done" });
  const uploadWarning = h("p", { class: "notice", role: "status", hidden: true,
                                 id: "upload-warning" });
  const form = h("form", { class: "inline", id: "upload-adapter", novalidate: true },
    field("Tenant", tenant), field("Name", name, "a new upload under a name is a new version"),
    field("Visibility", visibility),
    field("Files", files, "adapter_config.json + adapter_model.safetensors, or one .zip / .tar.gz"),
    submit);

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    uploadError.clear();
    uploadDone.hidden = true;
    uploadWarning.hidden = true;
    if (!tenant.value) { uploadError.show(new Error("Choose a tenant first.")); return; }
    if (!checkName(name, "Adapter name", "use letters, digits, '.', '_' or '-', starting " +
                   "with a letter or digit", uploadError)) return;
    if (!files.files.length) { uploadError.show(new Error("Choose the adapter's files.")); return; }
    const body = new FormData();
    body.append("name", name.value.trim());
    body.append("visibility", visibility.value);
    for (const file of files.files) body.append("file", file, file.name);
    progress.value = 0;
    progress.hidden = false;
    submit.disabled = true;
    try {
      const row = await upload(`/admin/api/tenants/${enc(tenant.value)}/adapters`, body,
                               (fraction) => { progress.value = fraction; });
      progress.value = 1;
      uploadDone.textContent = `Stored ${row.model} version ${row.version} (rank ${row.rank}, ` +
        `${fmtBytes(row.size_bytes)}). Call it with model "${row.name}" using a key of ` +
        `${row.tenant}${row.visibility === "public" ? `, or "${row.model}" from any tenant` : ""}.` +
        (row.effect ? ` Measured effect: ${effectText(row.effect)}.`
          : row.effect_pending ? " Its effect is being measured." : "");
      uploadDone.hidden = false;
      uploadWarning.textContent = (row.warnings || []).join(" ");
      uploadWarning.hidden = !uploadWarning.textContent;
      name.value = "";
      files.value = "";
      await load();
    } catch (err) {
      uploadError.show(err);
    } finally {
      submit.disabled = false;
      progress.hidden = true;
    }
  });

  const filter = h("select", { "aria-label": "Show adapters of" });
  const showDeleted = h("input", { type: "checkbox" });
  const listArea = h("div", { id: "adapter-list" });
  filter.addEventListener("change", () => load());
  showDeleted.addEventListener("change", () => load());

  const begin = latestLoad();

  async function load() {
    const stale = begin();
    let data;
    try {
      const params = new URLSearchParams();
      if (filter.value) params.set("tenant", filter.value);
      if (showDeleted.checked) params.set("include_deleted", "true");
      data = (await api("GET", `/admin/api/adapters?${params}`)).data;
    } catch (err) {
      if (stale()) return;
      const e = errorLine(); e.show(err); listArea.replaceChildren(e); return;
    }
    if (stale()) return;
    listArea.replaceChildren(table(
      ["Adapter", "Version", "Rank", "Size", "Visibility", "Status", "Uploaded", "Identity",
       ""],
      data.map((a) => {
        const rowError = errorLine();
        const path = `/admin/api/tenants/${enc(a.tenant)}/adapters/${enc(a.name)}`;
        const actions = h("div", { class: "actions" });
        const act = async (method, suffix, body) => {
          rowError.clear();
          try { await api(method, `${path}${suffix}`, body); await load(); }
          catch (err) { rowError.show(err); }
        };
        // A split is in progress on a name when one of its versions has a share strictly
        // between 0 and 100: its current version carries the rest.
        const splitting = data.some((b) => b.tenant === a.tenant && b.name === a.name &&
                                    b.traffic_percent > 0 && b.traffic_percent < 100);
        if (a.status === "active") {
          if (!a.current) {
            actions.append(confirmButton("Promote", `Make v${a.version} current?`,
              () => act("POST", "/promote", { version: a.version }), "small promote"));
            const percent = h("input", { type: "number", min: "0", max: "100", step: "any",
                                         class: "percent", placeholder: "%",
                                         "aria-label": `Percent of requests to v${a.version}` });
            const split = h("button", { type: "button", class: "small split" }, "Split");
            split.addEventListener("click", () => act("POST", "/split", {
              version: a.version, percent: percent.value === "" ? null : Number(percent.value) }));
            actions.append(h("span", { class: "split-control" }, percent, split));
          } else if (splitting) {
            const cancel = h("button", { type: "button", class: "small cancel-split" },
                             "Cancel split");
            cancel.addEventListener("click", () => act("DELETE", "/split"));
            actions.append(cancel);
          }
          // A pinned version keeps a device slot: its requests never wait for a load.
          const pin = h("button", { type: "button", class: `small ${a.pinned ? "unpin" : "pin"}`,
                                    title: a.pinned ? "Give its device slot back to the working set"
                                      : "Keep it in a device slot and the host cache" },
                        a.pinned ? "Unpin" : "Pin");
          pin.addEventListener("click", () => (a.pinned
            ? act("DELETE", `/pin?version=${a.version}`) : act("POST", "/pin", { version: a.version })));
          actions.append(pin);
          const other = a.visibility === "public" ? "private" : "public";
          const toggle = h("button", { type: "button", class: "small" }, `Make ${other}`);
          toggle.addEventListener("click", () => act("PATCH", "", { visibility: other }));
          actions.append(toggle, confirmButton("Delete", `Delete v${a.version}?`,
            () => act("DELETE", `?version=${a.version}`), "danger small"));
        }
        const traffic = a.status !== "active" ? "—"
          : a.traffic_percent > 0 ? `${Number(a.traffic_percent.toFixed(2))}%` : "0%";
        // The version, whether it is current or a canary, and its share of the requests.
        return [h("strong", {}, a.model),
                h("div", {}, h("span", { class: "nowrap" }, `v${a.version} `,
                  a.current ? badge("current", "good") : null,
                  a.traffic_percent > 0 && !a.current ? badge("canary", "warn") : null,
                  a.pinned ? h("span", { title: `pinned ${fmtTime(a.pinned_at)}: kept in a ` +
                                         "device slot, its requests never wait for a load" },
                               " ", badge("pinned")) : null),
                  h("div", { class: "muted subline traffic", title: "share of requests" },
                    `${traffic} of traffic`),
                  h("div", { class: "muted subline effect",
                              title: a.effect ? `measured effect (${fmtTime(a.effect.measured_at)}): mean ` +
                                "KL of the next-token distribution from the base model's, and " +
                                "the probe prompts whose greedy continuation it changed"
                                : "its effect is not measured (yet)" },
                    effectText(a.effect) || (a.status === "active"
                      && Date.now() - Date.parse(a.created_at) < MEASURING_MS ? "measuring…"
                      : "—"))),
                `${a.rank}${a.use_rslora ? " (rs)" : ""}`, fmtBytes(a.size_bytes),
                badge(a.visibility), badge(a.status), fmtTime(a.created_at),
                h("code", { title: a.identity }, `${a.id}@${a.digest.slice(0, 12)}`),
                h("div", {}, actions, rowError)];
      }), "No adapters yet."));
  }

  container.append(
    h("h1", {}, "Adapters"),
    h("div", { class: "card" }, h("h2", {}, "Upload an adapter"),
      h("p", { class: "muted" }, "A PEFT LoRA adapter for the served base model. It is checked " +
        "before it is stored: a refusal says why."),
      form, progress, uploadError, uploadDone, uploadWarning),
    h("div", { class: "card" },
      h("div", { class: "page-head" }, h("h2", {}, "Versions"),
        h("div", { class: "actions" }, field("Tenant", filter),
          h("label", {}, showDeleted, " show deleted"))),
      listArea));
  try {
    await tenantOptions(tenant);
    await tenantOptions(filter, { all: true });
  } catch (err) { uploadError.show(err); }
  await load();
}
