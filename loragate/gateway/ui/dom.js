// Building the page from data: text goes in as text (textContent, text nodes), never as HTML,
// so a name, source or error carrying markup shows as the characters it is.

export function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "text") node.textContent = String(value);
    else if (name === "className") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (name === "disabled" || name === "title" || name === "type") node[name] = value;
    else node.setAttribute(name, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function setText(id, text) {
  document.getElementById(id).textContent = text === null || text === undefined ? "–" : String(text);
}

export function setMessage(id, text, isError) {
  const node = document.getElementById(id);
  node.textContent = text || "";
  node.classList.toggle("error", Boolean(isError));
}

export function short(digest) {
  return digest ? String(digest).slice(0, 12) : "–";
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

export function clock(epochSeconds) {
  return epochSeconds ? new Date(epochSeconds * 1000).toLocaleTimeString() : "–";
}

export function ago(epochSeconds) {
  if (!epochSeconds) return "–";
  return `${duration(Date.now() / 1000 - epochSeconds)} ago`;
}

export function bytes(count) {
  if (count === null || count === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = count;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}
