// The chat page: streams answers from /v1/chat/completions (server-sent events read from a
// fetch body), Stop aborts the fetch (the server then aborts the request), and each answer
// shows its TTFT and decode speed measured here. Images attached to a message go with it
// as image_url parts (data URLs), for a vision-language model.

import { renderMarkdown } from "./markdown.js";

const API_KEY_STORAGE = "llmserve.apiKey";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), system: $("system"), temperature: $("temperature"), topP: $("top-p"),
  maxTokens: $("max-tokens"), apiKey: $("api-key"), newChat: $("new-chat"),
  notice: $("notice"), conversation: $("conversation"), composer: $("composer"),
  prompt: $("prompt"), send: $("send"), stop: $("stop"), attach: $("attach"),
  imageFile: $("image-file"), attachments: $("attachments"),
};

// The turns sent as history with each request: {role, content}, the system prompt aside.
let turns = [];
let inFlight = null;  // the AbortController of the answer being streamed
// the images attached to the next message: {url (a data URL, sent), preview (a blob URL)}
let pending = [];

function apiHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = ui.apiKey.value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

function setNotice(text) {
  ui.notice.textContent = text;
}

async function errorMessage(response) {
  if (response.status === 401) {
    ui.apiKey.focus();
    return "This server needs an API key: enter it under API key.";
  }
  try {
    const body = await response.json();
    return body.error?.message ?? `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function loadModels() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: apiHeaders() });
  } catch (error) {
    setNotice(`Cannot reach the server: ${error.message}`);
    return;
  }
  if (!response.ok) {
    setNotice(await errorMessage(response));
    return;
  }
  const { data } = await response.json();
  const chosen = ui.model.value;
  // a many-model server says whether each model is loaded (the first request loads it)
  const label = (card) => (card.status ? `${card.id} (${card.status.value})` : card.id);
  ui.model.replaceChildren(...data.map((card) => new Option(label(card), card.id)));
  if (data.some((card) => card.id === chosen)) ui.model.value = chosen;
  setNotice("");
}

// ---- the conversation view ----------------------------------------------------------------

function thumbnails(previews) {
  return previews.map((src) => {
    const img = document.createElement("img");
    img.src = src;
    img.alt = "an attached image";
    return img;
  });
}

function addMessage(role, text, previews = []) {
  $("empty")?.remove();
  const message = document.createElement("article");
  message.className = `message ${role}`;
  const body = document.createElement("div");
  body.className = "body";
  const stats = document.createElement("div");
  stats.className = "stats";
  // the model's reasoning (a server with --reasoning-parser sends it apart from the answer):
  // collapsed, shown as plain text, never sent back as history
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const thought = document.createElement("div");
  thought.className = "thought";
  reasoning.append(summary, thought);
  message.append(reasoning, body, stats);
  ui.conversation.append(message);
  if (role === "user") body.textContent = text;
  if (previews.length) {
    const images = document.createElement("div");
    images.className = "images";
    images.append(...thumbnails(previews));
    message.prepend(images);
  }
  scrollToEnd(true);
  return { message, body, stats, reasoning, thought };
}

function scrollToEnd(force) {
  const view = ui.conversation;
  const nearEnd = view.scrollHeight - view.scrollTop - view.clientHeight < 80;
  if (force || nearEnd) view.scrollTop = view.scrollHeight;
}

/** Re-renders an answer's Markdown at most once a frame while tokens stream in. */
function answerView(view) {
  let text = "";
  let scheduled = false;
  const render = () => {
    scheduled = false;
    view.body.replaceChildren(renderMarkdown(text));
    scrollToEnd(false);
  };
  return {
    get text() { return text; },
    append(delta) {
      text += delta;
      if (!scheduled) {
        scheduled = true;
        requestAnimationFrame(render);
      }
    },
    appendReasoning(delta) {
      view.reasoning.hidden = false;
      view.thought.textContent += delta;
      scrollToEnd(false);
    },
    flush: render,
  };
}

function formatStats(timing, stopped) {
  const parts = [];
  if (timing.firstToken !== null) {
    parts.push(`TTFT ${formatSeconds((timing.firstToken - timing.start) / 1000)}`);
  }
  const numTokens = timing.usageTokens ?? timing.chunks;
  const decodeSeconds = (timing.lastToken - timing.firstToken) / 1000;
  if (numTokens > 1 && decodeSeconds > 0) {
    parts.push(`${((numTokens - 1) / decodeSeconds).toFixed(1)} tok/s`);
  }
  parts.push(`${numTokens} token${numTokens === 1 ? "" : "s"}`);
  if (stopped) parts.push("stopped");
  return parts.join(" · ");
}

function formatSeconds(seconds) {
  return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds.toFixed(2)} s`;
}

// ---- streaming ----------------------------------------------------------------------------

/** The JSON payloads of a server-sent event stream, until `data: [DONE]`. */
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function requestBody() {
  const system = ui.system.value.trim();
  const messages = system ? [{ role: "system", content: system }, ...turns] : [...turns];
  const body = {
    model: ui.model.value, messages, stream: true,
    stream_options: { include_usage: true },
    temperature: Number(ui.temperature.value), top_p: Number(ui.topP.value),
  };
  const maxTokens = Number.parseInt(ui.maxTokens.value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

/** Streams one answer into `answer`; fills `timing` (performance.now() times). */
async function streamAnswer(body, signal, answer, timing) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: apiHeaders(), body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  for await (const chunk of sseData(response.body)) {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) timing.usageTokens = chunk.usage.completion_tokens;
    const delta = chunk.choices?.[0]?.delta ?? {};
    const thought = delta.reasoning_content ?? delta.reasoning;
    if (thought || delta.content) {
      const now = performance.now();
      timing.firstToken ??= now;
      timing.lastToken = now;
      timing.chunks += 1;
    }
    if (thought) answer.appendReasoning(thought);
    if (delta.content) answer.append(delta.content);
  }
}

async function send() {
  const text = ui.prompt.value.trim();
  if ((!text && !pending.length) || inFlight) return;
  ui.prompt.value = "";
  const images = pending;
  pending = [];
  showAttachments();
  // New chat may replace `turns` while this answer streams: the answer joins its own
  const history = turns;
  const content = images.length
    ? [...images.map(({ url }) => ({ type: "image_url", image_url: { url } })),
       { type: "text", text }]
    : text;
  history.push({ role: "user", content });
  addMessage("user", text, images.map(({ preview }) => preview));
  const view = addMessage("assistant", "");
  const answer = answerView(view);
  const timing = { start: performance.now(), firstToken: null, lastToken: null, chunks: 0,
                   usageTokens: null };
  const controller = new AbortController();
  setBusy(controller);
  let stopped = false;
  let failure = null;
  try {
    await streamAnswer(requestBody(), controller.signal, answer, timing);
  } catch (error) {
    stopped = error.name === "AbortError";
    if (!stopped) failure = error.message;
  } finally {
    setBusy(null);
  }
  answer.flush();
  if (answer.text) {
    history.push({ role: "assistant", content: answer.text });
  } else {
    history.pop();  // no answer came: the question leaves the history too
  }
  view.message.classList.toggle("failed", failure !== null);
  view.message.classList.toggle("stopped", stopped);
  view.stats.textContent = failure ?? formatStats(timing, stopped);
}

function readDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachImages() {
  for (const file of ui.imageFile.files) {
    pending.push({ url: await readDataURL(file), preview: URL.createObjectURL(file) });
  }
  ui.imageFile.value = "";
  showAttachments();
  ui.prompt.focus();
}

function showAttachments() {
  ui.attachments.replaceChildren(...thumbnails(pending.map(({ preview }) => preview)));
}

function setBusy(controller) {
  inFlight = controller;
  ui.send.hidden = controller !== null;
  ui.stop.hidden = controller === null;
  document.body.classList.toggle("busy", controller !== null);
}

// ---- wiring -------------------------------------------------------------------------------

function showValue(input, output) {
  const update = () => { output.textContent = input.value; };
  input.addEventListener("input", update);
  update();
}

$("settings").addEventListener("submit", (event) => event.preventDefault());
ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
ui.stop.addEventListener("click", () => inFlight?.abort());
ui.attach.addEventListener("click", () => ui.imageFile.click());
ui.imageFile.addEventListener("change", attachImages);
ui.newChat.addEventListener("click", () => {
  inFlight?.abort();
  turns = [];
  pending = [];
  showAttachments();
  ui.conversation.replaceChildren();
  ui.prompt.focus();
});
ui.apiKey.value = localStorage.getItem(API_KEY_STORAGE) ?? "";
ui.apiKey.addEventListener("change", () => {
  localStorage.setItem(API_KEY_STORAGE, ui.apiKey.value.trim());
  loadModels();
});
ui.model.addEventListener("focus", loadModels);  // which models are loaded now
showValue(ui.temperature, $("temperature-value"));
showValue(ui.topP, $("top-p-value"));
loadModels();
ui.prompt.focus();
