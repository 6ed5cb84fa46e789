// The live log tail: a streamed fetch of /admin/logs (EventSource cannot send the admin
// header), pausable. A followed stream ends after a few minutes; then it is asked for again.

import { readLines } from "./api.js";
import { el } from "./dom.js";

const KEEP = 600;

export class LogTail {
  constructor() {
    this.box = document.getElementById("log-lines");
    this.state = document.getElementById("log-state");
    this.button = document.getElementById("log-pause");
    this.select = document.getElementById("log-source");
    this.paused = false;
    this.controller = null;
    this.wanted = false;
    this.button.addEventListener("click", () => this.togglePause());
    this.select.addEventListener("change", () => this.restart());
  }

  // Follow the logs while the page has admin access; stop when it loses it.
  want(on) {
    if (on === this.wanted) return;
    this.wanted = on;
    if (on && !this.paused) this.restart();
    if (!on) this.stop();
  }

  togglePause() {
    this.paused = !this.paused;
    this.button.textContent = this.paused ? "Resume" : "Pause";
    if (this.paused) {
      this.stop();
      this.state.textContent = "paused";
    } else {
      this.restart();
    }
  }

  stop() {
    if (this.controller) this.controller.abort();
    this.controller = null;
  }

  restart() {
    this.stop();
    if (!this.wanted || this.paused) return;
    this.box.replaceChildren();
    this.follow(200);
  }

  async follow(lines) {
    const controller = new AbortController();
    this.controller = controller;
    const path = `admin/logs?source=${encodeURIComponent(this.select.value)}&lines=${lines}&follow=true`;
    this.state.textContent = "following";
    try {
      await readLines(path, { signal: controller.signal }, (line) => this.add(line));
    } catch (error) {
      if (controller.signal.aborted) return;
      this.state.textContent = `stopped: ${error.message}`;
      setTimeout(() => this.controller === controller && this.follow(0), 3000);
      return;
    }
    // The server ends a followed tail after a while: ask again (a moment later, so that a
    // gateway with nothing to follow is not asked in a loop).
    if (this.controller === controller) setTimeout(() => this.controller === controller && this.follow(0), 1000);
  }

  add(raw) {
    if (!raw) return;
    const entry = JSON.parse(raw);
    if (entry.line === undefined) return;
    const atBottom = this.box.scrollTop + this.box.clientHeight >= this.box.scrollHeight - 4;
    this.box.append(el("div", { className: entry.source, text: `[${entry.source}] ${entry.line}` }));
    while (this.box.childElementCount > KEEP) this.box.firstElementChild.remove();
    if (atBottom) this.box.scrollTop = this.box.scrollHeight;
  }
}
