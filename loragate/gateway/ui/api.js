// The gateway's API as the page uses it: the admin key (this tab only), JSON calls, streams.
// The key lives in sessionStorage and goes out as an Authorization header, never a cookie:
// a page elsewhere can make the browser send cookies, not this header.

const KEY_SLOT = "loragate.adminKey";

export function adminKey() {
  return sessionStorage.getItem(KEY_SLOT) || "";
}

export function setAdminKey(key) {
  if (key) sessionStorage.setItem(KEY_SLOT, key);
  else sessionStorage.removeItem(KEY_SLOT);
}

// The gateway's start log line gives the page's address with its per-start token after
// "#token=" (a fragment never reaches a server or its logs): kept for this tab, then taken out
// of the address bar and the history. Returns whether it found one.
export function adoptTokenFromAddress(where = window.location, history = window.history) {
  const match = /^#token=([A-Za-z0-9_-]+)$/.exec(where.hash);
  if (!match) return false;
  setAdminKey(match[1]);
  history.replaceState(null, "", where.pathname + where.search);
  return true;
}

function headers(extra) {
  const all = { Accept: "application/json", ...extra };
  const key = adminKey();
  if (key) all.Authorization = `Bearer ${key}`;
  return all;
}

// Paths are relative to the page (/ui), so a gateway mounted under a prefix works too.
export async function call(method, path, body) {
  const init = { method, headers: headers(), cache: "no-store" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    return { status: 0, data: null, error: `the gateway did not answer (${error.message})` };
  }
  let data = null;
  const text = await response.text();
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = text;
  }
  const error = response.ok ? null : errorMessage(data, response.status);
  return { status: response.status, data, error };
}

export function errorMessage(data, status) {
  if (data && typeof data === "object" && data.error) {
    return String(data.error.message || data.error);
  }
  return `HTTP ${status}`;
}

// Read a streamed answer line by line; resolves when the stream ends or is aborted.
export async function readLines(path, init, onLine) {
  const response = await fetch(path, { ...init, headers: headers(init.headers), cache: "no-store" });
  if (!response.ok) {
    const text = await response.text();
    let data = text;
    try { data = JSON.parse(text); } catch { /* not JSON: shown as is */ }
    throw new Error(errorMessage(data, response.status));
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    const lines = pending.split("\n");
    pending = lines.pop();
    for (const line of lines) onLine(line);
  }
  if (pending) onLine(pending);
}

// Stream a chat answer (server-sent events); onText gets each piece of text as it comes.
export async function streamChat(model, prompt, onText, signal) {
  const body = {
    model,
    messages: [{ role: "user", content: prompt }],
    max_tokens: 64,
    temperature: 0,
    stream: true,
  };
  const init = {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify(body),
    signal,
  };
  await readLines("v1/chat/completions", init, (line) => {
    if (!line.startsWith("data: ") || line === "data: [DONE]") return;
    const event = JSON.parse(line.slice(6));
    if (event.error) throw new Error(errorMessage(event, 500));
    const choice = event.choices && event.choices[0];
    const text = choice && choice.delta && choice.delta.content;
    if (text) onText(text);
  });
}
