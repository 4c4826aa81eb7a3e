// Engine: queue, KV cache, prefix-cache hit rate, the KV disk tier, adapter slots and
// speculative decoding of the whole deployment, each tenant's share and recent latency,
// then each replica's and each replica's device slots, refreshed every 2 s.
import { api } from "../api.js";
import { badge, errorLine, fmtBytes, fmtInt, h, table } from "../dom.js";

export const title = "Engine";
const REFRESH_MS = 2000;

function stat(label, value, sub, fraction, id) {
  return h("div", { class: "stat", id }, h("div", { class: "label" }, label),
    h("div", { class: "value" }, value), sub ? h("div", { class: "sub" }, sub) : null,
    fraction === undefined ? null : (() => {
      const bar = h("span");
      bar.style.width = `${Math.max(0, Math.min(1, fraction)) * 100}%`;
      return h("div", { class: "meter" }, bar);
    })());
}

const pct = (x) => `${(100 * x).toFixed(1)}%`;
const DASH = "—";

// A latency in seconds as [number, unit], in the unit that keeps it short: 0.8 ms, 12 ms,
// 1.24 s.
function inUnit(s) {
  if (s >= 1) return [s.toFixed(2), "s"];
  const ms = 1000 * s;
  return [ms < 10 ? ms.toFixed(1) : String(Math.round(ms)), "ms"];
}

// "p50 / p99" in one unit where both share it ("2.4 / 4.7 ms"), kept on one line.
function spread(p50, p99, seconds = true) {
  if (p50 === null || p50 === undefined) return DASH;
  let text = `${fmtInt(p50)} / ${fmtInt(p99)}`;
  if (seconds) {
    const [a, unitA] = inUnit(p50);
    const [b, unitB] = inUnit(p99);
    text = unitA === unitB ? `${a} / ${b} ${unitA}` : `${a} ${unitA} / ${b} ${unitB}`;
  }
  return h("span", { class: "nowrap" }, text);
}

// An objective in milliseconds: 200 ms, 2 s, 3,600 s.
const fmtMs = (ms) => (ms < 1000 ? `${ms} ms` : `${fmtInt(Number((ms / 1000).toFixed(2)))} s`);

// Attainment as a coloured badge (met at least 99%: good; 90%: warn; else bad), the SLO it
// was judged against under it.
function attainment(row) {
  if (!row) return h("span", { class: "muted" }, "no requests yet");
  const slo = row.slo_ttft_ms === null ? null
    : h("div", { class: "muted subline" },
        `SLO: TTFT ≤ ${fmtMs(row.slo_ttft_ms)} · TPOT ≤ ${fmtMs(row.slo_tpot_ms)}`);
  if (row.slo_attainment === null) return h("div", {}, h("span", { class: "muted" }, DASH), slo);
  const a = row.slo_attainment;
  return h("div", {}, badge(pct(a), a >= 0.99 ? "good" : a >= 0.9 ? "warn" : "bad"), slo);
}

// One row per tenant: the scheduler's view (engine.tenants, by registry id) joined with the
// gateway's latency window (by tenant name); a tenant in only one of them still gets a row.
function tenantRows(tenants, latency) {
  const byName = new Map(latency.map((r) => [r.tenant, r]));
  const rows = tenants.map((t) => {
    const name = t.name ?? null;
    const row = name === null ? null : byName.get(name) ?? null;
    if (row) byName.delete(name);
    return { name, id: t.tenant, sched: t, row };
  });
  for (const row of byName.values()) rows.push({ name: row.tenant, id: null, sched: null, row });
  rows.sort((a, b) => (a.name ?? `~${a.id}`).localeCompare(b.name ?? `~${b.id}`));
  return rows.map(({ name, id, sched, row }) => {
    const who = name !== null
      ? h("div", {}, h("strong", {}, name),
          row ? h("div", { class: "muted subline" }, `${fmtInt(row.requests)} recent request${row.requests === 1 ? "" : "s"}`)
            : null)
      : h("span", { class: "muted" }, id ? `tenant #${id} (unknown)` : "no tenant");
    const num = (field) => (sched ? fmtInt(sched[field]) : DASH);
    return [who, sched ? String(Number(sched.weight.toFixed(2))) : DASH, num("num_waiting"),
      num("num_running"), num("kv_blocks"),
      row ? spread(row.ttft_p50_s, row.ttft_p99_s) : DASH,
      row ? spread(row.tpot_p50_s, row.tpot_p99_s) : DASH,
      row ? spread(row.ttft_steps_p50, row.ttft_steps_p99, false) : DASH,
      attainment(row)];
  });
}

// The prefix cache's disk tier of a deployment or replica (kv_disk_max_bytes is 0 where
// there is none): each figure in a span named by its API field.
const fig = (s, field, text) => h("span", { "data-figure": field }, text ?? fmtInt(s[field]));

function diskFigures(s) {
  return [fig(s, "kv_disk_blocks"), " blocks of ", fig(s, "kv_disk_max_bytes",
    fmtBytes(s.kv_disk_max_bytes)), " · ", fig(s, "kv_disk_hit_tokens"), " hit tokens · ",
  fig(s, "kv_disk_writes"), " writes · ", fig(s, "kv_disk_evictions"), " evictions · ",
  fig(s, "kv_disk_refused"), " refused"];
}

function diskStat(s) {
  if (!s.kv_disk_max_bytes) {
    return stat("KV disk tier", "off", "no --kv-disk-dir", undefined, "engine-disk");
  }
  return stat("KV disk tier", fig(s, "kv_disk_bytes_used", fmtBytes(s.kv_disk_bytes_used)),
    diskFigures(s), s.kv_disk_bytes_used / s.kv_disk_max_bytes, "engine-disk");
}

function diskCell(r) {
  if (!r.kv_disk_max_bytes) return h("span", { class: "muted disk-off" }, "off");
  return h("div", {}, fig(r, "kv_disk_bytes_used", fmtBytes(r.kv_disk_bytes_used)),
    h("div", { class: "muted subline" }, diskFigures(r)));
}

// One row per replica: its queue, KV pool, disk tier and what sits in its device slots.
function replicaRows(replicas) {
  return replicas.map((r) => {
    const loaded = r.slots.filter(Boolean);
    return [r.role ? `${r.replica} (${r.role})` : String(r.replica),
      fmtInt(r.num_waiting), fmtInt(r.num_running),
      pct(r.kv_pool_usage), diskCell(r), `${loaded.length} / ${r.max_loras}`,
      loaded.length
        ? h("span", {}, loaded.flatMap((slot, i) => [i ? ", " : null,
            h("strong", {}, slot.model || "(unknown)"), " ", h("code", {}, slot.identity)]))
        : h("span", { class: "muted" }, "none"),
      `${r.host_adapters.length} / ${r.max_cpu_loras}`];
  });
}

// With prefill/decode disaggregation, one row per pool (the API's "pools": the sums
// over its replicas); the blocks its replicas handed over, took in and refused.
function poolRows(pools) {
  return pools.map((p) => [h("strong", {}, p.role), fmtInt(p.num_replicas),
    fmtInt(p.num_waiting), fmtInt(p.num_running), pct(p.kv_pool_usage),
    pct(p.prefix_cache_hit_rate), fig(p, "kv_transfer_exported"),
    fig(p, "kv_transfer_imported"), fig(p, "kv_transfer_refused")]);
}

// One row per device slot of each replica, named by the replica's ordinal as in the
// Replicas table and by its index within that replica.
function slotRows(replicas) {
  return replicas.flatMap((r) => r.slots.map((slot, i) => {
    const where = [h("span", { class: "slot-replica" }, String(r.replica)), String(i)];
    return slot
      ? [...where, h("strong", {}, slot.model || "(unknown)"),
         h("span", {}, slot.version ? `v${slot.version}${slot.status === "deleted" ? " (deleted)" : ""}`
           : DASH, slot.pinned ? " " : null, slot.pinned ? badge("pinned") : null),
         h("code", {}, slot.identity)]
      : [...where, h("span", { class: "muted" }, "empty"), DASH, DASH];
  }));
}

export async function render(container) {
  const stamp = h("span", { class: "muted", id: "engine-updated" });
  const error = errorLine();
  const stats = h("div", { class: "stats", id: "engine-stats" });
  const slots = h("div", { id: "engine-slots" });
  const replicas = h("div", { id: "engine-replicas" });
  const pools = h("div", { id: "engine-pools" });
  const poolsCard = h("div", { class: "card", hidden: true }, h("h2", {}, "Pools"), pools);
  const spec = h("div", { id: "engine-spec" });
  const tenants = h("div", { id: "engine-tenants" });
  const latencyNote = h("span", { class: "muted subline" });
  let timer = null;
  let stopped = false;

  async function refresh() {
    try {
      const [s, latency] = await Promise.all([api("GET", "/admin/api/engine"),
        api("GET", "/admin/api/latency")]);
      error.clear();
      stats.replaceChildren(
        stat("Queue", fmtInt(s.num_waiting), `${s.num_running} running · ${s.num_swapped} ` +
             `swapped · ${s.num_unfinished} unfinished`),
        // The headline is how much of the pool is taken; the fill of the blocks held
        // (padding of their last blocks aside) is a different figure, named as such.
        stat("KV cache in use", pct(s.kv_pool_usage), `${fmtInt(s.kv_blocks_used)} of ` +
             `${fmtInt(s.kv_blocks_total)} blocks used · ${fmtInt(s.kv_blocks_cached_free)} ` +
             `cached · ${pct(s.kv_utilization)} fill of held blocks`, s.kv_pool_usage),
        stat("Prefix-cache hit rate", pct(s.prefix_cache_hit_rate),
             `${fmtInt(s.prefix_cache_hit_tokens)} of ${fmtInt(s.prefix_cache_queried_tokens)} ` +
             "prompt tokens", s.prefix_cache_hit_rate),
        diskStat(s),
        stat("Adapter slots", `${s.slots.filter(Boolean).length} / ${s.slots.length}`,
             `${fmtInt(s.adapter_slot_loads)} loads · ${fmtInt(s.adapter_slot_evictions)} ` +
             `evictions · ${s.adapter_load_seconds.toFixed(2)} s loading · ` +
             `${s.pinned_adapters.length} of ${s.max_pinned} pinned`),
        stat("Steps", fmtInt(s.num_steps), `${fmtInt(s.num_preemptions)} preemptions`),
        stat("Speculation accepted", s.spec_num_drafts ? pct(s.spec_acceptance_rate) : "—",
             `${fmtInt(s.spec_num_accepted_tokens)} of ${fmtInt(s.spec_num_draft_tokens)} ` +
             `proposed tokens · ${s.spec_mean_accepted_length.toFixed(2)} tokens per verify step`,
             s.spec_acceptance_rate));
      spec.replaceChildren(table(["Adapter", "Verify steps", "Proposed", "Accepted",
        "Acceptance rate", "Mean accepted length"],
        s.spec_by_adapter.map(([name, drafts, proposed, accepted]) => [
          name ? h("code", {}, name) : h("span", { class: "muted" }, "base model"),
          fmtInt(drafts), fmtInt(proposed), fmtInt(accepted),
          proposed ? pct(accepted / proposed) : "—",
          drafts ? (1 + accepted / drafts).toFixed(2) : "—"]),
        "No speculative decoding yet."));
      slots.replaceChildren(table(["Replica", "Slot", "Adapter", "Version", "Identity"],
        slotRows(s.replicas), "No slots."));
      tenants.replaceChildren(table(["Tenant", "Weight", "Waiting", "Running", "KV blocks",
        "TTFT p50 / p99", "TPOT p50 / p99", "TTFT steps p50 / p99", "SLO attainment"],
        tenantRows(s.tenants, latency.data), "No tenant has sent a request yet."));
      latencyNote.textContent = `Latency over each tenant's last ${fmtInt(latency.window)} ` +
        "requests in this gateway process";
      replicas.replaceChildren(table(["Replica", "Waiting", "Running", "KV pool",
        "Disk tier", "Slots in use", "Adapters in slots", "Host cache"],
        replicaRows(s.replicas), "No replicas."));
      poolsCard.hidden = !s.pools.length;
      pools.replaceChildren(table(["Pool", "Replicas", "Waiting", "Running", "KV pool",
        "Prefix-cache hit rate", "Blocks handed over", "Blocks taken in", "Blocks refused"],
        poolRows(s.pools), "No pools."));
      const arch = s.architecture ? ` (${s.architecture})` : "";
      stamp.textContent = `Model ${s.served_model}${arch} · updated ${new Date().toLocaleTimeString("en-GB")}`;
    } catch (err) {
      error.show(err);
    }
    if (!stopped) timer = setTimeout(refresh, REFRESH_MS);
  }

  container.append(
    h("div", { class: "page-head" }, h("h1", {}, "Engine"), stamp), error, stats,
    h("div", { class: "card" }, h("div", { class: "page-head" }, h("h2", {}, "Tenants"),
      latencyNote), tenants),
    poolsCard,
    h("div", { class: "card" }, h("h2", {}, "Replicas"), replicas),
    h("div", { class: "card" }, h("h2", {}, "Adapter slots"), slots),
    h("div", { class: "card" }, h("h2", {}, "Speculative decoding, by adapter"), spec));
  await refresh();
  return () => { stopped = true; clearTimeout(timer); };
}
