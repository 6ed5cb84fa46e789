// The status page: polls the gateway once a second and draws what it says. With the admin key
// (or where admin routes are open) it reads the admin API and can act; without, it shows what
// the public routes show (/health, /metrics/recent, /v1/models) and says it is read-only.

import { adminKey, adoptTokenFromAddress, call, setAdminKey } from "./api.js";
import { drawTraffic } from "./chart.js";
import { ChatBox } from "./chat.js";
import { ago, bytes, clock, duration, el, setMessage, setText, short } from "./dom.js";
import { LogTail } from "./logs.js";
import { isCatalog, renderModels } from "./models.js";

const STAGES = ["download", "conversion", "validation", "store", "load"];
const page = { admin: false, adding: new Set(), busy: new Set(), confirmRemove: null };
const logs = new LogTail();
const chat = new ChatBox();

function setAdmin(admin, note) {
  page.admin = admin;
  document.body.dataset.admin = admin ? "yes" : "no";
  document.getElementById("access").textContent = note;
  logs.want(admin);
}

// ----- engine ---------------------------------------------------------------------------

// Redrawn in place: a fact's element stays while its value changes (so a reader, or a
// selection, is not pulled from under the text every second).
function renderEngine(info, health) {
  const facts = [];
  const add = (name, value, className) => facts.push([name, value ?? "–", className || ""]);
  if (info) {
    add("state", info.state, `state-${info.state}`);
    add("reason", info.reason);
    add("in state for", duration(Date.now() / 1000 - info.since));
    add("pid", info.pid);
    add("uptime", info.uptime_s === null ? "–" : duration(info.uptime_s));
    add("restarts", info.restarts);
    add("last exit", info.last_exit ? `${info.last_exit} (${ago(info.last_exit_at)})` : "–");
    add("memory", info.rss_bytes ? `${bytes(info.rss_bytes)} resident` : "–");
    if (info.memory) add("KV cache", info.memory);
    add("waiting requests", info.waiting_requests);
  } else if (health) {
    // Only what /health says publicly: this view needs no key.
    add("state", health.status, `state-${health.status}`);
    add("reason", health.reason || "");
    // A catalog's models are in their own table (health.models[0] is just the first).
    if (health.models && health.models.length && !health.catalog) add("model", health.models[0]);
    if (health.engine_uptime_s !== undefined) {
      add("uptime", health.engine_uptime_s === null ? "–" : duration(health.engine_uptime_s));
    }
    if (health.uptime_s !== undefined) add("gateway uptime", duration(health.uptime_s));
  }
  // The start's download, dequantization or boot: stage, percent, bytes of total, rate.
  if (health && health.progress) add("progress", health.progress.description);
  const list = document.getElementById("engine-facts");
  const names = facts.map(([name]) => name).join("|");
  if (list.dataset.names !== names) {
    list.dataset.names = names;
    list.replaceChildren(...facts.flatMap(([name]) =>
      [el("dt", { text: name }), el("dd", { id: `engine-${name.replaceAll(" ", "-")}` })]));
  }
  for (const [name, value, className] of facts) {
    const node = document.getElementById(`engine-${name.replaceAll(" ", "-")}`);
    if (node.textContent !== String(value)) node.textContent = String(value);
    if (node.className !== className) node.className = className;
  }
}

// ----- adapters -------------------------------------------------------------------------

function actionButtons(adapter) {
  const name = adapter.name;
  const busy = page.busy.has(name);
  const swap = el("button", {
    type: "button", text: "swap", className: "swap", disabled: busy,
    onclick: () => {
      document.getElementById("add-name").value = name;
      const source = document.getElementById("add-source");
      source.value = adapter.source || "";
      source.focus();
    },
  });
  const rollback = el("button", {
    type: "button", text: "roll back", className: "rollback",
    disabled: busy || !adapter.previous_version,
    title: adapter.previous_version ? `back to ${short(adapter.previous_version)}` : "no previous version",
    onclick: () => act(name, "POST", `admin/adapters/${encodeURIComponent(name)}/rollback`, "rolled back"),
  });
  const confirming = page.confirmRemove === name;
  const remove = el("button", {
    type: "button", text: confirming ? "confirm remove" : "remove", className: "remove", disabled: busy,
    onclick: () => {
      if (!confirming) {
        page.confirmRemove = name;
        setTimeout(() => { if (page.confirmRemove === name) page.confirmRemove = null; }, 5000);
        refresh();
        return;
      }
      page.confirmRemove = null;
      act(name, "DELETE", `admin/adapters/${encodeURIComponent(name)}`, "removed");
    },
  });
  return el("td", { className: "admin-only" }, swap, rollback, remove);
}

let drawnAdapters = "";
function renderAdapters(adapters) {
  // Redrawn only when something shown changed: rows, buttons and focus stay put otherwise.
  const drawn = JSON.stringify([adapters, page.admin, [...page.busy], page.confirmRemove]);
  if (drawn === drawnAdapters) return;
  drawnAdapters = drawn;
  const rows = adapters.map((a) =>
    el("tr", { dataset: { name: a.name, version: a.version || "" } },
      el("td", { className: "name" }, el("code", { text: a.name })),
      el("td", { className: `state state-${a.state}`, text: a.state }),
      el("td", { className: "active", title: a.version }, el("code", { text: short(a.version) })),
      el("td", { className: "previous", title: a.previous_version || "" }, el("code", { text: short(a.previous_version) })),
      el("td", { className: "source", text: a.source ?? "–" }),
      el("td", { className: "preset", text: presetSummary(a.preset),
        title: a.preset && Object.keys(a.preset).length ? JSON.stringify(a.preset, null, 1) : "" }),
      el("td", { className: "follow", text: a.follow === undefined ? "–" : a.follow ? "yes" : "no" }),
      el("td", { className: "loaded", text: clock(a.loaded_at), title: a.loaded_at ? new Date(a.loaded_at * 1000).toISOString() : "" }),
      page.admin ? actionButtons(a) : el("td", { className: "admin-only" })),
  );
  const failures = adapters.filter((a) => a.error || a.follow_error).map((a) =>
    el("tr", { className: "failure", dataset: { name: a.name } },
      el("td", { colspan: 9, className: "error", text: `${a.name}: ${a.error || a.follow_error}` })));
  document.getElementById("adapter-rows").replaceChildren(...rows, ...failures);
}

// The serving version's preset in a line (its whole JSON is the cell's tooltip): the system
// prompt's start, the defaults as name=value, the clamps as name≤value, then what else it sets
// (`GET /admin/adapters`' preset: only the keys it sets).
function presetSummary(preset) {
  if (!preset || !Object.keys(preset).length) return "–";
  const parts = [];
  if (preset.system_prompt !== undefined) {
    const text = preset.system_prompt.length > 32 ? `${preset.system_prompt.slice(0, 31)}…` : preset.system_prompt;
    parts.push(`system${preset.system_prompt_mode === "always" ? " (always)" : ""}: “${text}”`);
  }
  for (const [name, value] of Object.entries(preset.defaults || {})) parts.push(`${name}=${JSON.stringify(value)}`);
  for (const [name, value] of Object.entries(preset.clamps || {})) parts.push(`${name}≤${value}`);
  if (preset.stop && preset.stop.length) parts.push(`stop: ${preset.stop.map((s) => JSON.stringify(s)).join(" ")}`);
  if (preset.response_format) parts.push(`format: ${preset.response_format.type || "set"}`);
  if (preset.user_prompt !== undefined) parts.push("user prompt");
  if (preset.chat_template !== undefined) parts.push("chat template");
  if (preset.renderer !== undefined) parts.push(`renderer: ${preset.renderer}`);
  return parts.join("; ");
}

let drawnAdds = "";
function renderAdds(records) {
  const now = Date.now() / 1000;
  const shown = records.filter((r) => !r.finished || page.adding.has(r.name) || now - r.updated_at < 30);
  const drawn = JSON.stringify(shown);
  if (drawn === drawnAdds) return;
  drawnAdds = drawn;
  document.getElementById("adds").replaceChildren(...shown.map((r) => {
    const at = STAGES.indexOf(r.stage);
    const stages = STAGES.map((stage, index) => {
      let state = "";
      if (r.stage === "done" || index < at) state = "past";
      else if (index === at) state = "current";
      return el("span", { className: `stage ${state}`, text: stage });
    });
    if (r.stage === "failed") stages.push(el("span", { className: "stage failed", text: "failed" }));
    let detail = "";
    if (r.stage === "download" && r.bytes_done) {
      detail = r.bytes_total ? `${bytes(r.bytes_done)} of ${bytes(r.bytes_total)} (${r.percent}%)` : bytes(r.bytes_done);
    }
    return el("div", { className: `add state-${r.finished ? r.stage : "adding"}`, dataset: { name: r.name, stage: r.stage } },
      el("code", { text: r.name }), " ← ", el("span", { className: "add-source", text: r.source }),
      el("span", { className: "stages" }, ...stages), detail,
      r.error ? el("div", { className: "error add-error", text: r.error }) : null);
  }));
}

async function act(name, method, path, done, body) {
  page.busy.add(name);
  setMessage("adapter-message", `${name}: working…`);
  refresh();
  const result = await call(method, path, body);
  page.busy.delete(name);
  if (result.error) setMessage("adapter-message", `${name}: ${result.error}`, true);
  else setMessage("adapter-message", `${name}: ${done}${result.data && result.data.version ? ` (now ${short(result.data.version)})` : ""}`);
  refresh();
}

document.getElementById("add-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const name = document.getElementById("add-name").value.trim();
  const source = document.getElementById("add-source").value.trim();
  const follow = document.getElementById("add-follow").checked;
  if (!name || !source) return;
  page.adding.add(name);
  const fast = setInterval(refresh, 300);  // the add's progress, live
  try {
    await act(name, "PUT", `admin/adapters/${encodeURIComponent(name)}`, "serving", { source, follow });
  } finally {
    clearInterval(fast);
    page.adding.delete(name);
  }
});

document.getElementById("engine-restart").addEventListener("click", async () => {
  setMessage("engine-message", "restarting…");
  const result = await call("POST", "admin/engine/restart");
  setMessage("engine-message", result.error || "restart requested", Boolean(result.error));
  refresh();
});

// ----- key ------------------------------------------------------------------------------

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = document.getElementById("admin-key");
  setAdminKey(input.value.trim());
  input.value = "";
  refresh();
});
document.getElementById("key-forget").addEventListener("click", () => {
  setAdminKey("");
  refresh();
});

// ----- polling --------------------------------------------------------------------------

function renderHealth(result) {
  const badge = document.getElementById("health");
  const status = result.data && result.data.status ? result.data.status : result.status ? `HTTP ${result.status}` : "unreachable";
  badge.textContent = status;
  badge.className = `badge ${status}`;
}

function renderTraffic(result) {
  if (result.error) {
    setMessage("traffic-message", result.error, true);
    return;
  }
  setMessage("traffic-message", "");
  const data = result.data;
  const recent = data.points.slice(-6).filter((p) => p.rps > 0);  // the last half minute
  const mean = (field) => {
    const values = recent.map((p) => p[field]).filter((v) => v !== null);
    return values.length ? values.reduce((a, b) => a + b, 0) / values.length : null;
  };
  const rps = data.points.slice(-6).reduce((a, p) => a + p.rps, 0) / Math.min(6, data.points.length || 1);
  setText("traffic-rps", rps.toFixed(2));
  const latency = mean("latency_avg");
  const ttft = mean("ttft_avg");
  setText("traffic-latency", latency === null ? "–" : `${latency.toFixed(3)} s`);
  setText("traffic-ttft", ttft === null ? "–" : `${ttft.toFixed(3)} s`);
  setText("traffic-in-flight", data.in_flight);
  setText("traffic-queued", data.queued);
  drawTraffic(document.getElementById("traffic-chart"), data.points);
}

// ----- activity (admin) -----------------------------------------------------------------

let drawnActivity = "";
function renderActivity(result) {
  if (result.error) {
    setMessage("activity-message", result.error, true);
    return;
  }
  setMessage("activity-message", "");
  const data = result.data;
  setText("activity-tokens", data.tokens_per_second.toFixed(1));
  setText("activity-kv", data.kv_cache_usage === null ? "–" : `${(data.kv_cache_usage * 100).toFixed(1)} %`);
  const drawn = JSON.stringify(data.requests);
  if (drawn === drawnActivity) return;
  drawnActivity = drawn;
  const tokens = (r) => (r.prompt_tokens === null ? "–" : `${r.prompt_tokens} / ${r.completion_tokens}`);
  document.getElementById("activity-rows").replaceChildren(...data.requests.map((r) =>
    el("tr", { className: r.status >= 400 ? "failure" : "", dataset: { model: r.model, status: r.status } },
      el("td", { text: clock(r.at) }),
      el("td", {}, el("code", { text: r.model })),
      el("td", {}, el("code", { text: short(r.version) })),
      el("td", { className: r.status >= 400 ? "error" : "", text: r.status }),
      el("td", { text: tokens(r) }),
      el("td", { text: `${r.latency_s.toFixed(3)} s${r.stream ? " (stream)" : ""}` }))));
}

let refreshing = null;
async function refreshOnce() {
  const [health, traffic, models] = await Promise.all([
    call("GET", "health"), call("GET", "metrics/recent"), call("GET", "v1/models"),
  ]);
  renderHealth(health);
  renderTraffic(traffic);
  const listed = !models.error && models.data ? models.data.data : [];
  if (!models.error && models.data) chat.setModels(listed.map((m) => m.id));
  else setMessage("chat-message", models.error, true);
  let engine = null;
  let catalog = null;
  if (adminKey()) {
    const catalogShown = Boolean(health.data && health.data.catalog);
    const [engineInfo, adapters, activity, catalogReport] = await Promise.all([
      call("GET", "admin/engine"), call("GET", "admin/adapters"), call("GET", "admin/activity"),
      catalogShown ? call("GET", "admin/models") : Promise.resolve(null),
    ]);
    if (adapters.status === 401 || adapters.status === 403) {
      setAdmin(false, `Read-only: the key given was refused (${adapters.error}).`);
    } else {
      setAdmin(true, "Admin: this tab holds the admin key (sessionStorage, sent as a header).");
      if (adapters.data && adapters.data.data) {
        renderAdapters(adapters.data.data);
        renderAdds(adapters.data.progress || []);
      } else if (adapters.error) {
        setMessage("adapter-message", adapters.error, true);
      }
      // A catalog's /admin/engine holds one engine per model: the models table shows them.
      if (!engineInfo.error && !catalogShown) engine = engineInfo.data;
      if (catalogReport && !catalogReport.error) catalog = catalogReport.data;
      else if (catalogReport) setMessage("models-message", catalogReport.error, true);
      renderActivity(activity);
    }
  } else {
    setAdmin(false,
      "Read-only: enter the admin key (--admin-key, or the admin-token file in the gateway's cache dir) to add, swap, roll back or remove adapters, restart the engine and read the logs.");
  }
  renderModels(health.data, page.admin ? catalog : null, listed, page.admin, refresh);
  if (!page.admin) {
    const names = (health.data && health.data.models) || [];
    // Past the base model, or for a catalog every name that is not one of its models.
    const adapters = isCatalog() ? names.filter((name) => !(name in health.data.catalog)) : names.slice(1);
    renderAdapters(adapters.map((name) => ({ name, state: "served" })));
    renderAdds([]);
  }
  renderEngine(engine, health.data);
}

function refresh() {
  if (!refreshing) {
    refreshing = refreshOnce().finally(() => { refreshing = null; });
  }
  return refreshing;
}

async function loop() {
  await refresh();
  setTimeout(loop, 1000);
}

adoptTokenFromAddress();
loop();
