// Usage: tokens per hour, stacked by tenant or by adapter, drawn as SVG by hand; and each
// tenant's adapter storage now against its quotas.
import { api } from "../api.js";
import { errorLine, field, fmtBytes, fmtInt, fmtUsed, h, latestLoad, table } from "../dom.js";
import { tenantOptions } from "./keys.js";

export const title = "Usage";
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2f5bd3", "#e07a1f", "#1f9d6b", "#c23b6d", "#7a4fd0", "#2a9bb8",
                "#a3a12a", "#8c5a3c", "#5f6b7a", "#d14b3a"];
const HOUR = 3600 * 1000;

function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

/** A round step for 4 gridlines that cover `v`: 1, 2 or 5 times a power of ten. */
function niceStep(v) {
  if (v <= 0) return 1;
  const raw = v / 4;
  const p = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * p).find((m) => m >= raw);
}

/** Stacked bars: one per hour from `start` to `end`, one colour per series. */
function chart(rows, seriesOf, start, end) {
  const hours = [];
  for (let t = start; t <= end; t += HOUR) hours.push(t);
  const series = [...new Set(rows.map(seriesOf))].sort();
  const totals = new Map();  // hour -> series -> tokens
  for (const r of rows) {
    const t = Date.parse(r.hour);
    if (!totals.has(t)) totals.set(t, new Map());
    const m = totals.get(t);
    m.set(seriesOf(r), (m.get(seriesOf(r)) || 0) + r.total_tokens);
  }
  const maxStack = Math.max(0, ...[...totals.values()].map(
    (m) => [...m.values()].reduce((a, b) => a + b, 0)));
  const step = Math.max(1, niceStep(maxStack));
  const top = step * 4;
  const W = 960, H = 320, L = 64, R = 12, T = 14, B = 40;
  const plotW = W - L - R, plotH = H - T - B;
  const slot = plotW / hours.length;
  const bar = Math.max(1, slot * 0.72);
  const y = (v) => T + plotH - (v / top) * plotH;
  const svg = s("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", id: "usage-chart",
                         "aria-label": "Tokens per hour" });
  for (let i = 0; i <= 4; i++) {
    const v = step * i;
    svg.append(s("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#e3e6ea" }),
               s("text", { x: L - 8, y: y(v) + 4, "text-anchor": "end", "font-size": 12,
                           fill: "#5e6875" }, fmtInt(Math.round(v))));
  }
  const labelEvery = Math.ceil(hours.length / 8);
  hours.forEach((t, i) => {
    const x = L + i * slot + (slot - bar) / 2;
    let acc = 0;
    const m = totals.get(t);
    series.forEach((name, k) => {
      const v = m ? m.get(name) || 0 : 0;
      if (!v) return;
      const rect = s("rect", { x, y: y(acc + v), width: bar, height: Math.max(1, y(acc) - y(acc + v)),
                               fill: COLORS[k % COLORS.length], "data-series": name });
      rect.append(s("title", {}, `${name} · ${new Date(t).toLocaleString("en-GB")} · ` +
                                 `${fmtInt(v)} tokens`));
      svg.append(rect);
      acc += v;
    });
    if (i % labelEvery === 0) {
      const d = new Date(t);
      const label = `${String(d.getHours()).padStart(2, "0")}:00`;
      svg.append(s("text", { x: L + i * slot + slot / 2, y: H - B + 16, "text-anchor": "middle",
                             "font-size": 12, fill: "#5e6875" }, label));
      if (d.getHours() === 0 || i === 0) {
        svg.append(s("text", { x: L + i * slot + slot / 2, y: H - B + 32, "text-anchor": "middle",
                               "font-size": 11, fill: "#8a939e" },
                     d.toLocaleDateString("en-GB", { day: "2-digit", month: "short" })));
      }
    }
  });
  svg.append(s("line", { x1: L, x2: W - R, y1: y(0), y2: y(0), stroke: "#9aa3ad" }));
  const legend = h("div", { class: "legend" }, series.map((name, k) => {
    const sw = h("span", { class: "swatch" });
    sw.style.background = COLORS[k % COLORS.length];
    return h("span", {}, sw, name);
  }));
  return h("div", { class: "chart" }, svg, legend);
}

/** One row per tenant: stored bytes and active adapter versions against the quotas. */
function storageTable(storage) {
  return table(["Tenant", "Stored", "Versions"],
    [...storage].sort((a, b) => a.tenant.localeCompare(b.tenant)).map((t) => [
      h("strong", { class: "storage-tenant" }, t.tenant),
      h("span", { class: "storage-used" }, fmtUsed(t.storage_bytes, t.max_storage_bytes, fmtBytes)),
      h("span", { class: "versions-used" },
        fmtUsed(t.num_adapter_versions, t.max_adapter_versions, fmtInt))]),
    "No tenants yet.");
}

export async function render(container) {
  const windowSel = h("select", {}, [["24", "Last 24 hours"], ["48", "Last 48 hours"],
    ["168", "Last 7 days"], ["720", "Last 30 days"]].map(([v, l]) => h("option", { value: v }, l)));
  windowSel.value = "24";
  const tenant = h("select", {});
  const groupBy = h("select", {}, h("option", { value: "tenant" }, "tenant"),
                    h("option", { value: "model" }, "adapter"));
  const error = errorLine();
  const chartArea = h("div", { id: "usage-chart-area" });
  const totalsArea = h("div", { id: "usage-totals" });
  const storageArea = h("div", { id: "usage-storage" });
  for (const el of [windowSel, tenant, groupBy]) el.addEventListener("change", () => load());

  const begin = latestLoad();

  async function load() {
    const stale = begin();
    const end = Math.floor(Date.now() / HOUR) * HOUR;
    const start = end - (Number(windowSel.value) - 1) * HOUR;
    const params = new URLSearchParams({ since: new Date(start).toISOString(),
                                         until: new Date(end + HOUR).toISOString() });
    if (tenant.value) params.set("tenant", tenant.value);
    let report;
    try {
      report = await api("GET", `/admin/api/usage?${params}`);
      if (stale()) return;
      error.clear();
    } catch (err) { if (!stale()) error.show(err); return; }
    const seriesOf = groupBy.value === "tenant" ? (r) => r.tenant
      : (r) => (r.version ? `${r.model} v${r.version}` : `${r.model} (base)`);
    chartArea.replaceChildren(report.data.length ? chart(report.data, seriesOf, start, end)
      : h("p", { class: "muted empty" }, "No usage in this window."));
    // One row per series: by tenant, a tenant's row sums all its models and lists them;
    // by adapter, a row is one tenant's use of one model.
    const byTenant = groupBy.value === "tenant";
    const modelOf = (r) => (r.version ? `${r.model} v${r.version}` : `${r.model} (base)`);
    const rows = new Map();
    for (const r of report.data) {
      const k = byTenant ? r.tenant : `${r.tenant}\u0000${seriesOf(r)}`;
      const acc = rows.get(k) || { tenant: r.tenant, models: new Set(), requests: 0,
                                   prompt: 0, completion: 0 };
      acc.models.add(modelOf(r));
      acc.requests += r.requests; acc.prompt += r.prompt_tokens; acc.completion += r.completion_tokens;
      rows.set(k, acc);
    }
    storageArea.replaceChildren(storageTable(report.storage));
    totalsArea.replaceChildren(table(["Tenant", byTenant ? "Models" : "Model", "Requests",
                                      "Prompt tokens", "Completion tokens", "Total tokens"],
      [...rows.values()].sort((a, b) => (b.prompt + b.completion) - (a.prompt + a.completion))
        .map((r) => [r.tenant, [...r.models].sort().join(", "), fmtInt(r.requests),
                     fmtInt(r.prompt), fmtInt(r.completion), fmtInt(r.prompt + r.completion)]),
      "No usage in this window."));
  }

  container.append(
    h("h1", {}, "Usage"),
    h("div", { class: "card" },
      h("form", { class: "inline", onsubmit: (e) => e.preventDefault() },
        field("Window", windowSel), field("Tenant", tenant), field("Stack by", groupBy)),
      error),
    h("div", { class: "card" }, h("h2", {}, "Tokens per hour"), chartArea),
    h("div", { class: "card" }, h("h2", {}, "Totals"), totalsArea),
    h("div", { class: "card" }, h("h2", {}, "Storage"),
      h("p", { class: "muted" }, "What each tenant keeps in the adapter store now (not over " +
        "the window), against its quotas; set them on the Tenants page. A deleted version " +
        "counts until its files are removed."), storageArea));
  try { await tenantOptions(tenant, { all: true }); } catch (err) { error.show(err); }
  await load();
}
