// "Try it": one prompt, answered by two models side by side, streamed as it comes.

import { streamChat } from "./api.js";
import { el, setMessage } from "./dom.js";

const PANES = [1, 2];

export class ChatBox {
  constructor() {
    this.models = [];
    this.running = null;
    for (const pane of PANES) {
      const select = document.getElementById(`chat-model-${pane}`);
      select.addEventListener("change", () => { select.dataset.chosen = "yes"; });
    }
    document.getElementById("chat-form").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
  }

  setModels(models) {
    if (JSON.stringify(models) === JSON.stringify(this.models)) return;
    this.models = models;
    PANES.forEach((pane, index) => {
      const select = document.getElementById(`chat-model-${pane}`);
      const chosen = select.dataset.chosen === "yes" ? select.value : null;
      const options = models.map((id) => el("option", { value: id, text: id }));
      if (pane > 1) options.unshift(el("option", { value: "", text: "(none)" }));
      select.replaceChildren(...options);
      // First the base model beside the first adapter; later, what the person picked.
      const fallback = models[index] || models[0] || "";
      select.value = chosen !== null && (chosen === "" || models.includes(chosen)) ? chosen : fallback;
    });
  }

  async send() {
    const prompt = document.getElementById("chat-prompt").value.trim() || "Hello";
    if (this.running) this.running.abort();
    const controller = new AbortController();
    this.running = controller;
    setMessage("chat-message", "");
    const jobs = PANES.map(async (pane) => {
      const model = document.getElementById(`chat-model-${pane}`).value;
      const answer = document.getElementById(`chat-answer-${pane}`);
      answer.textContent = "";
      answer.dataset.model = model;
      answer.dataset.done = model ? "no" : "yes";
      if (!model) return;
      try {
        await streamChat(model, prompt, (text) => answer.append(text), controller.signal);
      } catch (error) {
        if (!controller.signal.aborted) setMessage("chat-message", `${model}: ${error.message}`, true);
      } finally {
        answer.dataset.done = "yes";
      }
    });
    await Promise.all(jobs);
  }
}
