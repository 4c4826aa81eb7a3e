// A few DOM helpers. Text always goes in as text (never innerHTML): names come from users.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (name === "class") el.className = value;
    else if (name in el && typeof value !== "string") el[name] = value;
    else el.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

export function field(label, input, hint) {
  const id = input.id || `f-${Math.random().toString(36).slice(2, 9)}`;
  input.id = id;
  return h("div", { class: "field" }, h("label", { for: id }, label), input,
           hint ? h("small", { class: "muted" }, hint) : null);
}

/** An inline error line, shown next to what caused it. */
export function errorLine() {
  const el = h("p", { class: "error", role: "alert", hidden: true });
  el.show = (err) => { el.textContent = err.message || String(err); el.hidden = false; };
  el.clear = () => { el.textContent = ""; el.hidden = true; };
  return el;
}

/** Calls of a list's load race when its filter changes while a load is under way: each
 * call of the returned function starts one and returns `stale()`, true once a later load
 * started, so an older answer that arrives last never overwrites the newer one. */
export function latestLoad() {
  let latest = 0;
  return () => { const mine = ++latest; return () => mine !== latest; };
}

export function fmtInt(n) {
  return n === null || n === undefined ? "∞" : Number(n).toLocaleString("en-US");
}

export function fmtBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  if (n < 1024 ** 3) return `${(n / 1024 ** 2).toFixed(1)} MiB`;
  return `${(n / 1024 ** 3).toFixed(2)} GiB`;
}

/** "used / quota (pct%)", each formatted by ``fmt``; a null quota is "unlimited". */
export function fmtUsed(n, quota, fmt) {
  const pct = quota ? ` (${Math.round((100 * n) / quota)}%)` : "";
  return `${fmt(n)} / ${quota === null || quota === undefined ? "unlimited" : fmt(quota)}${pct}`;
}

export function fmtTime(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  return d.toLocaleString("en-GB", { year: "numeric", month: "short", day: "2-digit",
                                     hour: "2-digit", minute: "2-digit" });
}

/** A button that asks to be clicked twice (no modal dialogs): returns the button. */
export function confirmButton(label, confirmLabel, action, cls = "danger") {
  let armed = false;
  let timer = null;
  const button = h("button", { type: "button", class: cls }, label);
  button.addEventListener("click", async () => {
    if (!armed) {
      armed = true;
      button.textContent = confirmLabel;
      button.classList.add("armed");
      timer = setTimeout(() => { armed = false; button.textContent = label;
                                 button.classList.remove("armed"); }, 5000);
      return;
    }
    clearTimeout(timer);
    button.disabled = true;
    try { await action(); } finally {
      armed = false; button.disabled = false; button.textContent = label;
      button.classList.remove("armed");
    }
  });
  return button;
}

/** A table whose cells carry their column name, so narrow screens show them as cards.
 * Where it is still wider than its card, a hint says that it scrolls sideways. */
export function table(columns, rows, empty) {
  if (!rows.length) return h("p", { class: "muted empty" }, empty);
  const hint = h("p", { class: "muted scroll-hint", hidden: true }, "Scroll sideways for more →");
  const wrap = h("div", { class: "table-wrap" }, h("table", { class: "responsive" },
    h("thead", {}, h("tr", {}, columns.map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows.map((cells) => {
      const tr = h("tr");
      cells.forEach((cell, i) => tr.append(h("td", { "data-label": columns[i] }, cell)));
      return tr;
    }))));
  new ResizeObserver(() => { hint.hidden = wrap.scrollWidth <= wrap.clientWidth + 1; })
    .observe(wrap);
  return h("div", {}, hint, wrap);
}

/** Checks a name input against its pattern before a submit; shows a sentence naming the
 * rule (``rule``) in ``error`` instead of the browser's generic tooltip. True if valid. */
export function checkName(input, what, rule, error) {
  const value = input.value.trim();
  let message = null;
  if (!value) message = `${what} is required.`;
  else if (input.pattern && !new RegExp(`^(?:${input.pattern})$`).test(value)) {
    message = `${what} "${value}" is not allowed: ${rule}.`;
  }
  input.setAttribute("aria-invalid", message ? "true" : "false");
  if (message) { error.show(new Error(message)); input.focus(); }
  return message === null;
}

export function badge(text, kind) {
  return h("span", { class: `badge ${kind || text}` }, text);
}
