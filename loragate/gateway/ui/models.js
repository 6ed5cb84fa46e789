// A catalog's base models (a gateway serving the config file's `models:`): each model's
// residency, engine state, memory, last use, adapters, loads and unloads, the swaps, and Load
// and Unload buttons (admin key). A gateway serving one base model has no catalog in /health:
// the section stays hidden and the page shows what it always did.

import { call } from "./api.js";
import { bytes, clock, duration, el, setMessage, setText } from "./dom.js";

const changing = new Set();  // models with a load or unload under way from this page

// Whether the gateway serves a catalog, as its last /health said (kept while it is unreachable).
export function isCatalog() {
  return document.body.dataset.catalog === "yes";
}

// health: /health's body (its `catalog`: residency, state, reason by model, public);
// report: /admin/models (admin key) or null; listed: /v1/models' entries (each adapter's
// `parent`), the adapters shown without a key; refresh: redraws the page after a change.
export function renderModels(health, report, listed, admin, refresh) {
  if (health) document.body.dataset.catalog = health.catalog ? "yes" : "no";
  if (!health || !health.catalog) return;
  const models = report ? report.models : Object.entries(health.catalog).map(([id, model]) => ({
    id, ...model, adapters: listed.filter((entry) => entry.parent === id).map((entry) => entry.id),
  }));
  renderSwaps(report);
  drawRows(models, admin, refresh);
}

function renderSwaps(report) {
  if (!report) {
    setText("models-swaps", "–");
    setText("models-last-swap", "–");
    setText("models-room", "–");
    return;
  }
  setText("models-swaps", report.swaps);
  const last = report.last_swap;
  setText("models-last-swap", last
    ? `${last.loaded} loaded, ${last.unloaded.join(", ")} unloaded at ${clock(last.at)} (${last.reason})`
    : "none yet");
  const cap = report.max_loaded_models === null ? "no cap on models" : `at most ${report.max_loaded_models} loaded`;
  const budget = report.memory_budget === null ? "" : `, ${bytes(report.memory_budget)} budget`;
  setText("models-room", cap + budget);
}

let drawn = "";
function drawRows(models, admin, refresh) {
  // Redrawn only when something shown changed: buttons and focus stay put otherwise (the
  // idle time is shown to the second, so rounded to ten while it is over a minute).
  const shown = models.map((m) => ({ ...m, idle_seconds: idleShown(m.idle_seconds) }));
  const key = JSON.stringify([shown, admin, [...changing]]);
  if (key === drawn) return;
  drawn = key;
  const rows = shown.map((m) =>
    el("tr", { dataset: { model: m.id, residency: m.residency } },
      el("td", { className: "name", title: m.model || "" }, el("code", { text: m.id }),
        m.keep ? el("small", { text: " kept" }) : null),
      el("td", { className: `residency state-${m.residency}`, text: m.residency }),
      el("td", { className: `state state-${m.state}`, text: m.state, title: m.reason || "" }),
      el("td", { className: "memory", text: bytes(m.memory_bytes) }),
      el("td", { className: "last-use", text: lastUse(m) }),
      el("td", { className: "in-flight", text: m.in_flight ?? "–" }),
      el("td", { className: "adapters", text: m.adapters.length ? m.adapters.join(", ") : "–" }),
      el("td", { className: "loads", text: m.loads === undefined ? "–" : `${m.loads} / ${m.unloads}`,
        title: m.last_unload_reason ? `last unloaded: ${m.last_unload_reason}` : "" }),
      admin ? buttons(m, refresh) : el("td", { className: "admin-only" })));
  const failures = shown.filter((m) => m.residency === "failed" && m.reason).map((m) =>
    el("tr", { className: "failure", dataset: { model: m.id } },
      el("td", { colspan: 9, className: "error", text: `${m.id}: ${m.reason}` })));
  document.getElementById("model-rows").replaceChildren(...rows, ...failures);
}

function idleShown(seconds) {
  if (seconds === undefined || seconds === null) return seconds;
  return seconds < 60 ? Math.round(seconds) : Math.round(seconds / 10) * 10;
}

function lastUse(model) {
  if (model.idle_seconds === undefined) return "–";
  if (!model.loads) return "never";
  return model.in_flight ? "now" : `${duration(model.idle_seconds)} ago`;
}

function buttons(model, refresh) {
  const busy = changing.has(model.id);
  const up = model.residency === "resident" || model.residency === "loading";
  return el("td", { className: "admin-only" },
    el("button", {
      type: "button", text: "load", className: "load", disabled: busy || up || model.residency === "failed",
      onclick: () => change(model.id, "load", refresh),
    }),
    el("button", {
      type: "button", text: "unload", className: "unload", disabled: busy || !up,
      onclick: () => change(model.id, "unload", refresh),
    }));
}

// POST /admin/models/{id}/load|unload with the tab's key, as the page's other admin actions.
async function change(id, action, refresh) {
  changing.add(id);
  setMessage("models-message", `${id}: ${action === "load" ? "loading" : "unloading"}…`);
  refresh();
  const result = await call("POST", `admin/models/${encodeURIComponent(id)}/${action}`);
  changing.delete(id);
  if (result.error) setMessage("models-message", `${id}: ${result.error}`, true);
  else setMessage("models-message", `${id}: ${result.data.residency} (${result.data.state})`);
  refresh();
}
