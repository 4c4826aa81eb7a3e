// Engine: queue, KV cache, prefix-cache hit rate and adapter slots of the whole deployment,
// then each replica's, refreshed every 2 s.
import { api } from "../api.js";
import { errorLine, fmtInt, h, table } from "../dom.js";

export const title = "Engine";
const REFRESH_MS = 2000;

function stat(label, value, sub, fraction) {
  return h("div", { class: "stat" }, h("div", { class: "label" }, label),
    h("div", { class: "value" }, value), sub ? h("div", { class: "sub" }, sub) : null,
    fraction === undefined ? null : (() => {
      const bar = h("span");
      bar.style.width = `${Math.max(0, Math.min(1, fraction)) * 100}%`;
      return h("div", { class: "meter" }, bar);
    })());
}

const pct = (x) => `${(100 * x).toFixed(1)}%`;

// One row per replica: its queue, KV pool and what sits in its device slots.
function replicaRows(replicas) {
  return replicas.map((r) => {
    const loaded = r.slots.filter(Boolean);
    return [String(r.replica), fmtInt(r.num_waiting), fmtInt(r.num_running),
      pct(r.kv_pool_usage), `${loaded.length} / ${r.max_loras}`,
      loaded.length
        ? h("span", {}, loaded.flatMap((slot, i) => [i ? ", " : null,
            h("strong", {}, slot.model || "(unknown)"), " ", h("code", {}, slot.identity)]))
        : h("span", { class: "muted" }, "none"),
      `${r.host_adapters.length} / ${r.max_cpu_loras}`];
  });
}

export async function render(container) {
  const stamp = h("span", { class: "muted", id: "engine-updated" });
  const error = errorLine();
  const stats = h("div", { class: "stats", id: "engine-stats" });
  const slots = h("div", { id: "engine-slots" });
  const replicas = h("div", { id: "engine-replicas" });
  let timer = null;
  let stopped = false;

  async function refresh() {
    try {
      const s = await api("GET", "/admin/api/engine");
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
        stat("Adapter slots", `${s.slots.filter(Boolean).length} / ${s.slots.length}`,
             `${fmtInt(s.adapter_slot_loads)} loads · ${fmtInt(s.adapter_slot_evictions)} ` +
             `evictions · ${s.adapter_load_seconds.toFixed(2)} s loading`),
        stat("Steps", fmtInt(s.num_steps), `${fmtInt(s.num_preemptions)} preemptions`));
      slots.replaceChildren(table(["Slot", "Adapter", "Version", "Identity"],
        s.slots.map((slot, i) => slot
          ? [String(i), h("strong", {}, slot.model || "(unknown)"),
             slot.version ? `v${slot.version}${slot.status === "deleted" ? " (deleted)" : ""}` : "—",
             h("code", {}, slot.identity)]
          : [String(i), h("span", { class: "muted" }, "empty"), "—", "—"]), "No slots."));
      replicas.replaceChildren(table(["Replica", "Waiting", "Running", "KV pool",
        "Slots in use", "Adapters in slots", "Host cache"], replicaRows(s.replicas),
        "No replicas."));
      stamp.textContent = `Model ${s.served_model} · updated ${new Date().toLocaleTimeString("en-GB")}`;
    } catch (err) {
      error.show(err);
    }
    if (!stopped) timer = setTimeout(refresh, REFRESH_MS);
  }

  container.append(
    h("div", { class: "page-head" }, h("h1", {}, "Engine"), stamp), error, stats,
    h("div", { class: "card" }, h("h2", {}, "Replicas"), replicas),
    h("div", { class: "card" }, h("h2", {}, "Adapter slots"), slots));
  await refresh();
  return () => { stopped = true; clearTimeout(timer); };
}
